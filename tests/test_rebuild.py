"""`profllm rebuild`: the records are the source of truth. A database rebuilt from a session's
records equals the session's own, table for table, row for row and column for column; any
record ingest accepts comes back out of a rebuild as it went in; what cannot be rebuilt is
one line."""

from __future__ import annotations

import os
import sqlite3
import string
from pathlib import Path
from typing import Any

import pytest
from helpers import run_suites
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ingest import records_folder
from test_store import make_record

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.results.check import check
from pytest_profllm.results.ingest import read_record
from pytest_profllm.results.rebuild import RebuildError, rebuild
from pytest_profllm.results.record_files import write_record, write_requests
from pytest_profllm.results.rows import record_row
from pytest_profllm.results.table import TABLE

SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [4, 16]
  max_model_len: 2048
benchmark:
  num_prompts: 20
  random_input_len: 100
  random_output_len: 10
  request_rate: [10, inf]
thresholds:
  completed: {min: 20}
"""


# What is by definition of the load, not of the records: the first value of a swept axis that
# the load saw (a session loads its records in the order they finished, a rebuild by name).
LOAD_DEFINED = {("benchmark_axes", "first_value")}


def tables(db: Path) -> dict[str, list[tuple[tuple[str, Any], ...]]]:
    """Every table's rows, each row as its (column, value) pairs in column-name order, the
    rows sorted: equal for two databases that hold the same, whatever order they were
    written in."""
    found = {}
    with sqlite3.connect(db) as connection:
        names = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        for name in names:
            cursor = connection.execute(f"SELECT * FROM [{name}]")
            columns = [d[0] for d in cursor.description]
            kept = [at for at, column in enumerate(columns) if (name, column) not in LOAD_DEFINED]
            found[name] = sorted(
                (tuple(sorted((columns[at], row[at]) for at in kept)) for row in cursor), key=repr
            )
    return found


def test_a_sessions_database_rebuilt_from_its_records_is_the_same(
    pytester: pytest.Pytester, ports: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makefile(".yaml", bench_r=SUITE)
    result = run_suites(
        pytester, ports, "--profllm-engine", "sim", "--profllm-sim-clock", "virtual", cache=False
    )
    result.assert_outcomes(passed=4)
    capsys.readouterr()
    out = pytester.path / "results"
    rebuilt = pytester.path / "rebuilt.db"
    assert cli_main(["rebuild", str(out), "-o", str(rebuilt)]) == 0
    assert capsys.readouterr().out == (
        f"{rebuilt} (table benchmark_runs): 4 new, 0 unchanged, 0 refused\n"
    )
    original, again = tables(out / "results.db"), tables(rebuilt)
    assert set(original) == set(again)
    assert len(original[TABLE]) == 4
    assert [name for name in original if again[name] != original[name]] == []
    assert not check(rebuilt, out).problems


_NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12).map(lambda s: "x" + s)
_VALUES = st.one_of(
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 9), max_size=3),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    server=st.dictionaries(_NAMES, _VALUES, max_size=4),
    figures=st.dictionaries(
        st.sampled_from(
            ["median_ttft_ms", "p99_tpot_ms", "output_throughput", "request_throughput"]
        ),
        st.floats(0, 1e12, allow_nan=False),
        max_size=4,
    ),
    status=st.sampled_from(["passed", "failed", "error"]),
    samples=st.integers(0, 3),
)
def test_any_record_ingest_accepts_survives_rebuild_unchanged(
    tmp_path_factory: pytest.TempPathFactory,
    server: dict[str, Any],
    figures: dict[str, float],
    status: str,
    samples: int,
) -> None:
    folder = tmp_path_factory.mktemp("records")
    record = make_record("run-x", status=status, server={"model": "Qwen/Qwen3-8B", **server})
    record["results"].update(figures)
    path = write_record(folder, record)
    write_requests(
        folder,
        "run-x",
        [
            {
                "index": at,
                "success": True,
                "ttft_s": 0.01,
                "latency_s": 0.1 * (at + 1),
                "output_tokens": 5,
                "itl_s": [0.02] * 4,
            }
            for at in range(samples)
        ],
    )
    try:
        accepted = read_record(path)
    except ValueError:
        return  # not a record ingest accepts
    db = folder / "rebuilt.db"
    report = rebuild(folder, db)
    assert (report.load.new, report.refused) == (1, [])
    with sqlite3.connect(db) as connection:
        cursor = connection.execute(f"SELECT * FROM [{TABLE}]")
        columns = [d[0] for d in cursor.description]
        (row,) = [dict(zip(columns, values, strict=True)) for values in cursor]
        stored_samples = connection.execute("SELECT count(*) FROM request_samples").fetchone()
    expected = record_row(accepted)
    expected.pop("record_digest")  # of the file's bytes (the row built here has none)
    assert {name: row[name] for name in expected} == expected
    assert stored_samples == (samples,)
    assert not check(db, folder).problems


def test_what_cannot_be_rebuilt_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a")
    db = tmp_path / "results.db"
    db.touch()
    for args, line in [
        (
            [str(folder), "-o", str(db)],
            f"{db}: exists; rebuild writes a new database: name "
            "another file, or move this one away first",
        ),
        (
            [str(tmp_path / "none"), "-o", str(tmp_path / "new.db")],
            f"{tmp_path / 'none'}: no such folder",
        ),
        (
            [str(tmp_path / "empty"), "-o", str(tmp_path / "new.db")],
            f"{tmp_path / 'empty'}: no record files (*.json) there",
        ),
    ]:
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert cli_main(["rebuild", *args]) == 2
        assert capsys.readouterr().err == f"profllm rebuild: {line}\n"
    assert not (tmp_path / "new.db").exists()


def test_bad_files_are_refused_and_the_rest_rebuilt(tmp_path: Path) -> None:
    folder = records_folder(tmp_path, "run-a")
    (folder / "broken.json").write_text("{")
    report = rebuild(folder, tmp_path / "new.db")
    assert report.load.new == 1 and [path.name for path, _ in report.refused] == ["broken.json"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.json").write_text("{")
    with pytest.raises(RebuildError, match="none of its 1 file"):
        rebuild(tmp_path / "bad", tmp_path / "other.db")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad", "new.db", "records"]


def test_a_fifo_or_a_device_among_the_records_is_refused_and_never_hangs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the FIFO hung the rebuild for good, and /dev/zero ended in MemoryError.
    folder = records_folder(tmp_path, "run-a")
    os.mkfifo(folder / "fifo.json")
    (folder / "zero.json").symlink_to("/dev/zero")
    assert cli_main(["rebuild", str(folder), "-o", str(tmp_path / "new.db")]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"profllm rebuild: refused {folder / 'fifo.json'}: a FIFO, not a regular file: only "
        "regular files are read",
        f"profllm rebuild: refused {folder / 'zero.json'}: a link to a character device "
        "(/dev/zero), not a regular file: only regular files are read",
    ]
    assert captured.out.endswith(": 1 new, 0 unchanged, 2 refused\n")
    # Nothing but them: each refusal is still said, above the one line of the refusal.
    (folder / "run-a.json").unlink()
    assert cli_main(["rebuild", str(folder), "-o", str(tmp_path / "other.db")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[-1] == (
        f"profllm rebuild: {folder}: none of its 2 file(s) is a record: nothing written"
    )
