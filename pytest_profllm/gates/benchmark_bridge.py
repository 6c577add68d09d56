"""pytest-benchmark's view of each case: its per-request latencies (TTFT, TPOT, ITL, E2EL, in
seconds, as pytest-benchmark measures) as one benchmark per latency metric.

pytest-benchmark 5.3 disables its fixture whenever xdist is active, but its session still runs
on the controller: it loads `--benchmark-compare` files at configure time, and at session finish
saves (`--benchmark-json`, `--benchmark-save`), compares (`--benchmark-compare-fail`) and draws
(`--benchmark-histogram`) whatever is in `BenchmarkSession.benchmarks`. The controller receives
every case's per-request rows, so it builds pytest-benchmark's own `Metadata` from them there,
under xdist or not. Only when one of those options is given: a plain run shows no table.
"""

from __future__ import annotations

from typing import Any

import pytest
from pytest_benchmark.stats import Metadata

from pytest_profllm.gates.samples import latencies_from_requests
from pytest_profllm.results.record import is_valid

_OPTIONS = (
    "benchmark_json",
    "benchmark_compare",
    "benchmark_compare_fail",
    "benchmark_histogram",
    "benchmark_save",
    "benchmark_autosave",
)


class _CaseAsFixture:
    """What pytest-benchmark's Metadata reads of its BenchmarkFixture."""

    def __init__(self, name: str, fullname: str, group: str, params: dict[str, Any]) -> None:
        self.name = name
        self.fullname = fullname
        self.group = group
        self.param = params.get("metric")
        self.params = params
        self.extra_info: dict[str, Any] = {}
        self.cprofile_stats = None
        self.has_error = False


def benchmark_session(config: pytest.Config) -> Any | None:
    """pytest-benchmark's session where the user asked it for output, else None."""
    session = getattr(config, "_benchmarksession", None)  # pytest-benchmark's only handle
    if session is None or session.skip:
        return None
    if not any(config.getoption(option, None) for option in _OPTIONS):
        return None
    return session


def add_case(config: pytest.Config, record: dict[str, Any], requests: list[dict[str, Any]]) -> int:
    """One pytest-benchmark benchmark per latency metric of the case; returns how many."""
    session = benchmark_session(config)
    if session is None or not requests or not is_valid(record):
        return 0
    added = 0
    case_name = record["case_id"].split("::", 1)[-1]
    for metric, values in latencies_from_requests(requests).items():
        if not values.size:
            continue
        fixture = _CaseAsFixture(
            name=f"{case_name}[{metric}]",
            fullname=f"{record['nodeid']}[{metric}]",
            group=f"profllm {metric}",
            params={"metric": metric},
        )
        metadata = Metadata(  # type: ignore[no-untyped-call]
            fixture, iterations=1, options={"source": "profllm per-request"}
        )
        for milliseconds in values:
            metadata.update(float(milliseconds) / 1000)  # type: ignore[no-untyped-call]
        session.benchmarks.append(metadata)
        added += 1
    return added
