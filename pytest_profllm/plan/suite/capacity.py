"""A capacity case (`kind: capacity`): the serve workload with its SLOs, and how the search
for the highest load that meets them runs (load/capacity/)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator, model_validator

from pytest_profllm.limits import MAX_PROBE_REQUESTS, MIN_SEARCH_RATE
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite.serve import BenchmarkConfig
from pytest_profllm.plan.suite.until import fraction_of

# What an SLO may bound: a latency statistic in ms (`p99_ttft_ms`, `median_tpot_ms`, ...), or
# the fraction of requests that meet the workload's `goodput` bounds.
_SLO_LATENCY = re.compile(
    r"^(mean|median|p(\d+(?:\.\d+)?))_(" + "|".join(metric_names.LATENCY_METRICS) + r")_ms$"
)
GOODPUT_SLO = "goodput_ratio"


def slo_problem(name: str, target: float) -> str | None:
    """Why `name: target` is not an SLO a capacity search can hold a probe to, or None."""
    match = _SLO_LATENCY.match(name)
    if name == GOODPUT_SLO:
        if not 0 < target <= 1:
            return f"slo.{name}: a fraction of requests in (0, 1], got {target!r}"
        return None
    if match is None:
        return (
            f"slo.{name}: unknown SLO metric; allowed: mean_/median_/pNN_ of "
            f"{', '.join(metric_names.LATENCY_METRICS)} in ms (e.g. p99_ttft_ms), "
            f"and {GOODPUT_SLO}"
        )
    if match.group(2) is not None and not 0 < float(match.group(2)) < 100:
        return f"slo.{name}: a percentile lies strictly between 0 and 100"
    if target <= 0:
        return f"slo.{name}: a latency bound in ms above 0, got {target!r}"
    return None


class CapacitySearch(BaseModel):
    """How a capacity case searches: over which load, in what range, to what precision, and
    within what budget (load/capacity/)."""

    model_config = ConfigDict(extra="forbid")

    over: Literal["request_rate", "max_concurrency"] = "request_rate"
    low: FiniteFloat = Field(1.0, gt=0)
    high: FiniteFloat = Field(200.0, gt=0)
    # The bracket [meets, misses] is narrowed until misses / meets <= 1 + precision.
    precision: float = 0.05
    max_probes: int = Field(12, ge=2)
    max_time_s: FiniteFloat = Field(1800.0, gt=0)
    # A rate probe sends at least this long (a burst shorter than the queue's build-up meets
    # SLOs the server cannot hold); a concurrency probe passes through each slot ten times.
    min_duration_s: FiniteFloat = Field(10.0, gt=0)
    # Two-sided confidence of each SLO's interval: "meets" only when the whole interval of
    # the percentile lies under its bound (benchmarks/perf/capacity_search.py chose it).
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    # An unsure probe is extended with more requests, up to this many times its first count.
    max_extension: int = Field(4, ge=1)
    # Independent runs whose pooled samples a load must meet on to count as meeting
    # (load/capacity/: near the capacity one run's tail varies from run to run more than
    # its own interval says).
    confirm: int = Field(2, ge=1)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, value: object) -> float:
        # `5%`, or a fraction (0.05).
        return fraction_of(value, f"a precision is a percentage like '5%', got {value!r}",
                           f"a precision lies between 0% and 100%, got {value!r}")

    @model_validator(mode="after")
    def _bounds(self) -> CapacitySearch:
        # Every problem at once, in one line (pydantic reports one per validator).
        problems = []
        if self.low >= self.high:
            problems.append(
                f"search.low ({self.low:g}) must lie below search.high ({self.high:g})"
            )
        whole = self.over == "max_concurrency"
        if whole and (self.low != int(self.low) or self.high != int(self.high)):
            problems.append("a max_concurrency search takes whole numbers for low and high")
        if not whole and self.low < MIN_SEARCH_RATE:
            problems.append(
                f"search.low: a request_rate search starts at {MIN_SEARCH_RATE:g} req/s or "
                f"more (one request every {1 / MIN_SEARCH_RATE:g} s), got {self.low:g}"
            )
        requests = 10 * self.high if whole else self.high * self.min_duration_s
        if requests > MAX_PROBE_REQUESTS:
            how = "10 x search.high" if whole else "search.high x search.min_duration_s"
            problems.append(
                f"a probe at search.high would send {requests:.3g} requests ({how}), over the "
                f"limit of {MAX_PROBE_REQUESTS:,}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class CapacityConfig(BenchmarkConfig):
    """A capacity case: the serve workload, probed at rising loads on one server until the
    highest load that meets every SLO is bracketed (load/capacity/)."""

    kind: Literal["capacity"] = "capacity"  # type: ignore[assignment]
    slo: dict[str, FiniteFloat]
    search: CapacitySearch = Field(default_factory=CapacitySearch)

    @field_validator("slo")
    @classmethod
    def _known_slos(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("a capacity case needs at least one SLO, e.g. {p99_ttft_ms: 500}")
        for name, target in value.items():
            if (problem := slo_problem(name, target)) is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _goodput_bounds(self) -> CapacityConfig:
        if self.until is not None:
            raise ValueError(
                "until: a capacity probe stops by its own rule (an unsure probe is extended "
                "up to search.max_extension); until is for serve cases"
            )
        if self.dataset_name == "conversation":
            raise ValueError("a capacity case cannot run dataset_name 'conversation' yet")
        if self.is_pooling:
            raise ValueError(
                f"a capacity case cannot search a pooling backend yet ({self.backend})"
            )
        if GOODPUT_SLO in self.slo and not self.goodput:
            raise ValueError(
                f"slo.{GOODPUT_SLO} counts the requests within `goodput` "
                "(e.g. goodput: {ttft: 500, tpot: 50}): set it"
            )
        if self.is_self_timed:
            raise ValueError(
                "a capacity search sets the load itself: a timed_trace case needs "
                "self_timed: false (the trace's requests, sent at the searched load)"
            )
        return self

    def result_names(self) -> list[str]:
        # A search's probes have no one /metrics window: no client overhead is recorded.
        return [name for name in super().result_names()
                if name not in metric_names.CLIENT_OVERHEAD_RESULTS] + list(
                    metric_names.CAPACITY_RESULTS)
