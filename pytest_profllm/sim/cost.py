"""The simulator's engine model: how long one engine step takes, and how big the KV cache is.

A pure function of the model's facts, the device profile, the parallel layout and the batch,
so the server's scheduler, the virtual-clock runs of `sim.virtual` and offline estimates all
use the same figures. A step is a roofline:

- memory: every weight the step touches (per GPU: 1/tp of them) and the KV cache of every
  token attended, over the achieved memory bandwidth;
- compute: 2 FLOPs per active parameter per token plus attention (4 x layers x heads x
  head_dim per attended token), split over tp GPUs, over the achieved dense FLOPs;
- tensor parallelism adds two all-reduces per layer (latency + ring transfer of the step's
  activations over the interconnect);
- a fixed step overhead, and the API server's per-token CPU as a floor on a step that streams
  tokens to clients (one frontend process emits a few thousand tokens/s).

`PROFLLM_SIM_SLOWDOWN` (a factor, default 1.0) multiplies every step: a slower machine on demand.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from pytest_profllm.sim.hardware import GIB, DeviceProfile
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


@dataclass(frozen=True)
class StepWork:
    """What one engine step computes."""

    decode_seqs: int = 0  # sequences emitting a token from their KV cache
    decode_context: int = 0  # tokens those sequences attend to (their KV cache, summed)
    prefill_tokens: int = 0  # prompt tokens computed this step (chunks)
    prefill_context: int = 0  # tokens already in the KV cache that the prefill chunks read
    prefill_attended: float = 0.0  # sum over prefill tokens of the positions each attends to
    emitted: int = 0  # tokens streamed to clients after this step


@dataclass(frozen=True)
class EngineModel:
    model: ModelFacts
    device: DeviceProfile
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    api_server_count: int = 1
    slowdown: float = 1.0

    @property
    def _fp8(self) -> bool:
        return self.model.quantization == "fp8"

    def _weight_bytes_read(self, tokens: int) -> float:
        """Weights one GPU reads in a step of `tokens` tokens: all of a dense model; for a
        mixture of experts, the shared part and the experts the step's tokens are routed to."""
        model = self.model
        if not model.num_experts or not tokens:
            touched = model.params if model.num_experts == 0 else model.active_params
        else:
            # Expected distinct experts hit per layer when each token picks k of E at random.
            e, k = model.num_experts, model.num_experts_per_tok
            hit = e * (1 - (1 - k / e) ** tokens)
            expert = model.active_params + (hit - k) * (
                3 * model.hidden_size * model.moe_intermediate_size
            ) * (model.num_hidden_layers - model.first_dense_layers)
            touched = min(model.params, int(expert))
        return touched * model.bytes_per_param / self.tensor_parallel_size

    def step_seconds(self, work: StepWork) -> float:
        """The duration of one engine step: the one place every step's time is computed."""
        model, device, over = self.model, self.device, self.device.overheads
        tp = self.tensor_parallel_size
        tokens = work.decode_seqs + work.prefill_tokens
        if tokens == 0:
            return over.step_ms / 1000 * self.slowdown
        attended = work.decode_context + work.prefill_attended
        kv_read = work.decode_context + work.prefill_context
        memory_bytes = self._weight_bytes_read(tokens) + kv_read * model.kv_bytes_per_token / tp
        moe = over.moe_efficiency if model.num_experts else 1.0
        if self._fp8 and not device.fp8_tflops:
            moe *= over.weight_only_fp8_efficiency
        memory_s = memory_bytes / (
            device.memory_bandwidth_gbs * 1e9 * over.bandwidth_efficiency * moe
        )
        attention_width = model.num_attention_heads * (model.v_head_dim or model.head_dim)
        flops = 2.0 * model.active_params * tokens
        flops += 4 * model.num_hidden_layers * attention_width * attended
        compute_s = flops / tp / (device.peak_flops(self._fp8) * over.compute_efficiency * moe)
        seconds = max(memory_s, compute_s) + over.step_ms / 1000
        if tp > 1:
            payload = tokens * model.hidden_size * 2 * 2 * (tp - 1) / tp  # bf16, ring
            one = over.allreduce_latency_us / 1e6 + payload / (device.interconnect_gbs * 1e9)
            seconds += 2 * model.num_hidden_layers * one
        frontend_s = work.emitted * over.frontend_token_us / 1e6 / self.api_server_count
        return max(seconds, frontend_s) * self.slowdown

    def request_seconds(self) -> float:
        """Frontend latency before a request reaches the scheduler (HTTP, template, tokens)."""
        return self.device.overheads.request_ms / 1000

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
        kv_heads = model.num_key_value_heads
        share = (
            1.0 if model.kv_lora_rank else max(kv_heads / self.tensor_parallel_size, 1) / kv_heads
        )
        per_token = model.kv_bytes_per_token * share / self.pipeline_parallel_size
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
        }
