"""What the results database's earlier sessions say about this session's gated cases, as
warnings that never change a verdict: that a session without `--profllm-baseline` had a
history to gate against, and that a baseline being written is slower than its history (the
gate's own test run backwards: the new baseline judged against the earlier sessions)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from pytest_profllm.gates.baseline import Baseline
from pytest_profllm.gates.regression import GateSettings, judge_regression
from pytest_profllm.gates.samples import RunSamples, samples_of
from pytest_profllm.gates.summary import change_text
from pytest_profllm.plan.regression import gated_metric
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.record import is_valid

# The history a new baseline is judged against: the latest sessions of its fingerprint, so a
# long history costs no more than a few sessions' samples.
HISTORY_SESSIONS = 5

Runs = list[tuple[dict[str, Any], list[dict[str, Any]] | None]]


def ungated_history(db_path: Path, gated: list[dict[str, Any]], with_version: bool) -> str | None:
    """One line where gated cases judged `no-baseline` for want of `--profllm-baseline` have
    earlier sessions in `db_path`; None where none has (or the database cannot be read)."""
    if not db_path.is_file():
        return None
    baseline = Baseline(db_path, with_version)
    try:
        known = [record for record in gated if baseline.earlier_sessions(record)]
    except (sqlite3.Error, OSError, ValueError):
        return None  # a hint only: the database's own problems are said where it is loaded
    if not known:
        return None
    return (
        f"{len(known)} of {len(gated)} gated case(s) have earlier sessions in {db_path} but "
        f"were not compared (no --profllm-baseline): gate them with --profllm-baseline {db_path}"
    )


def slower_than_history(
    db_paths: list[Path], runs: Runs, with_version: bool, settings: GateSettings
) -> list[str]:
    """One line per gated case of `runs` (this session's, being written as the baseline)
    that the gate would call regressed against the latest sessions of its history in the
    first of `db_paths` that has one."""
    own = {record["run_id"] for record, _ in runs}
    repeats: dict[str, list[RunSamples]] = {}
    for record, requests in runs:
        if not is_valid(record):
            continue  # only valid measurements are written as the baseline
        repeats.setdefault(digests(record)[0], []).append(samples_of(record, requests))
    sources = [Baseline(path, with_version) for path in dict.fromkeys(db_paths) if path.is_file()]
    lines = []
    for record, _ in runs:
        if not record.get("regression") or not is_valid(record):
            continue
        found = _history(sources, record, own)
        if found is None:
            continue
        source, history = found
        judged = [
            judge_regression(
                gated_metric(v["metric"], v["tolerance"]),
                repeats[digests(record)[0]],
                history,
                settings,
            )
            for v in record["regression"]
        ]
        regressed = [v for v in judged if v.decision == "regressed"]
        if not regressed:
            continue
        sessions = len({run.session_id for run in history})
        changes = "; ".join(
            f"{change_text(v.model_dump())} (tolerance {v.tolerance:.0%})" for v in regressed
        )
        lines.append(
            f"the new baseline of {record['case_id']} is regressed against its last "
            f"{sessions} session(s) in {source}: {changes}"
        )
    return lines


def _history(
    sources: list[Baseline], record: dict[str, Any], own: set[str]
) -> tuple[Path, list[RunSamples]] | None:
    for source in sources:
        try:
            history = source.runs_for(record, HISTORY_SESSIONS)
        except (sqlite3.Error, OSError, ValueError):
            continue
        # A resumed case's record is an earlier session's: it is not its own history.
        history = [run for run in history if run.run_id not in own]
        if history:
            return source.path, history
    return None
