"""Every benchmark kind by its `kind:` key, and which results a workload's case can record
(what thresholds may name)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite.accuracy import AccuracyConfig
from pytest_profllm.plan.suite.capacity import CapacityConfig
from pytest_profllm.plan.suite.offline import LatencyConfig, ThroughputConfig
from pytest_profllm.plan.suite.serve import BenchmarkConfig


def measures(workload: Any, name: str) -> bool:
    """Whether a workload's case can record the result `name`: one of its names, or, for an
    accuracy case, any metric under an lm-eval filter as its record names it."""
    if isinstance(workload, AccuracyConfig) and metric_names.is_accuracy_result(name):
        return True
    return name in workload.result_names()


# What `benchmark:` describes, by its `kind` (serve when absent).
OfflineConfig = ThroughputConfig | LatencyConfig
WorkloadConfig = BenchmarkConfig | ThroughputConfig | LatencyConfig | AccuracyConfig
BENCHMARK_KINDS: dict[str, type[BaseModel]] = {
    "serve": BenchmarkConfig,
    "capacity": CapacityConfig,
    "throughput": ThroughputConfig,
    "latency": LatencyConfig,
    "accuracy": AccuracyConfig,
}
