"""Noise-aware verdicts: a bootstrap confidence interval (load/bootstrap.py) of the relative
change of one metric against the baseline. Regressed or improved only when the whole interval
lies beyond the tolerance; otherwise unchanged. An accuracy's interval comes from lm-eval's
standard errors instead, a capacity's from its searches' brackets. A change with no interval
(no standard error, one repeat, a search with no upper end) is `not-judged`, with the reason:
never `unchanged`, which would hide any drop.

Latencies are compared on per-request samples pooled over the repeats (a p99 is a statistic of
requests); throughputs on one value per repeat (a run has one throughput).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from pytest_profllm.gates.samples import FloatArray, RunSamples
from pytest_profllm.load import bootstrap
from pytest_profllm.plan.regression import (
    BRACKETED_METRICS,
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    GatedMetric,
)
from pytest_profllm.results.record import RegressionDecision, RegressionResult


@dataclass(frozen=True)
class GateSettings:
    confidence: float = DEFAULT_CONFIDENCE
    resamples: int = DEFAULT_RESAMPLES
    seed: int = 0  # the bootstrap's own random stream: one verdict per data, run after run


def statistic_of(metric: GatedMetric) -> Callable[..., Any]:
    """The metric's statistic along the last axis, vectorised as scipy.stats.bootstrap calls it."""
    return bootstrap.statistic_of(metric.statistic)


def values_of(metric: GatedMetric, runs: list[RunSamples]) -> FloatArray:
    """Per-request samples pooled over runs, or one value per run."""
    if metric.latency is not None:
        pooled = [run.latencies.get(metric.latency) for run in runs]
        arrays = [array for array in pooled if array is not None and array.size]
        return np.concatenate(arrays) if arrays else np.empty(0)
    values = [run.results.get(metric.name) for run in runs]
    return np.asarray([v for v in values if isinstance(v, int | float)], dtype=np.float64)


def judge_regression(
    metric: GatedMetric,
    new_runs: list[RunSamples],
    baseline_runs: list[RunSamples],
    settings: GateSettings,
) -> RegressionResult:
    new = values_of(metric, new_runs)
    base = values_of(metric, baseline_runs)
    stat = statistic_of(metric)
    result = RegressionResult(
        metric=metric.name,
        decision="no-baseline",
        tolerance=metric.tolerance,
        higher_is_better=metric.higher_is_better,
        value=float(stat(new)) if new.size else None,
        confidence=settings.confidence,
        samples=int(new.size),
        baseline_samples=int(base.size),
        baseline_session=baseline_runs[0].session_id if baseline_runs else None,
    )
    if not base.size or not new.size:
        return result
    result.baseline = float(stat(base))
    if result.value is None:
        return _not_judged(result, "no value")
    if result.baseline == 0:
        if result.value == 0:
            result.decision = "unchanged"  # zero then, zero now
            return result
        return _not_judged(result, "the baseline is 0: no relative change")
    result.change = result.value / result.baseline - 1
    if metric.name in BRACKETED_METRICS:
        interval = bracket_interval(metric.name, new_runs, baseline_runs)
        why = "a search met at its highest load: its capacity has no upper end"
    elif metric.by_stderr:
        interval = stderr_interval(metric.name, new_runs, baseline_runs, settings.confidence)
        why = "no standard error (lm-eval's N/A, as with limit: 1)"
    else:
        interval = change_interval(stat, new, base, settings)
        # One value (a repeat lost to an invalid measurement) has no spread to judge noise by.
        why = "fewer than two values on a side: no spread to judge the noise by"
    if interval is None:
        return _not_judged(result, why)
    result.ci_low, result.ci_high = interval
    result.decision = classify(metric, *interval)
    return result


def _not_judged(result: RegressionResult, reason: str) -> RegressionResult:
    result.decision = "not-judged"
    result.reason = reason
    return result


def change_interval(
    stat: Callable[..., Any], new: FloatArray, base: FloatArray, settings: GateSettings
) -> tuple[float, float] | None:
    """The bootstrap interval of stat(new) / stat(base) - 1, resampling each side apart;
    None where a side has fewer than two values."""

    def relative_change(x: FloatArray, y: FloatArray, axis: int = -1) -> Any:
        with np.errstate(divide="ignore", invalid="ignore"):
            return stat(x, axis=axis) / stat(y, axis=axis) - 1

    return bootstrap.percentile_interval(
        (new, base), relative_change, settings.confidence, settings.resamples, settings.seed
    )


