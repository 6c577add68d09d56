"""The simulator's engine model: how long one engine step takes, and how big the KV cache is.

A pure function of the model's facts, the device profile, the parallel layout and the batch,
so the server's scheduler, the virtual-clock runs of `sim.virtual` and offline estimates all
use the same figures. A step runs its kernels one after another, each on its own roofline:

- the linear layers: every weight the step touches read once (per GPU: 1/tp of them; for a
  mixture of experts, the shared part and the experts its tokens are routed to), or 2 FLOPs
  per active parameter per token, whichever takes longer; the LM head only for the tokens
  that are sampled;
- attention: each GPU's share of the KV cache of every token attended read once (an MLA
  latent whole on every GPU), or 4 x layers x heads x head_dim FLOPs per attended position
  (MLA: its absorbed width; a prefill chunk's quadratic part), whichever takes longer;
- tensor parallelism adds two all-reduces per layer (latency + ring transfer of the step's
  activations over the device's interconnect: NVLink, Infinity Fabric or PCIe);
- the host's CPU: a fixed cost per step (scheduling, sampling, launches), and a cost per
  running sequence (its bookkeeping, inputs and outputs) that overlaps the GPU's work and
  shows only when it outlasts it; both fitted on published runs;
- the API server's CPU per streamed token as a floor on a step: it works beside the engine,
  so it caps the token rate rather than adding to each step (vLLM before 0.6.0 processed
  outputs after each step in the engine's process: `serial_output_processing` adds it).

Bandwidth is the datasheet's times an achieved fraction, FLOPs the device's measured matmul rate
times one (`Overheads`), so a roofline over the profile's own figures bounds what the model can
reach. Near its ridge a GEMM reaches neither bound: its time is the p-norm of the two
(`Overheads.roofline_sharpness`).

`PROFLLM_SIM_SLOWDOWN` (a factor, default 1.0) multiplies every step: a slower machine on demand.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from pytest_profllm.sim.hardware import GIB, DeviceProfile, Overheads
from pytest_profllm.sim.models import ModelFacts

SLOWDOWN_ENV = "PROFLLM_SIM_SLOWDOWN"


def slowdown_from_env() -> float:
    text = os.environ.get(SLOWDOWN_ENV, "").strip()
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{SLOWDOWN_ENV}={text!r}: expected a positive number") from None
    if not (0 < value < math.inf):
        raise ValueError(f"{SLOWDOWN_ENV}={text!r}: expected a positive number")
    return value


def _gemm_seconds(read_s: float, compute_s: float, sharpness: float) -> float:
    """A GEMM's time from its two bounds: the larger (a roofline, sharpness inf), or their
    p-norm, which is longer near the ridge where both take about as long."""
    if math.isinf(sharpness):
        return max(read_s, compute_s)
    return float((read_s**sharpness + compute_s**sharpness) ** (1 / sharpness))


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes."""

    decode_seqs: int = 0  # sequences emitting a token from their KV cache
    decode_context: int = 0  # tokens those sequences attend to (their KV cache, summed)
    prefill_tokens: int = 0  # prompt tokens computed this step (chunks)
    prefill_context: int = 0  # tokens already in the KV cache that the prefill chunks read
    prefill_attended: float = 0.0  # sum over prefill tokens of the positions each attends to
    emitted: int = 0  # tokens sampled and streamed to clients after this step
    prefill_seqs: int = 0  # sequences with a prefill chunk in this step
    encoder_flops: float = 0.0  # vision encoders run for images first scheduled this step
    # Draft tokens the decoders' drafts put through the target model to verify them
    # (speculative decoding: k per decoding sequence). Each is a token of the linear layers
    # and of the LM head, and attends to its sequence's KV cache, which the step reads once.
    spec_tokens: int = 0


