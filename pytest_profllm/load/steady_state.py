"""The steady state of a closed-loop load: the window where the requests in flight stay at or
above a share (95 %) of `max_concurrency`, leaving out the ramp-up and the drain, as
vllm-bench's `--steady-state-threshold` does. Its figures (`steady_*`) are what the server
does when it is as loaded as the load asks; the whole run's figures mix in the edges, where
fewer requests share the engine.

A request belongs to the window when it started and ended inside it, so every request counted
was served under the window's load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.plan.metric_names import STEADY_RESULTS

STEADY_STATE_THRESHOLD = 0.95


def steady_window(
    outcomes: Sequence[RequestOutcome], max_concurrency: int,
    threshold: float = STEADY_STATE_THRESHOLD,
) -> tuple[float, float] | None:
    """From the moment `threshold` x `max_concurrency` requests are first in flight (the
    ramp-up's end) to the moment they last fall below it (the drain's start); None where the
    load never got there. A closed loop sends its next request a moment after one ends: the
    dips of those handovers inside the window are part of the steady state, not its end."""
    floor = max(1, math.ceil(threshold * max_concurrency))
    # At one instant, starts before ends: a handover at one instant is no dip at all.
    events = sorted(
        [(o.start_time, 0) for o in outcomes if o.sent]
        + [(o.end_time, 1) for o in outcomes if o.sent]
    )
    first: float | None = None
    last: float | None = None
    in_flight = 0
    for time, kind in events:
        was = in_flight
        in_flight += 1 if kind == 0 else -1
        if in_flight >= floor and first is None:
            first = time
        if was >= floor > in_flight:
            last = time
    if first is None or last is None or last <= first:
        return None
    return first, last


def steady_figures(
    outcomes: Sequence[RequestOutcome], max_concurrency: int | None,
    threshold: float = STEADY_STATE_THRESHOLD,
) -> dict[str, float | int | None]:
    """The `steady_*` results of a load; all None for an open-loop load (no
    `max_concurrency`) or one that never reached the threshold."""
    empty: dict[str, float | int | None] = dict.fromkeys(STEADY_RESULTS)
    if not max_concurrency:
        return empty
    window = steady_window(outcomes, max_concurrency, threshold)
    if window is None:
        return empty
    start, end = window
    inside = [o for o in outcomes
              if o.success and o.sent and start <= o.start_time and o.end_time <= end]
    length = end - start
    ttfts = [o.ttft * 1000 for o in inside]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) * 1000
             for o in inside if o.output_tokens is not None and o.output_tokens > 1]
    tokens = sum(o.output_tokens or 0 for o in inside)
    return {
        "steady_duration_s": length,
        "steady_completed": len(inside),
        "steady_request_throughput": len(inside) / length,
        "steady_output_throughput": tokens / length,
        "steady_median_ttft_ms": _percentile(ttfts, 50),
        "steady_p99_ttft_ms": _percentile(ttfts, 99),
        "steady_median_tpot_ms": _percentile(tpots, 50),
        "steady_p99_tpot_ms": _percentile(tpots, 99),
    }


def _percentile(values: Sequence[float], percentile: float) -> float | None:
    # numpy's linear interpolation, as vLLM's percentiles.
    return float(np.percentile(values, percentile)) if values else None
