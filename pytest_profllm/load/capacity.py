"""SLO capacity search: the highest load a server carries while every SLO holds, as a
measurement with a bracket.

A probe runs the workload at one load (a request rate or a concurrency) and decides, for each
SLO, from a bootstrap interval of its statistic (scipy.stats.bootstrap, as the regression gate):
"meets" when the whole interval lies within the bound, "misses" when it lies wholly beyond,
"unsure" otherwise. An unsure probe is extended with more requests (pooled with the first) up
to `max_extension` times its first count; one still unsure counts as a miss, so the reported
capacity is a load shown to meet, never one that merely may. A probe whose requests failed or
whose client fell behind its schedule never meets.

The search bisects the bracket [meets, misses] on a log scale (a load's effect on latency is
multiplicative) from the middle of [low, high] until misses / meets <= 1 + precision, or the
probe or time budget is spent; an end of the range is probed only when the bisection reaches
it. A load meets only on the pooled samples of `confirm` independent runs. The search ends
with one more run at the capacity it found (the re-check): a server that changed while it was
searched (slowed as it served, or was shared with other load) misses there, and the answer is
then no measurement of the server. The probe is a
callable, so the same search drives a live server (run/capacity.py, `profllm bench`) and the
simulator's virtual clock (benchmarks/perf/capacity_search.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import warnings
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from pytest_profllm.hosts.foreign_cpu import ForeignCpu, foreign_problem
from pytest_profllm.load import stages
from pytest_profllm.load.bench import (
    DETAILED_KEYS,
    ServerWindow,
    check_reachable,
    invalid_reasons,
    load_settings,
    measure,
    prompts_of_its_own,
    result_json,
    run_load,
    server_engine,
    workload_own_hits,
)
from pytest_profllm.load.dataset import (
    Codec,
    PromptRequest,
    ServerCodec,
    TokenizerCodec,
    make_prompts,
)
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.prometheus_counters import REQUEST_TOTALS
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.schedule import LoadResult, back_to_back
from pytest_profllm.load.server_state import empty_caches, host_caused, scrape_metrics
from pytest_profllm.plan.metric_names import CLIENT_HEALTH_KEYS
from pytest_profllm.plan.suite import GOODPUT_SLO, CapacityConfig, CapacitySearch

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


@dataclass
class Probe:
    """One load, as the record keeps it."""

    load: float
    requests: int
    completed: int
    failed: int
    achieved_rate: float | None
    duration_s: float
    decision: Decision
    reason: str | None
    readings: list[SloReading] = field(default_factory=list)
    # Why the host may have made this probe's figures: its runs stayed invalid for the host's
    # sake (the client or the simulated engine fell behind) after every run again.
    host: str | None = None

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Recheck:
    """The run at the capacity after the search, cold as every run (fresh prompts, emptied
    cache). It agrees unless it misses: one run near the capacity is often unsure on a steady
    server (its tail varies from run to run), so only a miss shows that the server changed. A
    miss counts as the search counts one, also where the client fell behind (`fell_behind`,
    which the line then names: the host may share the blame)."""

    probe: Probe
    met_with: list[SloReading]  # the readings of the search's probe at that load
    fell_behind: str | None = None
    # The engine cannot change (the virtual clock): a miss is one more sample at that load,
    # which the search then counts as such (`search`'s `steady_engine`), not a changed server.
    steady_engine: bool = False

    @property
    def agrees(self) -> bool:
        return self.probe.decision != "misses"

    def as_record(self) -> dict[str, Any]:
        return {**self.probe.as_record(), "agrees": self.agrees, "fell_behind": self.fell_behind,
                "steady_engine": self.steady_engine}

    def changed(self, over: str) -> str | None:
        """One line saying that the server changed during the search, or None."""
        if self.agrees or self.steady_engine:
            return None
        probe = self.probe
        before = {reading.slo: reading for reading in self.met_with}
        missed = [
            _missed(reading, before.get(reading.slo))
            for reading in probe.readings
            if reading.decision == "misses"
        ]
        what = "; ".join(missed) if missed else (probe.reason or "missed")
        host = f"; also {self.fell_behind}" if self.fell_behind else ""
        return (
            f"the server changed during the search: the capacity it found, {_load(probe.load)} "
            f"{_unit(over)}, missed when run again after it: {what}{host}"
        )


def _missed(reading: SloReading, before: SloReading | None) -> str:
    """`median_tpot_ms 21.4 over 15, where the search measured 14.01`."""
    if reading.value is None:
        return f"{reading.slo} not measured"
    side = "under" if reading.slo == GOODPUT_SLO else "over"
    line = f"{reading.slo} {reading.value:.4g} {side} {reading.target:.4g}"
    if before is not None and before.value is not None:
        line += f", where the search measured {before.value:.4g}"
    return line


def _unit(over: str) -> str:
    return "req/s" if over == "request_rate" else "concurrent requests"


@dataclass
class CapacityResult:
    over: str
    capacity: float | None  # the highest load shown to meet every SLO
    low: float | None  # the bracket: the highest load that met ...
    high: float | None  # ... and the lowest that missed (None: none missed)
    limit: str | None  # the SLO that missed at `high` (or the reason it could not meet)
    stopped: str  # why the search ended
    probes: list[Probe]
    slos: dict[str, float]
    elapsed_s: float
    recheck: Recheck | None = None  # the run at the capacity after the search
    runs: int = 0  # the search's runs (each with a seed of its own)

    def results(self) -> dict[str, float | None]:
        return {"capacity": self.capacity, "capacity_low": self.low, "capacity_high": self.high}

    def kept(self) -> Probe:
        """The probe whose figures the result keeps: the last at the capacity, else the first
        (which says why no load met)."""
        if self.capacity is None:
            return self.probes[0]
        return next(p for p in reversed(self.probes) if p.load == self.capacity)

    def as_record(self) -> dict[str, Any]:
        return {
            "over": self.over,
            "capacity": self.capacity,
            "bracket": [self.low, self.high],
            "limit": self.limit,
            "stopped": self.stopped,
            "slo": self.slos,
            "elapsed_s": self.elapsed_s,
            "probes": [probe.as_record() for probe in self.probes],
            "recheck": None if self.recheck is None else self.recheck.as_record(),
        }

    def changed(self) -> str | None:
        """Why the capacity found is no measurement of the server (it changed during the
        search), or None."""
        return None if self.recheck is None else self.recheck.changed(self.over)

    def host_limited(self) -> str | None:
        """Why the capacity found is the host's, not the server's, or None: the probe that
        bounded the search from above (the lowest load that did not meet; where none met, the
        lowest probed) ran while the host held the client or the simulated engine back. Its
        miss, or its doubt, then says nothing of the server: a busy client sends late and reads
        late, so a server that carries the load can look as though it did not."""
        if self.high is None:
            return None  # nothing bounded it: the highest load searched met
        bounding = [probe for probe in self.probes if probe.load == self.high]
        if not bounding or bounding[-1].host is None:
            return None
        probe = bounding[-1]
        unit = _unit(self.over)
        found = ("no capacity" if self.capacity is None
                 else f"the capacity {_load(self.capacity)} {unit}")
        return (
            f"the host limited the capacity search: {found} was bounded by the probe at "
            f"{_load(probe.load)} {unit} ({probe.decision}), where the {probe.host}"
        )

    def invalid_reason(self) -> str | None:
        """Why the capacity found is no measurement of the server, or None: the server
        changed during the search, or the host bounded it."""
        return self.changed() or self.host_limited()

    def describe(self) -> str:
        """One line for the terminal: the capacity, its bracket, what limits it."""
        unit = _unit(self.over)
        if (invalid := self.invalid_reason()) is not None:
            return invalid
        checked = "" if self.recheck is None else f"; re-check {self.recheck.probe.decision}"
        if self.capacity is None:
            return (
                f"capacity: none in the search range (the lowest load, {_load(self.high)} "
                f"{unit}, missed: {self.limit})"
            )
        if self.high is None:
            return (
                f"capacity >= {_load(self.capacity)} {unit} (the highest load searched met "
                f"every SLO; {len(self.probes)} probes{checked})"
            )
        return (
            f"capacity {_load(self.capacity)} {unit} (bracket {_load(self.low)} .. "
            f"{_load(self.high)}, limited by {self.limit}; {len(self.probes)} probes, "
            f"{self.stopped}{checked})"
        )


def _load(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


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


ProbeRun = Callable[[float, int, int], ProbeSamples]  # (load, requests, seed) -> samples


def search(
    run: ProbeRun,
    slos: list[Slo],
    settings: CapacitySearch,
    num_prompts: int,
    *,
    seed: int = 0,
    clock: Callable[[], float] = time.monotonic,
    on_probe: Callable[[Probe], None] | None = None,
    recheck: ProbeRun | None = None,
    steady_engine: bool = False,
) -> CapacityResult:
    """Narrow the bracket [low, high] around the highest load at which every SLO holds, then
    run the capacity found once more (`recheck`, default `run`): see `Recheck`. Where the
    engine cannot change (`steady_engine`: the virtual clock), a re-check that misses is a
    miss at that load like any other: the capacity falls to the highest load below it that
    met, and the bracket closes on the load that missed.

    Bisection on a log scale starts in the middle: the ends are probed only when the search
    reaches them (a probe at a low rate takes longest: its requests arrive slowly, and a probe
    far above the capacity only queues). A load is "meets" only on the pooled samples of at
    least `settings.confirm` independent runs: near the capacity, one run's tail latency
    varies more from run to run than within the run (a burst of arrivals either happens or
    not), so a single lucky run must not raise the capacity.

    The re-check costs one run of the capacity's probe (its requests, once), also after
    `max_time_s`: an answer never checked is what a drifting server turns into a wrong one.
    """
    found = _bracket(run, slos, settings, num_prompts, seed, clock, on_probe)
    if found.capacity is None:
        return found  # nothing claimed, nothing to check
    began = clock()
    # The readings the search's probe at that load met with, for the line that compares.
    at = [probe.readings for probe in found.probes if probe.load == found.capacity]
    met_with = at[-1] if at else []
    found.recheck = _recheck(recheck or run, found.capacity, met_with, slos, settings,
                             num_prompts, seed, seed + found.runs, steady_engine)
    if steady_engine and not found.recheck.agrees:
        _fall_below(found, found.recheck)
    found.elapsed_s += clock() - began
    return found


def _fall_below(found: CapacityResult, recheck: Recheck) -> None:
    """The capacity after a re-check that missed on an engine that cannot change: at that
    load independent samples of the workload disagree (one met, pooled, and one missed), so it
    is not shown to meet; the highest load below it that met is."""
    missed = recheck.probe.load
    below = [p.load for p in found.probes if p.decision == "meets" and p.load < missed]
    found.capacity = found.low = max(below, default=None)
    found.high = missed
    found.limit = recheck.probe.reason
    found.stopped = f"the re-check at {_load(missed)} {_unit(found.over)} missed"


def _recheck(
    run: ProbeRun,
    load: float,
    met_with: list[SloReading],
    slos: list[Slo],
    settings: CapacitySearch,
    num_prompts: int,
    seed: int,
    run_seed: int,
    steady_engine: bool,
) -> Recheck:
    """One run at `load` as the search's probe there ran, with prompts of a seed no run of it
    used (`run_seed`), judged as its runs were (`seed`)."""
    count = max(requests_per_probe(slos, num_prompts), steady_requests(load, settings))
    samples = run(load, count, run_seed)
    decision, reason, readings = decide(samples, slos, settings.confidence, seed)
    probe = _probe_of(load, count, samples, decision, reason, readings)
    return Recheck(probe, met_with, samples.fell_behind, steady_engine)


def _probe_of(
    load: float,
    requests: int,
    samples: ProbeSamples,
    decision: Decision,
    reason: str | None,
    readings: list[SloReading],
) -> Probe:
    """A decided probe: what it sent, and what its (pooled) samples say."""
    return Probe(
        load=load,
        requests=requests,
        completed=samples.completed,
        failed=samples.failed,
        achieved_rate=samples.achieved_rate,
        duration_s=samples.duration_s,
        decision=decision,
        reason=reason,
        readings=readings,
        host=samples.fell_behind,
    )


def _bracket(
    run: ProbeRun,
    slos: list[Slo],
    settings: CapacitySearch,
    num_prompts: int,
    seed: int,
    clock: Callable[[], float],
    on_probe: Callable[[Probe], None] | None,
) -> CapacityResult:
    """The search itself: the bracket, without the re-check."""
    started = clock()
    base = requests_per_probe(slos, num_prompts)
    probes: list[Probe] = []
    whole = settings.over == "max_concurrency"
    runs = 0

    def probe(load: float) -> Probe:
        """Runs at `load` until decided: a miss after any run; a meet only on the pooled
        samples of at least `confirm` independent runs; unsure extended up to
        `max_extension` runs (not when the client fell behind: more requests would not make
        it keep up)."""
        nonlocal runs
        count = max(base, steady_requests(load, settings))
        samples = run(load, count, seed + runs)
        runs, done_runs = runs + 1, 1
        decision, reason, readings = decide(samples, slos, settings.confidence, seed)
        while done_runs < max(settings.max_extension, settings.confirm) and (
            (decision == "meets" and done_runs < settings.confirm)
            or (decision == "unsure" and samples.fell_behind is None)
        ) and clock() - started < settings.max_time_s:
            samples = samples.pooled(run(load, count, seed + runs))
            runs, done_runs = runs + 1, done_runs + 1
            decision, reason, readings = decide(samples, slos, settings.confidence, seed)
        if decision == "meets" and done_runs < settings.confirm:
            decision, reason = "unsure", f"met on {done_runs} run(s), {settings.confirm} needed"
        elif decision == "unsure" and samples.fell_behind is None:
            reason = f"unsure after {done_runs * count} requests ({reason})"
        done = _probe_of(load, done_runs * count, samples, decision, reason, readings)
        probes.append(done)
        if on_probe is not None:
            on_probe(done)
        return done

    def result(
        low: float | None, high: float | None, limit: str | None, stopped: str
    ) -> CapacityResult:
        return CapacityResult(
            over=settings.over,
            capacity=low,
            low=low,
            high=high,
            limit=limit,
            stopped=stopped,
            probes=probes,
            slos={slo.name: slo.target for slo in slos},
            elapsed_s=clock() - started,
            runs=runs,
        )

    low, high = settings.low, settings.high
    met = missed = False  # whether `low` and `high` were probed (or are probed loads)
    limit: str | None = None
    stopped = "precision"
    while high / low > 1 + settings.precision:
        # Keep probes for the ends the bisection has not reached.
        reserved = (not met) + (not missed)
        if len(probes) + reserved >= settings.max_probes:
            stopped = "max_probes"
            break
        if clock() - started >= settings.max_time_s:
            stopped = "max_time_s"
            break
        middle = math.sqrt(low * high)
        if whole:
            middle = float(round(middle))
            if not low < middle < high:
                break  # neighbouring whole numbers: nothing lies between
        tried = probe(middle)
        if tried.decision == "meets":
            low, met = middle, True
        else:
            high, missed, limit = middle, True, _limit(tried)
    if not met:
        first = probe(settings.low) if low == settings.low else None
        if first is None or first.decision != "meets":
            why = _limit(first) if first is not None else limit
            return result(None, low, why, "below the search range")
    if not missed and high == settings.high:
        last = probe(settings.high)
        if last.decision == "meets":
            return result(settings.high, None, None, "above the search range")
        limit = _limit(last)
    return result(low, high, limit, stopped)


def _limit(probe: Probe) -> str | None:
    """What kept a probe from meeting: the SLOs not shown to hold, else its reason."""
    names = [reading.slo for reading in probe.readings if reading.decision != "meets"]
    return ", ".join(names) if names else probe.reason


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


# A run's config, load, summary (with health) and the server's /metrics around it.
Measured = tuple[CapacityConfig, LoadResult, dict[str, Any], ServerWindow]


class ServerProbes:
    """Probes against one running server. Every run of every probe is independent: it starts
    from an emptied prefix cache, with prompts no earlier run sent (drawn from the run's own
    seed), so no probe is answered from what the one before it left. A run the host made
    invalid (the client or the simulated engine fell behind) runs again, up to `remeasure`
    more times. Keeps what each load measured last, and the search's re-check apart
    (`recheck`: its run must not stand for the probe at the capacity); `drive` runs a load to
    its end (the case's also watches that the server lives)."""

    def __init__(
        self,
        bench: CapacityConfig,
        base_url: str,
        codec: Codec,
        prompts: list[PromptRequest],
        model: str,
        api_key: str | None,
        max_schedule_lag_ms: float | None,
        drive: Callable[[Coroutine[Any, Any, LoadResult]], LoadResult] = asyncio.run,
        endpoint: str | None = None,
        remeasure: int = 0,
        holding: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        budget: RemeasureBudget | None = None,
        load_cores: Callable[[], frozenset[int]] = frozenset,
        max_foreign_cpu: float | None = None,
    ) -> None:
        self.bench = bench
        self.base_url = base_url
        self.drive = drive
        self.endpoint = endpoint
        self.codec = codec
        self.first_prompts = prompts  # drawn from the workload's own seed: the first run's
        self.model = model
        self.api_key = api_key
        self.max_schedule_lag_ms = max_schedule_lag_ms
        self.remeasure = remeasure
        self.budget = budget or RemeasureBudget()  # the session's time for runs again
        self.holding = holding  # held from drawing a probe's prompts to its last run
        # The cores a run's load runs on while `holding` (none: not watched), and the share
        # of them others may use before the run is the host's (hosts/foreign_cpu.py).
        self.load_cores = load_cores
        self.max_foreign_cpu = max_foreign_cpu
        # load -> (config, load result, summary with health, /metrics around it) of its last run
        self.measured: dict[float, Measured] = {}
        # load -> why each of its runs that the host made invalid was run again
        self.remeasured: dict[float, list[str]] = {}
        self.cache_states: set[str] = set()  # how the runs found the prefix cache
        # load -> what its last run's prompts could find of each other in a cold cache
        self.own_hits: dict[float, int] = {}
        # The re-check's run after the search, and why it was run again (as `measured`).
        self.rechecked: Measured | None = None
        self.recheck_remeasured: list[str] = []
        # load -> every run at it, in order: a probe's figures are those of all its runs
        self.runs: dict[float, list[Measured]] = {}
        # What every run sent, kept or run again (the record's `capacity.requests_sent`): the
        # client's Prometheus counters count each run, and these add up to them.
        self.requests_sent: dict[str, int] = dict.fromkeys(REQUEST_TOTALS, 0)

    def probe_runs(
        self, probe: Probe
    ) -> list[Measured]:
        """The runs that made `probe`: the last runs at its load, as many as its requests
        (each run sends its config's num_prompts)."""
        runs: list[Measured] = []
        for run in reversed(self.runs.get(probe.load, [])):
            if sum(config.num_prompts for config, *_ in runs) >= probe.requests:
                break
            runs.insert(0, run)
        return runs

    def pooled(self, probe: Probe) -> tuple[CapacityConfig, LoadResult, dict[str, Any]]:
        """The probe's figures as its table shows them: vLLM's metrics and the client's
        health over the requests of all its runs, laid back to back (the last run alone was
        kept before: half a confirmed probe's requests, its figures not the probe's)."""
        runs = self.probe_runs(probe)
        config = runs[-1][0]
        load = back_to_back([result for _, result, _, _ in runs])
        summary, health = measure(load, config, self.codec)
        summary.update(health)
        return config, load, summary

    def prompts_for(self, count: int, seed: int) -> list[PromptRequest]:
        if seed == self.bench.seed and count <= len(self.first_prompts):
            return self.first_prompts[:count]
        return make_prompts(
            self.bench.model_copy(update={"num_prompts": count, "seed": seed}), self.codec
        )

    def __call__(self, load: float, count: int, seed: int) -> ProbeSamples:
        probe = len(self.runs) + (load not in self.runs)  # its runs after the first count once
        stages.enter("searching", f"probe {probe} at {_load(load)} {_unit(self.bench.search.over)}")
        with self.holding():
            samples, measured, own_hits, again = self._run(load, count, seed)
        self.measured[load], self.own_hits[load] = measured, own_hits
        self.runs.setdefault(load, []).append(measured)
        if again:
            self.remeasured.setdefault(load, []).extend(again)
        return samples

    def recheck(self, load: float, count: int, seed: int) -> ProbeSamples:
        """The search's re-check at the capacity: a run as any other, kept apart."""
        stages.enter("searching", f"re-check at {_load(load)} {_unit(self.bench.search.over)}")
        with self.holding():
            samples, self.rechecked, _, self.recheck_remeasured = self._run(load, count, seed)
        return samples

    def _run(
        self, load: float, count: int, seed: int
    ) -> tuple[ProbeSamples, Measured, int, list[str]]:
        """One run (and its runs again): its samples, what it measured, what its prompts find
        of each other in a cold cache, and why it was run again."""
        over = self.bench.search.over
        value: float | int = int(load) if over == "max_concurrency" else load
        config = self.bench.model_copy(update={over: value, "num_prompts": count, "seed": seed})
        chosen = self.prompts_for(count, seed)
        settings = load_settings(
            config, self.base_url, self.model, api_key=self.api_key, endpoint=self.endpoint
        )
        metrics_url = f"{self.base_url.rstrip('/')}/metrics"
        own_hits = workload_own_hits(chosen, config, self.codec)
        again: list[str] = []
        for attempt in range(self.remeasure + 1):
            started = time.monotonic()
            self.cache_states.add(empty_caches(self.base_url, config, self.api_key).describe())
            before = scrape_metrics(metrics_url)
            foreign = ForeignCpu(self.load_cores())
            result = self.drive(run_load(settings, chosen))
            share = foreign.share()
            window = (before, scrape_metrics(metrics_url))
            summary, health = measure(result, config, self.codec)
            summary.update(health)
            for key in REQUEST_TOTALS:
                self.requests_sent[key] += int(summary.get(key) or 0)
            reasons = invalid_reasons(
                result, config, health, self.max_schedule_lag_ms, window, own_hits
            )
            if (busy := foreign_problem(share, self.max_foreign_cpu)) is not None:
                reasons.append(busy)
            host = [reason for reason in reasons if host_caused(reason)]
            self.budget.spent(time.monotonic() - started, again=attempt > 0)
            if not host or attempt == self.remeasure:
                break
            if not self.budget.allows():
                host.append(self.budget.exhausted_reason())
                break
            again.append("; ".join(host))
            stages.enter("remeasuring", f"{_load(load)} {_unit(self.bench.search.over)}, "
                         f"attempt {attempt + 2}")
        samples = probe_samples(
            result.outcomes, summary, health, self.bench.goodput, "; ".join(host) or None
        )
        return samples, (config, result, summary, window), own_hits, again


@dataclass
class ServerSearch:
    """A capacity search against a running server: its result, and the figures (vLLM's result
    keys) and load of the probe at the capacity (else of the first probe)."""

    found: CapacityResult
    result: dict[str, Any]
    load: LoadResult


def search_server(
    config: CapacityConfig,
    base_url: str,
    model: str,
    *,
    served_model_name: str | None = None,
    tokenizer: str | None = None,
    api_key: str | None = None,
    endpoint: str | None = None,
    label: str | None = None,
    on_probe: Callable[[Probe], None] | None = None,
    max_schedule_lag_ms: float | None = None,
) -> ServerSearch:
    """`profllm bench` with SLOs: the search against the server at `base_url`."""
    check_reachable(base_url)
    name = served_model_name or model
    codec: Codec = (
        TokenizerCodec.load(tokenizer) if tokenizer else ServerCodec(base_url, name, api_key)
    )
    slos = slos_of(config.slo)
    per_probe = requests_per_probe(slos, config.num_prompts)
    config = prompts_of_its_own(config, empty_caches(base_url, config, api_key))
    prompts = make_prompts(config.model_copy(update={"num_prompts": per_probe}), codec)
    probes = ServerProbes(config, base_url, codec, prompts, name, api_key,
                          max_schedule_lag_ms, endpoint=endpoint)
    found = search(probes, slos, config.search, config.num_prompts, seed=config.seed,
                   on_probe=on_probe, recheck=probes.recheck)
    probe_config, load, summary = probes.pooled(found.kept())
    health = {key: value for key, value in summary.items() if key in CLIENT_HEALTH_KEYS}
    result = result_json(probe_config, model, tokenizer, label, load, summary, health, codec)
    result["engine"] = server_engine(base_url, api_key)
    result.update(found.results())
    result["capacity_search"] = found.as_record()
    result["prefix_cache"] = "; ".join(sorted(probes.cache_states))
    result["prompt_seed"] = config.seed
    if (invalid := found.invalid_reason()) is not None:
        # As `profllm bench` says of a load the client set the pace of: ingested, invalid.
        result["verdict"], result["invalid_reason"] = "invalid", invalid
    for key in DETAILED_KEYS:
        result.pop(key, None)
    return ServerSearch(found, result, load)


def describe_probe(probe: Probe, over: str) -> str:
    """One line per probe as the search goes: load, decision, and each SLO's reading."""
    unit = "req/s" if over == "request_rate" else "concurrent"
    readings = ", ".join(
        f"{r.slo} {r.value:.4g} [{r.ci_low:.4g}, {r.ci_high:.4g}]"
        if r.value is not None and r.ci_low is not None and r.ci_high is not None
        else f"{r.slo} -"
        for r in probe.readings
    )
    line = f"probe {probe.load:.4g} {unit}: {probe.decision} ({probe.requests} requests"
    if probe.achieved_rate is not None:
        line += f", achieved {probe.achieved_rate:.4g} req/s"
    line += f"); {readings}"
    return line + (f"; {probe.reason}" if probe.reason and probe.decision != "meets" else "")