@dataclass(frozen=True)
class EngineModel:
    model: ModelFacts
    device: DeviceProfile
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    api_server_count: int = 1
    slowdown: float = 1.0
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: "auto" (the model's) or fp8*
    # vLLM before 0.6.0 processed a step's outputs (detokenise, stream) in the engine's own
    # process after the step, so their CPU added to every step; since 0.6.0 the API server is
    # a process of its own and the engine's output processing overlaps the next step.
    serial_output_processing: bool = False

    @property
    def _fp8(self) -> bool:
        return self.model.quantization == "fp8"

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token over all layers: half the model's bf16 figure in FP8."""
        fp8 = self.kv_cache_dtype.startswith("fp8")
        return self.model.kv_bytes_per_token * (0.5 if fp8 else 1.0)

    @property
    def _lm_head_params(self) -> int:
        return self.model.vocab_size * self.model.hidden_size

    @property
    def _body_params(self) -> int:
        """Active parameters a token's forward pass multiplies by, but for the embeddings
        (a lookup) and the LM head (computed for sampled tokens only)."""
        embeddings = self._lm_head_params * (1 if self.model.tie_word_embeddings else 2)
        return max(self.model.active_params - embeddings, 0)

    @property
    def _expert_params(self) -> int:
        """One routed expert of one layer: its gate, up and down projections."""
        return 3 * self.model.hidden_size * self.model.moe_intermediate_size

    def _achieved_rates(self, fp8: bool) -> tuple[float, float]:
        """The bandwidth (bytes/s) and matmul rate (FLOP/s, FP8 or bf16) a step's kernels
        reach: the datasheet's bandwidth and the measured matmul rate, times their fitted
        shares."""
        over = self.device.overheads
        bandwidth = self.device.memory_bandwidth_gbs * 1e9 * over.bandwidth_efficiency
        return bandwidth, self.device.matmul_flops(fp8) * over.compute_efficiency

    @property
    def _kv_share(self) -> float:
        """The share of a token's KV cache each GPU holds and reads: 1/tp of the KV heads, but
        a whole head where there are fewer heads than GPUs (vLLM replicates them), and all of
        an MLA latent, which every GPU keeps whole for its share of the query heads."""
        model = self.model
        if model.kv_lora_rank:
            return 1.0
        kv_heads = model.num_key_value_heads
        return max(kv_heads / self.tensor_parallel_size, 1) / kv_heads

    def _attention_flops(self, decode_positions: float, prefill_positions: float) -> float:
        """Attention FLOPs over all layers and heads (all GPUs): per position attended, the
        scores and the weighted values (QK^T and PV, a multiply-add each per dimension). MLA
        in vLLM decodes absorbed (each head scores against the latent and its rope part, then
        sums the latent: kv_lora_rank + rope, then kv_lora_rank wide) and prefills with the
        latent expanded into the heads' keys (nope + rope) and values."""
        model = self.model
        per_head = 2.0 * model.num_hidden_layers * model.num_attention_heads
        if model.kv_lora_rank:
            decode_width = 2 * model.kv_lora_rank + model.qk_rope_head_dim
            prefill_width = model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim
        else:
            decode_width = prefill_width = 2 * (model.v_head_dim or model.head_dim)
        return per_head * (decode_width * decode_positions + prefill_width * prefill_positions)

    def _attention_seconds(self, work: StepWork, bandwidth: float, flops_per_s: float) -> float:
        """Attention: each GPU reads its share of the KV cache of every attended token once,
        or computes its heads' share of the FLOPs (bf16), whichever takes longer."""
        tp = self.tensor_parallel_size
        kv_read = work.decode_context + work.prefill_context
        # A decoder's draft tokens attend to its context as its own token does.
        per_decoder = 1 + work.spec_tokens / work.decode_seqs if work.decode_seqs else 1
        flops = self._attention_flops(work.decode_context * per_decoder, work.prefill_attended)
        return max(
            kv_read * self.kv_bytes_per_token * self._kv_share / bandwidth,
            flops / tp / flops_per_s,
        )

    def _linear_seconds(
        self,
        tokens: int,
        sampled: int,
        bandwidth: float,
        flops_per_s: float,
        kernels: Overheads | None,
    ) -> float:
        """The linear layers of a step of `tokens` tokens, `sampled` of them through the LM
        head, on one GPU (1/tp of every weight): each kernel reads its weights once or computes
        its FLOPs, whichever takes longer. A mixture of experts runs two kinds one after the
        other: the dense part (attention projections, shared experts, dense layers, LM head)
        and the routed experts, which read only the experts the step's tokens hit and compute
        each expert's tokens padded to the fused-MoE kernel's block of rows. `kernels` (the
        fitted overheads, or None for a roofline) says how far below a dense GEMM the routed
        experts' kernels and A100's weight-only FP8 GEMMs run."""
        model, tp = self.model, self.tensor_parallel_size
        weight_only = 1.0
        if kernels is not None and self._fp8 and not self.device.fp8_tflops:
            weight_only = kernels.weight_only_fp8_efficiency  # dequantised on the fly (Marlin)
        bytes_per_param = model.bytes_per_param / tp
        head_flops = 2.0 * self._lm_head_params * sampled
        sharpness = math.inf if kernels is None else kernels.roofline_sharpness
        if not model.num_experts:
            flops = 2.0 * self._body_params * tokens + head_flops
            return _gemm_seconds(
                model.params * bytes_per_param / bandwidth,
                flops / tp / (flops_per_s * weight_only),
                sharpness,
            )
        expert = self._expert_params
        moe_layers = model.num_hidden_layers - model.first_dense_layers
        routed_params = model.num_experts_per_tok * expert * moe_layers
        dense_flops = 2.0 * (self._body_params - routed_params) * tokens + head_flops
        dense_s = _gemm_seconds(
            (model.params - model.num_experts * expert * moe_layers) * bytes_per_param / bandwidth,
            dense_flops / tp / (flops_per_s * weight_only),
            sharpness,
        )
        expert_s = self._expert_layer_seconds(tokens, bandwidth, flops_per_s * weight_only, kernels)
        return dense_s + moe_layers * expert_s

    def _expert_layer_seconds(
        self, tokens: int, bandwidth: float, flops_per_s: float, kernels: Overheads | None
    ) -> float:
        """One MoE layer's routed experts (vLLM's fused_moe) for a step of `tokens` tokens on
        one GPU: the experts the tokens hit, each read once, and each expert's tokens padded to
        the kernel's block of rows, at the fitted fractions of a dense GEMM's bandwidth and
        FLOPs (`kernels`; None: a roofline, the tokens alone at dense rates)."""
        model, tp = self.model, self.tensor_parallel_size
        experts, k, expert = model.num_experts, model.num_experts_per_tok, self._expert_params
        # Expected distinct experts hit when each token picks k of E at random.
        hit = experts * (1 - (1 - k / experts) ** tokens)
        # vLLM's fused_moe pads each expert's tokens to BLOCK_SIZE_M rows (its default config:
        # 64 once the step's tokens outnumber the experts, else 16); with a spread of tokens
        # across experts, about half a block is padding on average, and an expert with fewer
        # tokens than a block computes a whole block. A roofline counts the tokens alone.
        block = 0 if kernels is None else 64 if tokens > experts else 16
        rows = hit * max(block, tokens * k / hit + block / 2)
        read, flops = hit * expert * model.bytes_per_param / tp, 2.0 * rows * expert / tp
        if kernels is None:
            return max(read / bandwidth, flops / flops_per_s)
        return _gemm_seconds(
            read / (bandwidth * kernels.moe_bandwidth_efficiency),
            flops / (flops_per_s * kernels.moe_efficiency),
            kernels.roofline_sharpness,
        )

    def step_seconds(self, work: StepWork) -> float:
        """The duration of one engine step: the one place every step's time is computed."""
        model, device, over = self.model, self.device, self.device.overheads
        tp = self.tensor_parallel_size
        host = device.host_cpu_factor
        tokens = work.decode_seqs + work.prefill_tokens + work.spec_tokens
        if tokens == 0:
            return host * over.step_ms / 1000 * self.slowdown
        gpu_s = self._gpu_seconds(work, over)
        # The host: a fixed cost per step the GPU waits for (scheduling, launches, sampling),
        # and per running sequence a cost (inputs, bookkeeping, outputs) prepared while the
        # GPU runs the step before, so it shows only once it outlasts the GPU's share.
        seqs = work.decode_seqs + work.prefill_seqs
        sequences_s = host * over.seq_us * seqs / 1e6
        # On the host's own cores (serial_host) the two take turns.
        busy = gpu_s + sequences_s if device.serial_host else max(gpu_s, sequences_s)
        seconds = busy + host * over.step_ms / 1000
        if tp > 1:
            payload = tokens * model.hidden_size * 2 * 2 * (tp - 1) / tp  # bf16, ring
            one = over.allreduce_latency_us / 1e6 + payload / (device.interconnect_gbs * 1e9)
            seconds += 2 * model.num_hidden_layers * one
        frontend_s = host * work.emitted * over.frontend_token_us / 1e6 / self.api_server_count
        if self.serial_output_processing or device.serial_host:
            return (seconds + frontend_s) * self.slowdown
        return max(seconds, frontend_s) * self.slowdown

    def roofline_seconds(self, work: StepWork) -> float:
        """A lower bound on the step from the profile's achieved bandwidth and FLOPs alone:
        the linear layers and attention each on their roofline (bytes over the bandwidth or
        FLOPs over the compute, whichever is larger), one after the other as their kernels
        run, with no host, frontend or communication cost and dense-GEMM efficiency for every
        kernel. (One roofline over the step's bytes and FLOPs together would assume attention
        overlaps the GEMMs, which vLLM's kernels do not.)"""
        return self._gpu_seconds(work, None)

    def kernel_seconds(self, work: StepWork) -> float:
        """The step's GPU kernels alone at the profile's fitted efficiencies, with no host,
        frontend or communication cost: what timing the kernels on a GPU gives
        (`benchmarks/perf/gpu_measure.py --compare`)."""
        return self._gpu_seconds(work, self.device.overheads)

    def _gpu_seconds(self, work: StepWork, kernels: Overheads | None) -> float:
        """The step's kernels one after another: the linear layers, attention and the vision
        encoders, at the profile's achieved bandwidth and matmul rate. `kernels` as for
        `_linear_seconds` (None: every GEMM on a plain roofline at dense efficiency)."""
        tokens = work.decode_seqs + work.prefill_tokens + work.spec_tokens
        bandwidth, bf16_flops = self._achieved_rates(False)
        flops_per_s = self._achieved_rates(True)[1] if self._fp8 else bf16_flops
        sampled = (work.emitted or work.decode_seqs) + work.spec_tokens
        linear_s = self._linear_seconds(tokens, sampled, bandwidth, flops_per_s, kernels)
        attention_s = self._attention_seconds(work, bandwidth, bf16_flops)
        # Images' vision encoders: dense bf16 GEMMs over their patches, before the chunk.
        encoder_s = work.encoder_flops / self.tensor_parallel_size / bf16_flops
        return linear_s + attention_s + encoder_s

    def request_seconds(self) -> float:
        """Frontend latency before a request reaches the scheduler (HTTP, template, tokens)."""
        return self.device.host_cpu_factor * self.device.overheads.request_ms / 1000

    def kv_cache_tokens(
        self, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 8192
    ) -> int:
        """Tokens the KV cache holds: what `gpu_memory_utilization` of each GPU leaves after
        the weights, the reserve and the activations of the largest step (vLLM's profile run)."""
        model, device = self.model, self.device
        gpus = self.tensor_parallel_size * self.pipeline_parallel_size
        weights = model.weight_bytes / gpus
        activations = (
            max_num_batched_tokens
            * (4 * model.hidden_size + 2 * model.intermediate_size / self.tensor_parallel_size)
            * 2
        )
        free = device.memory_bytes * gpu_memory_utilization - weights - activations
        free -= device.overheads.reserved_gib * GIB
        if free <= 0:
            return 0
        # KV heads split over tp (replicated when fewer heads than GPUs), layers over pp.
        per_token = self.kv_bytes_per_token * self._kv_share / self.pipeline_parallel_size
        return int(free // per_token)

    def num_gpu_blocks(
        self,
        block_size: int,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
    ) -> int:
        return self.kv_cache_tokens(gpu_memory_utilization, max_num_batched_tokens) // block_size

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model.describe(),
            "device": self.device.describe(),
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "slowdown": self.slowdown,
            "kv_cache_dtype": self.kv_cache_dtype,
        }
