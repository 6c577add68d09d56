"""The gate where a case runs: after each measured repeat its samples are kept; after the last
repeat every gated metric is judged against the baseline over all the repeats."""

from __future__ import annotations

import sqlite3

import pytest

from pytest_profllm.gates.baseline import Baseline
from pytest_profllm.gates.config import GATE_CONFIG_KEY
from pytest_profllm.gates.regression import describe, judge_regression, values_of
from pytest_profllm.gates.samples import RunSamples, samples_of
from pytest_profllm.hosts.foreign_cpu import FOREIGN_NOTE_SHARE
from pytest_profllm.plan.regression import gated_metric, measured
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.record import RegressionResult
from pytest_profllm.run.outcome import CaseOutcome

_PENDING = pytest.StashKey[dict[str, list[RunSamples]]]()
# Others' share of each pending repeat's load cores (hosts/foreign_cpu.py), by fingerprint.
_FOREIGN = pytest.StashKey[dict[str, list[float]]]()
_BASELINE = pytest.StashKey[Baseline]()


def baseline_of(config: pytest.Config) -> Baseline | None:
    gate = config.stash[GATE_CONFIG_KEY]
    if gate.baseline is None:
        return None
    if _BASELINE not in config.stash:
        config.stash[_BASELINE] = Baseline(gate.baseline, gate.with_version)
    return config.stash[_BASELINE]


def judge_case(config: pytest.Config, outcome: CaseOutcome) -> list[RegressionResult]:
    """The case's regression results at its last repeat; [] before it, or where nothing is gated."""
    case = outcome.case
    if not case.regression or not outcome.results:
        return []
    record = outcome.record("passed", None)
    key = digests(record)[0]  # the repeats of one case share their fingerprint
    pending = config.stash.setdefault(_PENDING, {})
    runs = pending.setdefault(key, [])
    runs.append(samples_of(record, outcome.requests))
    busy = config.stash.setdefault(_FOREIGN, {})
    shares = busy.setdefault(key, [])
    share = outcome.telemetry.get("host_foreign_cpu_share")
    if isinstance(share, int | float):
        shares.append(float(share))
    if case.repeat_index < case.repeat_count - 1:
        return []
    del pending[key]
    del busy[key]
    baseline = baseline_of(config)
    baseline_runs: list[RunSamples] = []
    if baseline is not None:
        try:
            baseline_runs = baseline.runs_for(record)
        except (ValueError, OSError, sqlite3.Error) as error:  # its files, read per case
            pytest.fail(f"--profllm-baseline {baseline.path}: cannot be read: {error}",
                        pytrace=False)
    settings = config.stash[GATE_CONFIG_KEY].settings
    asked = [gated_metric(name, tolerance) for name, tolerance in case.regression.items()]
    # Each under the name the record shows: a bare lm-eval metric gates its filtered variants.
    gated = measured(asked, {name for run in runs for name in run.results})
    # A metric the case does not measure is not gated on it, rather than judged `no-baseline`
    # for ever (and failed under --profllm-require-baseline): `regression: [acc]` over an
    # axis of accuracy tasks, one of which scores exact_match alone.
    results = [judge_regression(metric, runs, baseline_runs, settings)
                for metric in gated if values_of(metric, runs).size]
    # A change found on a run the host kept busy is named with it: the share alone moved no
    # figure in benchmarks/perf/foreign_cpu.py, so it voids nothing, but a reader of a
    # regression must know.
    if shares and max(shares) > FOREIGN_NOTE_SHARE:
        for result in results:
            if result.decision in ("regressed", "improved"):
                result.host_busy = round(max(shares), 4)
    return results


def regression_message(
    results: list[RegressionResult], require_baseline: bool = False
) -> str | None:
    """Why the gate fails the case: a regression, or (where a baseline is required) none to
    compare with."""
    regressed = [result for result in results if result.decision == "regressed"]
    if regressed:
        return "regression: " + "; ".join(describe(result) for result in regressed)
    if require_baseline and results and all(v.decision == "no-baseline" for v in results):
        return "no baseline for this case (--profllm-require-baseline)"
    # A baseline is required to judge: one that is there and cannot judge does not pass.
    not_judged = [result for result in results if result.decision == "not-judged"]
    if require_baseline and not_judged:
        return "not judged (--profllm-require-baseline): " + "; ".join(
            describe(result) for result in not_judged
        )
    return None


def baseline_problem(config: pytest.Config) -> str | None:
    """Why --profllm-baseline cannot be read at all (not a results database, a bad record),
    known before any case runs; None where it can (or none is given)."""
    baseline = baseline_of(config)
    if baseline is None or config.stash[GATE_CONFIG_KEY].update_baseline:
        return None
    try:
        baseline.describe()
    except (ValueError, OSError, sqlite3.Error) as error:
        return f"--profllm-baseline {baseline.path}: not a baseline: {error}"
    return None
