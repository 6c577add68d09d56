"""What the results database's earlier sessions tell a gated session, as warnings that never
change a verdict (gates/earlier.py): a session without --profllm-baseline is told it had a
history to gate against; a baseline being written that the gate would call regressed against
that history is named, in the terminal and the Markdown summary. Its sessions run on the virtual
clock, which PROFLLM_SIM_SLOWDOWN slows as it does the real-time engine."""

from __future__ import annotations

import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from helpers import run_suites
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gate_end_to_end import SUITE, VIRTUAL
from test_gate_regression import SETTINGS, record, requests_rows

from pytest_profllm.gates import earlier
from pytest_profllm.gates.baseline import Baseline
from pytest_profllm.results import gate_tables as tables

HINT = "*profllm: 1 of 1 gated case(s) have earlier sessions in *results.db but were not compared*"
SLOWER = "*profllm: the new baseline of bench_gate.yaml::sim-8b::random-r2 is regressed against *"


def test_a_session_without_baseline_is_told_of_its_history(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".yaml", bench_gate=SUITE.format(seed=0))
    first = run_suites(pytester, ports, VIRTUAL, gpus=None, cache=False)
    first.assert_outcomes(passed=2)
    assert "have earlier sessions" not in first.stdout.str()
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.3")
    slowed = run_suites(pytester, ports, VIRTUAL, gpus=None, cache=False)
    # Still a pass: without --profllm-baseline nothing is compared; the hint says how to.
    slowed.assert_outcomes(passed=2)
    slowed.stdout.fnmatch_lines([HINT + "--profllm-baseline *results/results.db"])


def test_a_slower_baseline_is_named_when_written(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".yaml", bench_gate=SUITE.format(seed=0))
    history = run_suites(pytester, ports, VIRTUAL, gpus=None, cache=False)
    history.assert_outcomes(passed=2)
    # Each baseline is written into a fresh folder, so the gate itself has nothing to compare
    # and passes: only the history in results/results.db can tell the slowed one apart.
    normal = run_suites(
        pytester, ports, "--profllm-baseline=base1/", "--profllm-baseline-update", VIRTUAL,
        gpus=None, cache=False,
    )
    normal.assert_outcomes(passed=2)
    assert "new baseline of" not in normal.stdout.str()
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.3")
    slowed = run_suites(
        pytester, ports, "--profllm-baseline=base2/", "--profllm-baseline-update", VIRTUAL,
        gpus=None, cache=False,
    )
    # A warning only: the update writes the baseline it was asked to.
    slowed.assert_outcomes(passed=2)
    slowed.stdout.fnmatch_lines([SLOWER + "last 2 session(s) in *results/results.db: *"])
    assert "tolerance" in slowed.stdout.str()
    markdown = (pytester.path / "results" / "summary.md").read_text()
    assert "> **Warning:** the new baseline of bench_gate.yaml::sim-8b::random-r2" in markdown


def test_the_history_is_the_latest_sessions_pooled(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    for run_id, session in (("a", "09:00:00"), ("b", "10:00:00"), ("c", "11:00:00")):
        tables.load_runs(db, [(record(run_id, session), requests_rows(0.1))])
    now = record("now", "12:00:00")
    baseline = Baseline(db)
    assert baseline.earlier_sessions(now) == 3
    assert [run.run_id for run in baseline.runs_for(now)] == ["c"]  # the gate's baseline
    assert sorted(run.run_id for run in baseline.runs_for(now, 2)) == ["b", "c"]
    assert Baseline(tmp_path / "none.db").runs_for(now, 5) == []


def test_a_new_baseline_slower_than_its_history_is_named(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    for index, (run_id, session) in enumerate((("a", "09:00:00"), ("b", "10:00:00"))):
        history = record(run_id, session)
        history["results"] = {"output_throughput": 100.0 + index}
        tables.load_runs(db, [(history, requests_rows(0.1))])
    new: list[tuple[dict[str, Any], list[dict[str, Any]] | None]] = []
    for repeat, throughput in enumerate((80.0, 81.0)):
        run = record(f"new{repeat}", "12:00:00")
        run["results"] = {"output_throughput": throughput}
        new.append((run, requests_rows(0.1)))
    new[-1][0]["regression"] = [{"metric": "output_throughput", "tolerance": 0.05}]
    (line,) = earlier.slower_than_history([db], new, True, SETTINGS)
    assert line.startswith(
        "the new baseline of bench_gate.yaml::sim-8b::random is regressed against its last 2 "
        f"session(s) in {db}: output_throughput -"
    )
    assert line.endswith("(tolerance 5%)")
    # As fast as its history: nothing to say.
    for run, _ in new:
        run["results"] = {"output_throughput": 100.5}
    assert earlier.slower_than_history([db], new, True, SETTINGS) == []
    ungated = earlier.ungated_history(db, [new[-1][0]], True)
    assert ungated == (
        f"1 of 1 gated case(s) have earlier sessions in {db} but were not compared (no "
        f"--profllm-baseline): gate them with --profllm-baseline {db}"
    )


@settings(max_examples=60, deadline=None)
@given(
    content=st.one_of(
        st.binary(max_size=2048),
        st.binary(max_size=2048).map(lambda tail: b"SQLite format 3\x00" + tail),
    )
)
def test_any_results_file_gives_a_warning_or_none(content: bytes) -> None:
    """results.db comes from outside (an old version, another tool, a truncated copy): the
    warnings read it or say nothing, never a traceback."""
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "results.db"
        db.write_bytes(content)
        run = record("now", "12:00:00")
        run["regression"] = [{"metric": "output_throughput", "tolerance": 0.05}]
        assert earlier.ungated_history(db, [run], True) is None
        assert earlier.slower_than_history([db], [(run, None)], True, SETTINGS) == []


@settings(max_examples=40, deadline=None)
@given(
    results=st.text(max_size=40),
    itl=st.text(max_size=40),
    ttft=st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=8)),
)
def test_any_history_rows_give_a_warning_or_none(
    results: str, itl: str, ttft: float | str | None
) -> None:
    """A results.db whose history rows hold anything (another tool wrote them)."""
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "results.db"
        tables.load_runs(db, [(record("a", "09:00:00"), requests_rows(0.1))])
        with closing(sqlite3.connect(db)) as connection, connection:
            connection.execute(f"UPDATE [{tables.RUNS}] SET results = ?", (results,))
            connection.execute(
                f"UPDATE [{tables.SAMPLES}] SET itl_ms = ?, ttft_ms = ?", (itl, ttft)
            )
        run = record("now", "12:00:00")
        run["regression"] = [{"metric": "p99_ttft_ms", "tolerance": 0.1}]
        lines = earlier.slower_than_history([db], [(run, requests_rows(0.1))], True, SETTINGS)
        assert all(line.count("\n") == 0 for line in lines)
