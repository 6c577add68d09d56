"""What a suite's `regression:` block means: the metrics to gate, each with its tolerance and
the direction that is worse, and how each is compared (per-request samples or per-repeat values).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pytest_profllm.plan import metric_names

# Defaults chosen with benchmarks/perf/gate_power.py (docs/regression-gates.md). A per-repeat
# interval spans the run-to-run noise (another moment, another load on the host); a per-request
# one does not (the requests of one run share its moment), so a latency's tolerance must.
DEFAULT_TOLERANCE = 0.05  # per-repeat metrics (throughputs)
DEFAULT_LATENCY_TOLERANCE = 0.10  # per-request metrics (latencies)
DEFAULT_CONFIDENCE = 0.99
DEFAULT_RESAMPLES = 2000

# Compared on one value per repeat: a run has one throughput, not one per request.
PER_REPEAT_METRICS = {
    "request_throughput": True,  # the value: higher is better
    "output_throughput": True,
    "total_token_throughput": True,
    "request_goodput": True,
    "duration": False,
    # A capacity search's result: its interval comes from the brackets, not from repeats.
    "capacity": True,
    # A closed loop's steady state (load/steady_state.py): one figure per repeat.
    "steady_request_throughput": True,
    "steady_output_throughput": True,
    "steady_median_ttft_ms": False,
    "steady_p99_ttft_ms": False,
    "steady_median_tpot_ms": False,
    "steady_p99_tpot_ms": False,
    # An offline throughput run's (`vllm bench throughput`): one figure per repeat.
    "requests_per_second": True,
    "tokens_per_second": True,
    "elapsed_time": False,
    # What the client added to the server's own mean (a serve load's, one figure per repeat).
    "client_overhead_ttft_ms": False,
    "client_overhead_e2el_ms": False,
}
BRACKETED_METRICS = frozenset({"capacity"})
# An accuracy case's metrics (lm-eval's, and each under a filter as `<metric>_<filter>`): their
# interval comes from lm-eval's standard errors (`<name>_stderr`), and they have no tolerance
# of their own: a change outside the interval is a change.
STDERR_METRICS = metric_names.ACCURACY_METRICS
DEFAULT_ACCURACY_TOLERANCE = 0.0
_LATENCY = re.compile(
    r"^(mean|median|std|p(\d+(?:\.\d+)?))_(" + "|".join(metric_names.LATENCY_METRICS) + r")_ms$"
)
# An offline latency run's (`vllm bench latency`): its iterations' latencies are its samples,
# kept as the E2EL of the per-request rows; avg is their mean, pNN a percentile of them.
_ITERATION_LATENCY = re.compile(r"^(avg|p(\d+(?:\.\d+)?))_latency_ms$")
ITERATION_SAMPLES = "e2el"


@dataclass(frozen=True)
class GatedMetric:
    """One metric of a `regression:` block."""

    name: str
    tolerance: float  # a fraction
    higher_is_better: bool
    latency: str | None  # ttft/tpot/itl/e2el: compared on per-request samples; None: per repeat
    statistic: str  # mean, median, std, or a percentile like 99.0; "mean" for per-repeat ones
    # An lm-eval metric (under a filter or not): judged by its standard errors.
    by_stderr: bool = False

    @property
    def per_repeat(self) -> bool:
        return self.latency is None


def latency_statistic(name: str) -> tuple[str, str] | None:
    """(ttft/tpot/itl/e2el, its statistic: mean, median, std or a percentile as text) of a
    per-request latency's name such as `p99_ttft_ms`; None for any other name."""
    match = _LATENCY.match(name)
    if match is None:
        return None
    return match.group(3), match.group(2) or match.group(1)


