"""`profllm check`: a whole database of this schema passes; each kind of damage (a row or a
file missing, other figures, a broken page, an older schema) is named with its runs; the
databases of earlier versions pass once migrated; what cannot be checked is one line."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest
from helpers import run_suites
from test_ingest import records_folder
from test_schema_version import FIXTURES, OLD_VERSIONS, old_database

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.results import store
from pytest_profllm.results.schema_version import SCHEMA_VERSION


def run_check(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, list[str], str]:
    status = cli_main(["check", *map(str, args)])
    captured = capsys.readouterr()
    return status, captured.out.splitlines(), captured.err


@pytest.fixture
def loaded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    """A database of three runs, and the folder of their records."""
    folder = records_folder(tmp_path, "run-a", "run-b", "run-c")
    db = tmp_path / "results.db"
    assert cli_main(["ingest", str(db), str(folder)]) == 0
    capsys.readouterr()
    return db, folder


def test_a_whole_database_passes(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, folder = loaded
    assert run_check(capsys, db) == (
        0,
        [f"{db}: schema version {SCHEMA_VERSION}, 13 table(s), 3 run(s): ok"],
        "",
    )
    assert run_check(capsys, db, "--records", folder) == (
        0,
        [f"{db}: schema version {SCHEMA_VERSION}, 13 table(s), 3 run(s), 3 record file(s): ok"],
        "",
    )


def test_each_problem_names_its_run(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, folder = loaded
    with sqlite3.connect(db) as connection:
        connection.execute("DELETE FROM gate_runs WHERE run_id = 'run-a'")
        connection.execute(
            "UPDATE benchmark_runs SET output_throughput = 99 WHERE run_id = 'run-b'"
        )
        connection.execute("DELETE FROM request_samples WHERE run_id = 'run-c'")
    status, out, err = run_check(capsys, db, "--records", folder)
    assert (status, err) == (1, "")
    assert out[:-1] == [
        "run run-a: no row in gate_runs",
        "run run-b: figures differ: output_throughput 99.0 stored, 6.5 recorded "
        "(record run-b.json)",
        "run run-c: 0 request sample(s) stored, its request file has 1",
    ]
    assert out[-1].endswith("3 problem(s) in 3 run(s): run-a, run-b, run-c")


def test_a_row_without_its_file_and_a_file_without_its_row(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, folder = loaded
    (folder / "run-a.json").unlink()
    records_folder(folder.parent, "run-d")  # a record no load has seen
    status, out, _ = run_check(capsys, db, "--records", folder)
    assert status == 1
    assert out[:-1] == [
        "run run-d: its record run-d.json has no row in benchmark_runs",
        f"run run-a: no record file in {folder}",
    ]
    assert out[-1].endswith("2 problem(s) in 2 run(s): run-a, run-d")


def test_another_fingerprint_is_a_problem(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, folder = loaded
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE gate_runs SET fingerprint = 'x' WHERE run_id = 'run-b'")
    status, out, _ = run_check(capsys, db, "--records", folder)
    assert status == 1
    assert out[0] == "run run-b: fingerprint differs from its record's (record run-b.json)"


def test_a_missing_table_and_an_older_schema_are_problems(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, _ = loaded
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TABLE run_series")
        connection.execute("PRAGMA user_version = 3")
    status, out, _ = run_check(capsys, db)
    assert status == 1
    assert out[:-1] == [
        f"schema version 3, not this plugin's {SCHEMA_VERSION}: the next load (a session, "
        "profllm ingest) migrates it",
        "table run_series is missing",
    ]
    store.migrate(db)
    assert run_check(capsys, db)[0] == 0


def test_a_broken_page_fails_the_integrity_check(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    db, _ = loaded
    with sqlite3.connect(db) as connection:
        connection.execute("PRAGMA journal_mode = DELETE")
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        root = connection.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'gate_runs'"
        ).fetchone()[0]
    with db.open("r+b") as handle:  # the table's root page: a b-tree page no more
        handle.seek((root - 1) * page_size)
        handle.write(b"\x0d" + b"\xff" * 64)
    status, out, _ = run_check(capsys, db)
    assert status == 1
    assert any(line.startswith("integrity: ") for line in out)


@pytest.mark.parametrize("name", OLD_VERSIONS)
def test_a_database_of_an_earlier_version_passes_once_migrated(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = old_database(name, tmp_path)
    records = FIXTURES / name / "records"
    assert run_check(capsys, db, "--records", records)[0] == 1  # its schema, its tables
    store.migrate(db)
    status, out, _ = run_check(capsys, db, "--records", records)
    assert (status, out) == (
        0,
        [f"{db}: schema version {SCHEMA_VERSION}, 13 table(s), 3 run(s), 3 record file(s): ok"],
    )


def test_what_cannot_be_checked_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.db"
    assert run_check(capsys, missing) == (2, [], f"profllm check: {missing}: no such database\n")
    text = tmp_path / "notes.db"
    text.write_text("not a database, but long enough to have a header of sorts " * 10)
    assert run_check(capsys, text) == (2, [], f"profllm check: {text}: file is not a database\n")
    db = tmp_path / "results.db"
    db.touch()
    assert run_check(capsys, db, "--records", tmp_path / "nowhere") == (
        2,
        [],
        f"profllm check: --records {tmp_path / 'nowhere'}: no such folder\n",
    )
    with sqlite3.connect(db) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    assert run_check(capsys, db) == (
        2,
        [],
        f"profllm check: {db}: schema version {SCHEMA_VERSION + 1} is newer than this "
        f"plugin's {SCHEMA_VERSION}: upgrade pytest-profllm to read or write it\n",
    )


_KILL_AT_LOAD = """
import os, signal
from pytest_profllm.results import store

