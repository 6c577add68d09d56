"""LoRA adapter mixes: which model (an adapter, or the base model) each request of a workload
asks for, and the load's figures per model.

A workload's `lora_mix` maps model names to weights. `weighted` draws each request's model
at random in proportion to its weight, from the workload's seed; `round_robin` cycles the
names in the order given, each as many times in a row as its weight's share of the smallest
(weights 2 and 1: a, a, b, a, a, b, ...). A conversation keeps its model for all its turns,
as one user talks to one adapter: the draw, or the cycle, is per conversation.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_profllm.load.metrics import RequestOutcome, grouped
from pytest_profllm.load.prompt import PromptRequest

if TYPE_CHECKING:
    from pytest_profllm.plan.suite import BenchmarkConfig

# Apart from the prompts' and the arrivals' draws, which use the seed itself.
_SEED_OFFSET = 7919


def assign_models(
    count: int, mix: Mapping[str, float], assignment: str, seed: int
) -> list[str]:
    """The model of each of `count` requests (or conversations), deterministic by `seed`."""
    names = list(mix)
    if not names or count <= 0:
        return []
    if assignment == "round_robin":
        cycle = _round_robin_cycle(mix)
        return [cycle[index % len(cycle)] for index in range(count)]
    picker = random.Random(seed + _SEED_OFFSET)
    weights = [float(mix[name]) for name in names]
    return picker.choices(names, weights=weights, k=count)


def with_models(requests: list[PromptRequest], config: BenchmarkConfig) -> list[PromptRequest]:
    """The requests, each asking for its model of the workload's mix (unchanged without one)."""
    if not config.lora_mix:
        return requests
    models = assign_models(len(requests), config.lora_mix, config.lora_assignment, config.seed)
    return [
        dataclasses.replace(request, model=model)
        for request, model in zip(requests, models, strict=True)
    ]


def _round_robin_cycle(mix: Mapping[str, float]) -> list[str]:
    """One cycle of a round-robin mix: each name as many times as its weight over the
    smallest, rounded (at least once), in the order given."""
    smallest = min(mix.values())
    cycle: list[str] = []
    for name, weight in mix.items():
        cycle += [name] * max(1, round(weight / smallest))
    return cycle


def by_adapter(outcomes: Sequence[RequestOutcome], duration: float) -> list[dict[str, Any]] | None:
    """Per model of an adapter mix (None where no request named one): its requests, how
    many completed and failed, the request and output throughput over the whole load's
    duration, and its TTFT and TPOT (mean, median, p99, in ms; TPOT as vLLM's client takes
    it, over requests of more than one output token)."""
    groups = grouped(outcomes, lambda outcome: outcome.model)
    if not groups:
        return None
    rows = []
    for model, group in groups.items():
        done = [outcome for outcome in group if outcome.success]
        ttfts = [outcome.ttft * 1000 for outcome in done]
        tpots = [
            (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1) * 1000
            for outcome in done
            if outcome.output_tokens is not None and outcome.output_tokens > 1
        ]
        output = sum(outcome.output_tokens or 0 for outcome in done)
        rows.append(
            {
                "model": model,
                "requests": len(group),
                "completed": len(done),
                "failed": len(group) - len(done),
                "request_throughput": len(done) / duration if duration > 0 else 0.0,
                "output_throughput": output / duration if duration > 0 else 0.0,
                **_stats("ttft", ttfts),
                **_stats("tpot", tpots),
            }
        )
    return rows


def _stats(name: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"p99_{name}_ms": float(np.percentile(values, 99)),
    }


def expected_shares(mix: Mapping[str, float]) -> dict[str, float]:
    """Each model's expected share of the requests under a weighted mix."""
    total = math.fsum(mix.values())
    return {name: weight / total for name, weight in mix.items()}