def gated_metric(name: str, tolerance: float) -> GatedMetric:
    """Raises ValueError naming what can be gated when `name` is not one of those."""
    match = _LATENCY.match(name)
    if match is not None:
        statistic = match.group(2) or match.group(1)
        if match.group(2) is not None and not 0 < float(match.group(2)) < 100:
            raise ValueError(f"{name}: a percentile lies strictly between 0 and 100")
        return GatedMetric(name, tolerance, False, match.group(3), statistic)
    match = _ITERATION_LATENCY.match(name)
    if match is not None:
        if match.group(2) is not None and not 0 < float(match.group(2)) < 100:
            raise ValueError(f"{name}: a percentile lies strictly between 0 and 100")
        statistic = "mean" if match.group(1) == "avg" else match.group(2)
        return GatedMetric(name, tolerance, False, ITERATION_SAMPLES, statistic)
    if name in PER_REPEAT_METRICS:
        return GatedMetric(name, tolerance, PER_REPEAT_METRICS[name], None, "mean")
    accuracy = metric_names.accuracy_metric_of(name)
    if accuracy is not None:
        return GatedMetric(name, tolerance, STDERR_METRICS[accuracy], None, "mean", True)
    raise ValueError(
        f"cannot gate {name!r}: allowed are {', '.join(PER_REPEAT_METRICS)} (per repeat), "
        "mean_/median_/std_/pNN_ of ttft, tpot, itl, e2el in ms (per request), "
        "e.g. p99_ttft_ms, an offline latency case's avg_latency_ms and pNN_latency_ms "
        "(per iteration), e.g. p50_latency_ms, and an accuracy case's "
        f"{', '.join(STDERR_METRICS)}, each also under an lm-eval filter as its record names "
        "it (exact_match_strict_match)"
    )


def measured(gated: Iterable[GatedMetric], results: Iterable[str]) -> list[GatedMetric]:
    """The gated metrics a case's results hold, under the names its record shows. A bare
    lm-eval metric gates itself and each of its filtered variants (`exact_match` gates
    `exact_match_strict_match` and `exact_match_flexible_extract` of gsm8k), at its own
    tolerance unless the block names the variant too."""
    names = list(results)
    chosen: dict[str, GatedMetric] = {}
    named = {metric.name for metric in gated}
    for metric in gated:
        if metric.name in names:
            chosen[metric.name] = metric
        if metric.by_stderr and metric.name in STDERR_METRICS:
            for name in names:
                variant = name != metric.name and name not in named
                if variant and metric_names.accuracy_metric_of(name) == metric.name:
                    chosen.setdefault(name, replace(metric, name=name))
    return list(chosen.values())


def default_tolerance(name: str) -> float:
    if metric_names.accuracy_metric_of(name) is not None:
        return DEFAULT_ACCURACY_TOLERANCE
    return DEFAULT_TOLERANCE if name in PER_REPEAT_METRICS else DEFAULT_LATENCY_TOLERANCE


def parse_tolerance(value: object, default: float = DEFAULT_TOLERANCE) -> float:
    """`5%`, `5` (percent) or null (the default); returns a fraction."""
    if value is None:
        return default
    text = str(value).strip()
    number = text.removesuffix("%").strip()
    try:
        percent = float(number)
    except ValueError:
        raise ValueError(f"a tolerance is a percentage like '5%', got {value!r}") from None
    if isinstance(value, bool) or not 0 <= percent < 100:
        raise ValueError(f"a tolerance is a percentage from 0% to under 100%, got {value!r}")
    return percent / 100


def _entries(block: object) -> list[tuple[str, object]] | None:
    """(metric, tolerance as written) of a `regression:` mapping, or of a list of metrics
    (each at its default); None where it is neither."""
    if isinstance(block, list):
        return [(str(name), None) for name in block]
    if isinstance(block, dict):
        return [(str(name), value) for name, value in block.items()]
    return None


def regression_problems(block: object) -> list[tuple[str | None, str]]:
    """Every problem of a suite's `regression:` value, as (the metric it is about, or None
    for the block, and what is wrong): a bad suite lists them all, not the first alone."""
    if block is None:
        return []
    entries = _entries(block)
    if entries is None:
        return [(None, "'regression' maps metrics to tolerances, e.g. {output_throughput: 5%}")]
    problems: list[tuple[str | None, str]] = []
    for name, value in entries:
        try:
            gated_metric(name, parse_tolerance(value, default_tolerance(name)))
        except ValueError as error:
            problems.append((name, f"{name}: {error}"))
    return problems


def parse_regression(block: object) -> dict[str, float]:
    """A suite's `regression:` value: a mapping metric -> tolerance, or a list of metrics
    (default tolerances: 5 % per repeat, 10 % per request). Returns metric -> tolerance (a
    fraction); raises ValueError naming every problem."""
    problems = regression_problems(block)
    if problems:
        raise ValueError("; ".join(text for _, text in problems))
    return {
        name: parse_tolerance(value, default_tolerance(name))
        for name, value in _entries(block) or []
    }
