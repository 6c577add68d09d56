"""The simulated engine's configuration from `vllm serve` arguments: which model facts, which
device profile, and the batch and cache sizes that follow, as vLLM would derive them.

Shared by the simulator's command line and the plugin's record (`engine.sim`), so both say
the same of a server. Cheap to import: no aiohttp, no tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from pytest_profllm.sim.batching import BLOCK_SIZE
from pytest_profllm.sim.cost import EngineModel, slowdown_from_env
from pytest_profllm.sim.hardware import GIB, DeviceProfile, device_profile
from pytest_profllm.sim.model_files import MODEL_DIR
from pytest_profllm.sim.models import ModelFacts, UnknownModel, resolve_model

OWN_MODEL = "profllm-sim"

log = logging.getLogger("profllm.sim")


class NoCacheMemory(ValueError):
    """The weights leave no memory for the KV cache (vLLM fails at start the same way)."""


@dataclass(frozen=True)
class SimSetup:
    engine: EngineModel
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    gpu_memory_utilization: float

    def describe(self) -> dict[str, Any]:
        """What the record says produced the figures (`engine.sim`)."""
        return {
            **self.engine.describe(),
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_tokens": self.num_gpu_blocks * self.block_size,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }


def model_facts(model: str) -> ModelFacts:
    """A folder's config.json, a catalog name, or, for a bare name that is neither (`m`,
    `sim-test`: names tests give), the simulator's own model folder, said so in the log."""
    try:
        return resolve_model(model)
    except UnknownModel:
        if "/" in model or model.startswith(("~", ".")):
            raise
    log.warning(
        "model %r is not in the catalog: simulating the simulator's own model (%s)",
        model,
        MODEL_DIR / "config.json",
    )
    facts = resolve_model(str(MODEL_DIR))
    return ModelFacts(**{**facts.__dict__, "name": OWN_MODEL})


def build_setup(
    model: str,
    device: str | DeviceProfile | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float = 0.9,
    block_size: int | None = None,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
    api_server_count: int = 1,
    enable_chunked_prefill: bool = True,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> SimSetup:
    """`device`: a shipped profile's name, or a profile (from a file: `--sim-profile`).
    Raises UnknownModel, UnknownDevice or NoCacheMemory with a one-line message."""
    facts = model_facts(model)
    if quantization == "fp8" and facts.quantization != "fp8":
        # vLLM's --quantization fp8 quantizes a 16-bit checkpoint's weights to FP8 as it
        # loads them: the engine then reads and computes FP8 weights, as with an FP8 one.
        facts = replace(facts, quantization="fp8")
    profile = device if isinstance(device, DeviceProfile) else device_profile(device)
    engine = EngineModel(
        facts,
        profile,
        tensor_parallel_size,
        pipeline_parallel_size,
        api_server_count,
        slowdown_from_env(),
        kv_cache_dtype,
    )
    seqs = max_num_seqs or profile.default_max_num_seqs
    model_len = max_model_len or facts.max_position_embeddings
    batched = max_num_batched_tokens or profile.default_max_num_batched_tokens
    if not enable_chunked_prefill:
        batched = max(batched, model_len)  # as vLLM: one step holds a whole prompt
    batched = max(batched, seqs)
    block = block_size or BLOCK_SIZE
    blocks = num_gpu_blocks_override or engine.num_gpu_blocks(
        block, gpu_memory_utilization, batched
    )
    if blocks <= 0:
        gpus = tensor_parallel_size * pipeline_parallel_size
        raise NoCacheMemory(
            f"No available memory for the cache blocks: {facts.name} needs "
            f"{facts.weight_bytes / gpus / GIB:.1f} GiB of weights per GPU on {gpus} x "
            f"{profile.name} ({profile.memory_gib:g} GiB, gpu_memory_utilization "
            f"{gpu_memory_utilization:g}). Try increasing `gpu_memory_utilization` or "
            "`tensor_parallel_size` when initializing the engine."
        )
    return SimSetup(engine, seqs, batched, block, blocks, model_len, gpu_memory_utilization)


def describe_server(
    server: dict[str, Any], device: str | DeviceProfile | None
) -> dict[str, Any] | None:
    """`engine.sim` of a record: the setup a simulator started with these engine arguments
    has; None where it could not start (its own error says why)."""

    def number(name: str) -> int | None:
        value = server.get(name)
        return int(value) if isinstance(value, int | float) and value else None

    try:
        setup = build_setup(
            str(server.get("model") or OWN_MODEL),
            device,
            tensor_parallel_size=number("tensor_parallel_size") or 1,
            pipeline_parallel_size=number("pipeline_parallel_size") or 1,
            max_num_seqs=number("max_num_seqs"),
            max_num_batched_tokens=number("max_num_batched_tokens"),
            gpu_memory_utilization=float(server.get("gpu_memory_utilization") or 0.9),
            block_size=number("block_size"),
            num_gpu_blocks_override=number("num_gpu_blocks_override"),
            max_model_len=number("max_model_len"),
            api_server_count=number("api_server_count") or 1,
            enable_chunked_prefill=server.get("enable_chunked_prefill") is not False,
            kv_cache_dtype=str(server.get("kv_cache_dtype") or "auto"),
            quantization=server.get("quantization"),
        )
    except ValueError:
        return None
    return setup.describe()
