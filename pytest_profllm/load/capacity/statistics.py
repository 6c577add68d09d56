"""A capacity probe's statistics: the SLOs, the samples a run gives, and each SLO's
reading from a bootstrap interval ("meets", "misses" or "unsure")."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.plan.suite import GOODPUT_SLO, CapacitySearch

FloatArray = npt.NDArray[np.float64]
Decision = Literal["meets", "misses", "unsure"]

# A percentile is estimated from at least this many samples beyond it (p99: 2,000 requests).
TAIL_SAMPLES = 20
_RESAMPLES = 1000
_BLOCKS = 20


@dataclass(frozen=True)
class Slo:
    """One bound: a latency statistic (ms) at most `target`, or the goodput ratio at least."""

    name: str
    target: float

    @property
    def latency(self) -> str | None:
        """ttft/tpot/itl/e2el, or None for the goodput ratio."""
        if self.name == GOODPUT_SLO:
            return None
        return self.name.rsplit("_", 2)[-2]

    @property
    def statistic(self) -> str:
        """mean, median, or a percentile as text ("99")."""
        head = self.name.split("_", 1)[0]
        return head[1:] if head.startswith("p") else head

    def value(self, samples: FloatArray, axis: int = -1) -> Any:
        if self.statistic == "mean":
            return np.mean(samples, axis=axis)
        if self.statistic == "median":
            return np.median(samples, axis=axis)
        return np.percentile(samples, float(self.statistic), axis=axis)

    @property
    def tail_fraction(self) -> float:
        """The fraction of samples beyond the statistic (a median's: half)."""
        if self.statistic in ("mean", "median") or self.latency is None:
            return 0.5
        return 1 - float(self.statistic) / 100


def slos_of(block: Mapping[str, float]) -> list[Slo]:
    return [Slo(str(name), float(target)) for name, target in block.items()]


def requests_per_probe(slos: list[Slo], num_prompts: int) -> int:
    """Enough requests to estimate every SLO's statistic: TAIL_SAMPLES beyond the highest
    percentile, and never fewer than the workload's own `num_prompts`."""
    # Rounded first: 20 / (1 - 0.9) is 200.00000000000003 in floating point.
    needed = max(math.ceil(round(TAIL_SAMPLES / slo.tail_fraction, 6)) for slo in slos)
    return max(num_prompts, needed)


def steady_requests(load: float, settings: CapacitySearch) -> int:
    """Requests that keep the server at `load` for `min_duration_s` (a rate), or that pass
    through each of `load` concurrent slots ten times: a short burst at a high rate ends
    before a queue can build, and would meet SLOs the server cannot hold."""
    if settings.over == "max_concurrency":
        return math.ceil(10 * load)
    return math.ceil(load * settings.min_duration_s)


@dataclass
class ProbeSamples:
    """What one run at one load measured: per-request latencies in ms (successful requests),
    whether each request met the goodput bounds, and why the run cannot count as meeting."""

    latencies: dict[str, FloatArray]
    good: npt.NDArray[np.bool_] | None = None
    failed: int = 0
    completed: int = 0
    fell_behind: str | None = None
    achieved_rate: float | None = None
    duration_s: float = 0.0

    def pooled(self, more: ProbeSamples) -> ProbeSamples:
        good = None
        if self.good is not None and more.good is not None:
            good = np.concatenate([self.good, more.good])
        return ProbeSamples(
            latencies={
                name: np.concatenate([values, more.latencies.get(name, np.empty(0))])
                for name, values in self.latencies.items()
            },
            good=good,
            failed=self.failed + more.failed,
            completed=self.completed + more.completed,
            fell_behind=self.fell_behind or more.fell_behind,
            achieved_rate=_mean_rate(self, more),
            duration_s=self.duration_s + more.duration_s,
        )


def _mean_rate(first: ProbeSamples, second: ProbeSamples) -> float | None:
    if first.achieved_rate is None or second.achieved_rate is None:
        return first.achieved_rate or second.achieved_rate
    total = first.duration_s + second.duration_s
    if total <= 0:
        return first.achieved_rate
    return (first.achieved_rate * first.duration_s + second.achieved_rate * second.duration_s) / (
        total
    )


@dataclass
class SloReading:
    slo: str
    target: float
    value: float | None
    ci_low: float | None
    ci_high: float | None
    decision: Decision


def decide(
    samples: ProbeSamples, slos: list[Slo], confidence: float, seed: int = 0
) -> tuple[Decision, str | None, list[SloReading]]:
    """The probe's decision, the reason when it is not "meets", and each SLO's reading."""
    readings = [_reading(slo, samples, confidence, seed) for slo in slos]
    if samples.failed:
        return "misses", f"{samples.failed} of {samples.failed + samples.completed} requests " \
            "failed", readings
    missed = [reading.slo for reading in readings if reading.decision == "misses"]
    if missed:
        return "misses", ", ".join(missed), readings
    unsure = [reading.slo for reading in readings if reading.decision == "unsure"]
    if unsure:
        return "unsure", ", ".join(unsure), readings
    if samples.fell_behind:
        # The server may carry it, but the client did not send it: not shown to meet.
        return "unsure", samples.fell_behind, readings
    return "meets", None, readings


def _reading(slo: Slo, samples: ProbeSamples, confidence: float, seed: int) -> SloReading:
    if slo.latency is None:
        return _goodput_reading(slo, samples, confidence)
    values = samples.latencies.get(slo.latency, np.empty(0))
    if values.size < 2:
        return SloReading(slo.name, slo.target, None, None, None, "misses")
    value = float(slo.value(values))
    low, high = _interval(slo, values, confidence, seed)
    decision: Decision = "unsure"
    if high <= slo.target:
        decision = "meets"
    elif low > slo.target:
        decision = "misses"
    return SloReading(slo.name, slo.target, value, low, high, decision)


def _interval(
    slo: Slo, values: FloatArray, confidence: float, seed: int
) -> tuple[float, float]:
    """The bootstrap interval of the statistic, resampling runs of consecutive requests.

    Requests of one run are not independent: a burst of arrivals queues many of them at
    once. Resampling single requests then makes the interval too narrow (a run's p99 varies
    from seed to seed more than it says), so `_BLOCKS` contiguous blocks in sending order are
    resampled whole (a moving-block bootstrap).
    """
    # Deferred: scipy.stats takes about 0.9 s to import.
    from scipy import stats

    if np.ptp(values) == 0:
        return float(values[0]), float(values[0])
    blocks = min(_BLOCKS, values.size // 2)
    size = values.size // blocks
    grid = values[: blocks * size].reshape(blocks, size)

    def statistic(chosen: Any, axis: int = -1) -> Any:
        # chosen: block indices, (..., blocks): the resampled run is their blocks end to end.
        picked = grid[np.asarray(chosen, dtype=np.intp)]
        return slo.value(picked.reshape(*picked.shape[:-2], -1), axis=-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a lumpy resample distribution is what it is
        result = stats.bootstrap(
            (np.arange(blocks),),
            statistic,
            vectorized=True,
            n_resamples=_RESAMPLES,
            confidence_level=confidence,
            method="percentile",
            batch=max(1, 2_000_000 // values.size),
            rng=np.random.default_rng(seed),
        )
    low, high = result.confidence_interval
    return float(low), float(high)


def _goodput_reading(slo: Slo, samples: ProbeSamples, confidence: float) -> SloReading:
    from scipy import stats  # deferred: about 0.9 s to import

    good = samples.good
    total = samples.completed + samples.failed
    if good is None or total == 0:
        return SloReading(slo.name, slo.target, None, None, None, "misses")
    hits = int(np.count_nonzero(good))  # a failed request is not good
    interval = stats.binomtest(hits, total).proportion_ci(confidence, method="wilson")
    low, high = float(interval.low), float(interval.high)
    decision: Decision = "unsure"
    if low >= slo.target:
        decision = "meets"
    elif high < slo.target:
        decision = "misses"
    return SloReading(slo.name, slo.target, hits / total, low, high, decision)


def probe_samples(
    outcomes: list[RequestOutcome],
    summary: Mapping[str, float | int | None],
    health: Mapping[str, float | int | None],
    goodput_ms: Mapping[Any, float] | None,
    fell_behind: str | None,
) -> ProbeSamples:
    """A finished load as a probe's samples: latencies in ms in sending order (vLLM's
    definitions: TPOT over requests of more than one output token), each request's goodput."""
    done = [outcome for outcome in outcomes if outcome.success]
    tpots = []
    for outcome in done:
        if (outcome.output_tokens or 0) > 1:
            tpots.append(_request_value(outcome, "tpot"))
    good = None
    if goodput_ms:
        bounds = {name: limit / 1000 for name, limit in goodput_ms.items()}
        good = np.asarray(
            [
                outcome.success and all(_request_value(outcome, name) <= limit
                                        for name, limit in bounds.items())
                for outcome in outcomes
            ],
            dtype=np.bool_,
        )
    return ProbeSamples(
        latencies={
            "ttft": np.asarray([o.ttft for o in done], dtype=np.float64) * 1000,
            "tpot": np.asarray(tpots, dtype=np.float64) * 1000,
            "itl": np.asarray([gap for o in done for gap in o.itl], dtype=np.float64) * 1000,
            "e2el": np.asarray([o.latency for o in done], dtype=np.float64) * 1000,
        },
        good=good,
        failed=int(summary.get("failed") or 0),
        completed=int(summary.get("completed") or 0),
        fell_behind=fell_behind,
        achieved_rate=_float(health.get("achieved_request_rate")),
        duration_s=float(summary.get("duration") or 0.0),
    )


def _request_value(outcome: RequestOutcome, name: str) -> float:
    if name == "ttft":
        return outcome.ttft
    if name == "e2el":
        return outcome.latency
    tokens = outcome.output_tokens or 0
    return (outcome.latency - outcome.ttft) / (tokens - 1) if tokens > 1 else 0.0


def _float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


# A run's config, load, summary (with health), the server's /metrics around it, and the
# judge's answer on it.
