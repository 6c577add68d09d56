"""The simulated engine's LoRA adapters: the names `--lora-modules` serves, `--max-loras` slots
resident at once, a load when an adapter comes in that no slot holds, and the extra work per
token that an adapter of `--max-lora-rank` adds.

What it models, as vLLM's V1 scheduler and LoRA manager behave (vllm/v1/core/sched/
scheduler.py, vllm/lora/worker_manager.py): a step's running requests use at most
`max_loras` distinct adapters, and a waiting request whose adapter would be one more is
skipped for a later step while others are admitted; the adapters live in an LRU cache of
`max_loras` slots (vLLM's `max_cpu_loras` defaults to it), and a step that needs one that is
not there loads it first, so the whole batch waits. vLLM pads every adapter to
`max_lora_rank`, so the extra work is of that rank whatever the adapter's own.

The figures are assumptions, not measurements: an adapter's weights are A and B of rank r
on each layer's seven projections (q, k, v, o, gate, up, down) in bf16; a load costs
`LOAD_FIXED_S` (reading the file, building the tensors in Python) plus the weights over
`LOAD_BYTES_PER_S`; the per-token work is the adapter's FLOPs at `KERNEL_EFFICIENCY` of the
device's matmul rate (the shrink and expand kernels are thin), plus reading each adapter's
weights once per step.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pytest_profllm.sim.cost import EngineModel

LOAD_FIXED_S = 0.02
LOAD_BYTES_PER_S = 5e9
KERNEL_EFFICIENCY = 0.05
_BF16 = 2
VLLM_DEFAULT_MAX_LORAS = 1
VLLM_DEFAULT_MAX_LORA_RANK = 16


def adapter_paths(lora_modules: Sequence[str] | None) -> dict[str, str]:
    """The adapters `--lora-modules` names, name -> path, as vLLM's parser reads each item
    (`name=path`, or JSON with a name and a path); an item it cannot read raises ValueError."""
    adapters: dict[str, str] = {}
    for item in lora_modules or ():
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
        else:
            try:
                mapping = json.loads(item)
            except ValueError:
                raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
            if not isinstance(mapping, dict) or "name" not in mapping or "path" not in mapping:
                raise ValueError(f"Invalid fields for --lora-modules: {item}")
            name, path = str(mapping["name"]), str(mapping["path"])
        adapters[name] = path
    return adapters


@dataclass(frozen=True)
class LoraCost:
    """What adapters cost on one engine: a load, and the extra seconds of a step."""

    load_s: float  # one adapter brought into a slot
    token_s: float  # the extra compute of one token through an adapter
    weights_s: float  # reading one adapter's weights (once per step that uses it)

    @classmethod
    def of(cls, engine: EngineModel, max_lora_rank: int) -> LoraCost:
        model, device = engine.model, engine.device
        hidden, inner = model.hidden_size, model.intermediate_size
        # Inputs + outputs of q, k, v, o and of gate, up, down (the rank's A and B sides).
        widths = 4 * 2 * hidden + 2 * (hidden + inner) + (inner + hidden)
        params = model.num_hidden_layers * max_lora_rank * widths
        gpus = engine.tensor_parallel_size * engine.pipeline_parallel_size
        bandwidth = device.memory_bandwidth_gbs * 1e9
        return cls(
            load_s=LOAD_FIXED_S + params * _BF16 / LOAD_BYTES_PER_S,
            token_s=2.0 * params / gpus / (device.matmul_flops(False) * KERNEL_EFFICIENCY),
            weights_s=params * _BF16 / gpus / bandwidth,
        )


@dataclass
class LoraSlots:
    """The adapters an engine serves and the slots that hold them (LRU)."""

    adapters: dict[str, str]  # name -> path
    max_loras: int
    max_lora_rank: int
    cost: LoraCost
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loads: int = 0  # adapters brought into a slot, each a load the batch waited for

    def admits(self, adapter: str | None, active: set[str]) -> bool:
        """Whether a request for `adapter` may join a batch already using `active` ones."""
        return adapter is None or adapter in active or len(active) < self.max_loras

    def step_seconds(self, adapters: Iterable[str | None], tokens: int) -> float:
        """The extra seconds of a step whose requests use `adapters` (None: the base model),
        `tokens` of them through an adapter: loads of those no slot holds, the adapters'
        weights read, the tokens' extra work."""
        used = [a for a in dict.fromkeys(adapters) if a is not None]
        if not used:
            return 0.0
        seconds = 0.0
        for adapter in used:
            if adapter in self.resident:
                self.resident.move_to_end(adapter)
                continue
            while len(self.resident) >= self.max_loras:
                self.resident.popitem(last=False)
            self.resident[adapter] = None
            self.loads += 1
            seconds += self.cost.load_s
        return seconds + len(used) * self.cost.weights_s + tokens * self.cost.token_s
