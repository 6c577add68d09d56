"""What a case's output tokens cost: the GPUs' energy per token (from the telemetry's NVML
counters), and dollars per million tokens at a GPU-hour price (`--profllm-gpu-hour-price`).

A price is per GPU-hour, so a case's GPU-seconds are the server's GPUs times the load's
duration (`results.duration`, the window vLLM's throughputs are over). The server's GPUs are
the ones it leased; the simulator leases virtual GPUs, as many as vLLM would take
(tensor x pipeline x data parallel size), and those are counted, the record says so. A vLLM
server on CPU cores has no GPU-hours: its cost is null, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

SECONDS_PER_HOUR = 3600.0
PER_MILLION = 1e6
GpusCounted = Literal["leased", "simulated"]


def output_tokens(results: Mapping[str, Any]) -> int | None:
    """The load's output tokens (vLLM's `total_output_tokens`), None where it made none."""
    tokens = results.get("total_output_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens <= 0:
        return None
    return int(tokens)


def energy_per_output_token(
    joules: Any, results: Mapping[str, Any], kind: str = "serve"
) -> float | None:
    """Joules per output token: the GPUs' energy over the load (null without NVML) over its
    output tokens. A serve case's only: a capacity search's energy spans every probe while
    its results are the one probe at the capacity, and an offline run counts no output
    tokens apart."""
    tokens = output_tokens(results)
    if kind != "serve" or not isinstance(joules, int | float) or tokens is None:
        return None
    return float(joules) / tokens


def priced_gpus(device_kind: str | None, leased: int) -> tuple[int | None, GpusCounted | None]:
    """How many GPUs a case's server held, and which: NVML GPUs, or the simulator's virtual
    ones (vLLM's count for the same configuration); none for a server on CPU cores."""
    if device_kind == "gpu" and leased:
        return leased, "leased"
    if device_kind == "virtual" and leased:
        return leased, "simulated"
    return None, None


def case_cost(
    price_usd: float | None,
    results: Mapping[str, Any],
    gpus: int | None,
    counted: GpusCounted | None,
) -> dict[str, Any] | None:
    """The record's `cost` block; None where no price was given. Figures are null, with the
    reason in `problem`, where the case has no GPUs, no duration or no output tokens."""
    if price_usd is None:
        return None
    cost: dict[str, Any] = {
        "gpu_hour_price_usd": price_usd,
        "gpus": gpus,
        "gpus_counted": counted,
        "window_s": None,
        "gpu_seconds": None,
        "usd": None,
        "usd_per_million_output_tokens": None,
        "problem": None,
    }
    duration = results.get("duration")
    if isinstance(duration, bool) or not isinstance(duration, int | float) or duration <= 0:
        duration = None
    tokens = output_tokens(results)
    # In this order: a case that measured nothing (it errored before its server had GPUs)
    # says so first.
    if duration is None:
        return {**cost, "problem": "no load duration was measured"}
    if tokens is None:
        return {**cost, "problem": "the load made no output tokens"}
    if gpus is None:
        return {**cost, "problem": "the server held no GPUs (vLLM on CPU cores): no GPU-hours "
                                   "to price"}
    gpu_seconds = gpus * float(duration)
    usd = price_usd / SECONDS_PER_HOUR * gpu_seconds
    per_million = usd / tokens * PER_MILLION
    # The price is bounded at start (limits.MAX_GPU_HOUR_PRICE_USD), but a record's duration
    # is not: a figure past a float's range is null with the reason, never inf in JSON.
    if not all(math.isfinite(v) for v in (gpu_seconds, usd, per_million)):
        return {**cost, "problem": "the cost overflows a float at this price and duration"}
    return {
        **cost,
        "window_s": float(duration),
        "gpu_seconds": gpu_seconds,
        "usd": usd,
        "usd_per_million_output_tokens": per_million,
    }
