"""A case's stage, told to everything that watches it: the client's Prometheus gauge
(`--profllm-metrics-port`, load/prometheus_counters.py) and the live view (`--profllm-live`,
load/live_status.py). The places a case passes through call this module only.

The stages, in a case's usual order: `waiting` (for its devices and ports, or for load
cores), `starting` (its server), `loading` (warming up first where it has warmups),
`searching` (a capacity search's probes and its re-check), `remeasuring` (a load the host
made invalid, run again), `profiling`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pytest_profllm.load import live_status, prometheus_counters

_now: tuple[str, str] | None = None  # this process's running case's stage and detail


@contextlib.contextmanager
def running(
    labels: prometheus_counters.CaseLabels, worker: str, run_id: str = ""
) -> Iterator[None]:
    """The case runs in this process (and the client processes it starts) for the block;
    `run_id`: its record's, for the live page's link once it ended."""
    global _now
    with prometheus_counters.running(labels), live_status.running(labels.case, worker, run_id):
        _now = ("starting", "")
        try:
            yield
        finally:
            _now = None


def enter(stage: str, detail: str = "") -> None:
    """The running case is now in `stage` (`detail`: which probe at which load, which lease)."""
    global _now
    _now = (stage, detail)
    prometheus_counters.set_stage(stage)
    live_status.set_stage(stage, detail)


@contextlib.contextmanager
def during(stage: str, detail: str = "") -> Iterator[None]:
    """`stage` for the block, then the stage the case was in before (waiting for load cores
    in the middle of a load or a probe)."""
    before = _now
    enter(stage, detail)
    try:
        yield
    finally:
        if before is not None:
            enter(*before)
