"""The capacity search: a bisection on a log scale over probes at loads it chooses, with
confirmation runs and a re-check at the capacity found; and what the record keeps of it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pytest_profllm.load.capacity.statistics import (
    Decision,
    ProbeSamples,
    Slo,
    SloReading,
    decide,
    requests_per_probe,
    steady_requests,
)
from pytest_profllm.plan.suite import GOODPUT_SLO, CapacitySearch


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
            f"the server changed during the search: the capacity it found, {load_text(probe.load)} "
            f"{unit_of(over)}, missed when run again after it: {what}{host}"
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


def unit_of(over: str) -> str:
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
        unit = unit_of(self.over)
        found = ("no capacity" if self.capacity is None
                 else f"the capacity {load_text(self.capacity)} {unit}")
        return (
            f"the host limited the capacity search: {found} was bounded by the probe at "
            f"{load_text(probe.load)} {unit} ({probe.decision}), which the host made: {probe.host}"
        )

    def invalid_reason(self) -> str | None:
        """Why the capacity found is no measurement of the server, or None: the server
        changed during the search, or the host bounded it."""
        return self.changed() or self.host_limited()

    def describe(self) -> str:
        """One line for the terminal: the capacity, its bracket, what limits it."""
        unit = unit_of(self.over)
        if (invalid := self.invalid_reason()) is not None:
            return invalid
        checked = "" if self.recheck is None else f"; re-check {self.recheck.probe.decision}"
        if self.capacity is None:
            return (
                f"capacity: none in the search range (the lowest load, {load_text(self.high)} "
                f"{unit}, missed: {self.limit})"
            )
        if self.high is None:
            return (
                f"capacity >= {load_text(self.capacity)} {unit} (the highest load searched met "
                f"every SLO; {len(self.probes)} probes{checked})"
            )
        return (
            f"capacity {load_text(self.capacity)} {unit} (bracket {load_text(self.low)} .. "
            f"{load_text(self.high)}, limited by {self.limit}; {len(self.probes)} probes, "
            f"{self.stopped}{checked})"
        )


def load_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


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
    found.stopped = f"the re-check at {load_text(missed)} {unit_of(found.over)} missed"


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