def bracket_interval(
    name: str, new_runs: list[RunSamples], baseline_runs: list[RunSamples]
) -> tuple[float, float] | None:
    """The change's interval from the searches' brackets: each side's true value lies in
    [its highest load that met, its lowest that missed], so the change lies between the
    lowest new over the highest baseline and the highest new over the lowest baseline. Over
    repeats, the widest: the lowest low and the highest high. A side whose search met at its
    highest load (no upper end) has no interval."""
    new = _bracket(name, new_runs)
    base = _bracket(name, baseline_runs)
    if new is None or base is None or base[0] <= 0:
        return None
    return new[0] / base[1] - 1, new[1] / base[0] - 1


def stderr_interval(
    name: str, new_runs: list[RunSamples], baseline_runs: list[RunSamples], confidence: float
) -> tuple[float, float] | None:
    """The change's interval from lm-eval's standard errors: the difference of the two sides'
    means (over repeats) within z x sqrt(se_new^2 + se_baseline^2), z at the gate's
    confidence, relative to the baseline. A side without a standard error has no interval."""
    new, base = _mean_and_stderr(name, new_runs), _mean_and_stderr(name, baseline_runs)
    if new is None or base is None or base[0] == 0:
        return None
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    half = z * math.hypot(new[1], base[1])
    difference = new[0] - base[0]
    return (difference - half) / abs(base[0]), (difference + half) / abs(base[0])


def _mean_and_stderr(name: str, runs: list[RunSamples]) -> tuple[float, float] | None:
    """A side's mean over its repeats and the standard error of that mean (each repeat's
    standard error from lm-eval: the repeats' errors add in quadrature, over their count)."""
    pairs = [(run.results.get(name), run.results.get(f"{name}_stderr")) for run in runs]
    numbers = [
        (v, e) for v, e in pairs
        if isinstance(v, int | float) and isinstance(e, int | float) and math.isfinite(v + e)
    ]
    if not numbers or len(numbers) != len(pairs):
        return None
    mean = sum(v for v, _ in numbers) / len(numbers)
    return mean, math.sqrt(sum(e * e for _, e in numbers)) / len(numbers)


def _bracket(name: str, runs: list[RunSamples]) -> tuple[float, float] | None:
    lows = [run.results.get(f"{name}_low") for run in runs]
    highs = [run.results.get(f"{name}_high") for run in runs]
    # A search with no upper end may say so with NaN (or inf): no end, so no interval.
    numbers = [v for v in (*lows, *highs) if isinstance(v, int | float) and math.isfinite(v)]
    if not lows or len(numbers) != 2 * len(lows):
        return None
    return min(numbers[: len(lows)]), max(numbers[len(lows) :])


def classify(metric: GatedMetric, low: float, high: float) -> RegressionDecision:
    tolerance = metric.tolerance
    worse_high = not metric.higher_is_better  # a latency rises when it gets worse
    if worse_high:
        if low > tolerance:
            return "regressed"
        if high < -tolerance:
            return "improved"
    else:
        if high < -tolerance:
            return "regressed"
        if low > tolerance:
            return "improved"
    return "unchanged"


def describe(result: RegressionResult) -> str:
    """One line: metric, decision, baseline and new values, change and interval."""
    if result.decision == "no-baseline":
        return f"{result.metric}: no baseline"
    if result.decision == "not-judged":
        change = "" if result.change is None else f" ({result.change:+.1%})"
        return f"{result.metric} not judged{change}: {result.reason or 'no interval'}"
    base = "-" if result.baseline is None else f"{result.baseline:.4g}"
    value = "-" if result.value is None else f"{result.value:.4g}"
    text = f"{result.metric} {result.decision}: baseline {base}, now {value}"
    if result.change is not None:
        text += f", {result.change:+.1%}"
    if result.ci_low is not None and result.ci_high is not None:
        text += (
            f" ({result.confidence:.0%} CI {result.ci_low:+.1%} .. {result.ci_high:+.1%}, "
            f"tolerance {result.tolerance:.0%})"
        )
    if result.host_busy is not None:
        text += (f"; host busy: processes outside the session used {result.host_busy:.0%} "
                 "of the load's cores, the change may be the host's")
    return text
