"""What a gate compares, taken from one run: its per-request latency samples (ms) and its
per-run figures. Built from the per-request rows the runner writes (runner.request_row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pytest_profllm.results.record import request_succeeded

FloatArray = npt.NDArray[np.float64]


@dataclass
class RunSamples:
    run_id: str
    session_id: str
    timestamp: str
    results: dict[str, Any]
    latencies: dict[str, FloatArray] = field(default_factory=dict)  # ttft/tpot/itl/e2el, ms


def latencies_from_requests(requests: list[dict[str, Any]]) -> dict[str, FloatArray]:
    """vllm bench serve's definitions over successful requests: TTFT, E2EL, TPOT for requests
    with more than one output token, ITL pooled over requests. An offline latency run's
    iterations (an index and a latency each) are E2EL samples alone."""
    ttft: list[float] = []
    e2el: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    for row in requests:
        if not request_succeeded(row):
            continue
        first, latency = row.get("ttft_s"), row.get("latency_s")
        if latency is None:
            continue
        e2el.append(latency * 1000)
        if first is None:  # a pooling request: its E2EL only
            continue
        ttft.append(first * 1000)
        tokens = row.get("output_tokens") or 0
        if tokens > 1:
            tpot.append((latency - first) / (tokens - 1) * 1000)
        itl += [gap * 1000 for gap in row.get("itl_s") or []]
    return {
        name: np.asarray(values, dtype=np.float64)
        for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el))
    }


def samples_of(record: dict[str, Any], requests: list[dict[str, Any]] | None) -> RunSamples:
    return RunSamples(
        run_id=record["run_id"],
        session_id=record.get("session_id") or "",
        timestamp=record.get("timestamp") or "",
        results=dict(record.get("results") or {}),
        latencies=latencies_from_requests(requests or []),
    )