if os.environ.get("PROFLLM_TEST_KILL_AT_LOAD"):
    _add = store.Load.add

    def add(self, staged, positions=None):
        _add(self, staged, positions)
        # Mid-write: the rows are in the transaction, not yet committed.
        os.kill(os.getpid(), signal.SIGKILL)

    store.Load.add = add
"""

_SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [4, 16]
  max_model_len: 2048
benchmark:
  num_prompts: 10
  random_input_len: 50
  random_output_len: 5
"""


def test_a_session_killed_mid_write_is_named_by_check_and_restored_by_rebuild(
    pytester: pytest.Pytester,
    ports: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytester.makeconftest(_KILL_AT_LOAD)
    pytester.makefile(".yaml", bench_k=_SUITE)
    args = ("--profllm-engine", "sim", "--profllm-sim-clock", "virtual")
    run_suites(pytester, ports, *args, cache=False).assert_outcomes(passed=2)
    out = pytester.path / "results"
    db = out / "results.db"
    first = {path.stem for path in out.glob("*.json")}
    monkeypatch.setenv("PROFLLM_TEST_KILL_AT_LOAD", "1")
    killed = run_suites(pytester, ports, *args, cache=False)
    assert killed.ret == -signal.SIGKILL
    lost = sorted({path.stem for path in out.glob("*.json")} - first)
    assert len(lost) == 2
    capsys.readouterr()
    status, lines, _ = run_check(capsys, db, "--records", out)
    assert status == 1
    assert lines[:-1] == [
        f"run {run_id}: its record {run_id}.json has no row in benchmark_runs" for run_id in lost
    ]
    assert lines[-1].endswith(f"2 problem(s) in 2 run(s): {', '.join(lost)}")
    rebuilt = pytester.path / "rebuilt.db"
    assert cli_main(["rebuild", str(out), "-o", str(rebuilt)]) == 0
    capsys.readouterr()
    assert run_check(capsys, rebuilt, "--records", out)[:2] == (
        0,
        [
            f"{rebuilt}: schema version {SCHEMA_VERSION}, 13 table(s), 4 run(s), "
            "4 record file(s): ok"
        ],
    )


@pytest.mark.parametrize(
    ("field", "to", "line"),
    [
        ("status", "failed", "status 'passed' stored, 'failed' recorded"),
        ("validity", "invalid", "validity 'valid' stored, 'invalid' recorded"),
    ],
)
def test_a_record_edited_to_another_status_or_validity_is_a_problem(
    loaded: tuple[Path, Path], capsys: pytest.CaptureFixture[str], field: str, to: str,
    line: str,
) -> None:
    # Before: every figure was the same, so check said ok while the row said passed, valid.
    db, folder = loaded
    path = folder / "run-b.json"
    record = json.loads(path.read_text())
    assert record[field] != to
    record[field] = to
    if field == "validity":
        record["validity_reasons"] = ["edited"]
    path.write_text(json.dumps(record))
    status, out, _ = run_check(capsys, db, "--records", folder)
    assert status == 1
    assert out[:-1] == [f"run run-b: {line} (record run-b.json)"]
    assert out[-1].endswith("1 problem(s) in 1 run(s): run-b")
