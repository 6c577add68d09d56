"""The saturation stop of a rate sweep: once one server's load at some request rate saturates,
the higher rates of the same workload are skipped, since they can only measure a server that
is already past its limit (and take longest, as every request queues).

A configuration is one server key and one workload apart from its `request_rate`; its cases
run on one worker, lowest rate first (`order_rates`), so a saturated rate is seen before the
higher ones. A load saturates when the rate achieved (what the client sent, or what the
server served: `served_rate`) is under the requested one by more than the margin, or when
the server's waiting queue grew through the run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import BenchmarkConfig

# How many more requests the waiting queue must hold through the second half of its rise than
# in the first half on average, before it counts as growing: a burst of arrivals at a load
# the server keeps up with queues one or two requests for a moment; that is not saturation.
QUEUE_GROWTH_REQUESTS = 2.0
_MIN_QUEUE_SAMPLES = 3


def sweep_key(case: Case) -> str | None:
    """What the cases of one rate sweep share: the server and the workload but its rate. None
    for cases that have no request rate (offline kinds)."""
    if case.kind != "serve" or not isinstance(case.benchmark, BenchmarkConfig):
        return None
    workload = case.benchmark.model_dump(mode="json")
    workload.pop("request_rate", None)
    if case.seed_derived:
        workload.pop("seed")  # derived per case, so each rate draws prompts of its own
    return json.dumps([case.server_key, workload], sort_keys=True, default=str)


def request_rate(case: Case) -> float | None:
    if not isinstance(case.benchmark, BenchmarkConfig):
        return None
    return case.benchmark.request_rate


def saturated(
    results: Mapping[str, Any], series: Sequence[Mapping[str, Any]], margin: float
) -> float | None:
    """The request throughput of a load that saturated, or None when it did not. It saturated
    where the rate achieved (the lower of what the client sent and what the server served)
    fell short of the target, or where the waiting queue grew (an infinite rate has no target
    to fall short of: only its queue can say). The figure given is the request throughput
    over the whole run, the summary's req/s, never the send rate: the client may send on
    time while the queue takes what the server cannot serve."""
    target = _number(results.get("target_request_rate"))  # a record read again may hold anything
    rates = [
        rate
        for rate in (_number(results.get("achieved_request_rate")), served_rate(results))
        if rate is not None
    ]
    achieved = min(rates) if rates else None
    fell_short = (
        target is not None and achieved is not None and achieved < target * (1 - margin)
    )
    if not fell_short and not queue_grew([point.get("waiting") for point in series], margin):
        return None
    throughput = request_throughput(results)
    if throughput is not None:
        return throughput
    return achieved if achieved is not None else 0.0  # a result without its counts


def request_throughput(results: Mapping[str, Any]) -> float | None:
    """Requests completed per second of the whole benchmark, vLLM's `request_throughput`."""
    completed, duration = _number(results.get("completed")), _number(results.get("duration"))
    if completed is not None and duration:
        return completed / duration
    return _number(results.get("request_throughput"))


def served_rate(results: Mapping[str, Any]) -> float | None:
    """Requests the server completed per second while they arrived: the benchmark's duration
    ends one request's latency after the last arrival, which at a load the server keeps up
    with is no part of the rate (a short run at a high rate would otherwise read as
    saturated). Where the server held requests back (`max_concurrency`, which the client's
    own rate does not see) it is the server's rate."""
    completed, duration = _number(results.get("completed")), _number(results.get("duration"))
    if not completed or not duration:
        return None
    latency_ms = _number(results.get("median_e2el_ms")) or _number(results.get("mean_e2el_ms"))
    span = duration - (latency_ms or 0.0) / 1000
    return completed / (span if span > 0 else duration)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def record_saturated(record: Mapping[str, Any], margin: float | None) -> float | None:
    """`saturated` of a record as written (an earlier session's, on resume)."""
    if margin is None or record.get("status") == "skipped":
        return None
    return saturated(record.get("results") or {}, record.get("series") or [], margin)


def queue_grew(waiting: Sequence[Any], margin: float) -> bool:
    """Whether the waiting queue grew through the run: over its rise (the samples up to its
    first peak; after the last arrival it drains), every sample of the second half holds more
    than the first half's mean, by the margin and `QUEUE_GROWTH_REQUESTS` (one spike is a
    burst, not growth)."""
    values = [number for value in waiting if (number := _number(value)) is not None]
    if len(values) < _MIN_QUEUE_SAMPLES:
        return False
    rising = values[: values.index(max(values)) + 1]
    if len(rising) < _MIN_QUEUE_SAMPLES:
        return False
    half = len(rising) // 2
    early, late = statistics.fmean(rising[:half]), min(rising[half:])
    return late >= early * (1 + margin) + QUEUE_GROWTH_REQUESTS


def describe(rate: float, achieved: float) -> str:
    return f"saturated at {rate:g} req/s (achieved {achieved:.3g} req/s)"


@dataclass
class SaturationStop:
    """One worker's saturated sweeps: sweep key -> (the lowest saturated rate, its achieved
    rate). `margin` None: the stop is off."""

    margin: float | None
    saturated_at: dict[str, tuple[float, float]] = field(default_factory=dict)

    def skip_reason(self, case: Case) -> str | None:
        """Why this case is not run: a lower rate of its sweep saturated (an infinite rate is
        the highest load of all: it is skipped too)."""
        key, rate = sweep_key(case), request_rate(case)
        if self.margin is None or key is None or rate is None or key not in self.saturated_at:
            return None
        saturated_rate, achieved = self.saturated_at[key]
        return describe(saturated_rate, achieved) if rate > saturated_rate else None

    def note(
        self, case: Case, results: Mapping[str, Any], series: Sequence[Mapping[str, Any]]
    ) -> None:
        """Remember this case's load if it saturated."""
        if self.margin is None or not results:
            return
        achieved = saturated(results, series, self.margin)
        rate = request_rate(case)
        if achieved is not None and rate is not None:
            self.mark(case, rate, achieved)

    def mark(self, case: Case, rate: float, achieved: float) -> None:
        key = sweep_key(case)
        if key is None:
            return
        known = self.saturated_at.get(key)
        if known is None or rate < known[0]:
            self.saturated_at[key] = (rate, achieved)


def order_rates(items: list[Any], case_of: Callable[[Any], Case | None]) -> None:
    """Reorder `items` in place so each sweep's cases run from the lowest rate to the highest,
    in the places its cases already hold: a suite written in ascending order keeps its order.
    (An infinite rate sorts last.)"""
    places: dict[str, list[int]] = {}
    for position, item in enumerate(items):
        case = case_of(item)
        key = sweep_key(case) if case is not None else None
        if key is not None:
            places.setdefault(key, []).append(position)
    for positions in places.values():
        members = [items[position] for position in positions]
        members.sort(key=lambda item: _rate_of(item, case_of))  # stable: repeats keep order
        for position, item in zip(positions, members, strict=True):
            items[position] = item


def _rate_of(item: Any, case_of: Callable[[Any], Case | None]) -> float:
    case = case_of(item)
    rate = request_rate(case) if case is not None else None
    return math.inf if rate is None else rate
