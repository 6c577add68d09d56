"""The Datasette plugin touches only what is ours (issue 22): redirects are built from a
database it serves, never from the raw path; another database's `runs` table and settings are
left alone; file names are quoted; a streamed CSV pages on the unique run id, whatever the
query string says."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx
import pytest
from datasette.app import Datasette


def _results_db(path: Path, rows: int = 2000) -> Path:
    # The plugin's tables are ours by `benchmark_runs`; timestamps tie in runs of 200.
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE benchmark_runs (run_id TEXT PRIMARY KEY, timestamp TEXT, "
                   "status TEXT)")
        db.executemany(
            "INSERT INTO benchmark_runs VALUES (?, ?, 'passed')",
            [(f"run-{n:05d}", f"2026-01-01T00:00:{n // 200:02d}+00:00") for n in range(rows)],
        )
    return path


def _other_db(path: Path) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO runs VALUES (1, 'a run of something else')")
    return path


def _get(files: list[Path], *paths: str) -> tuple[list[httpx.Response], Datasette]:
    datasette = Datasette([str(f) for f in files])

    async def run() -> list[httpx.Response]:
        await datasette.invoke_startup()
        return [await datasette.client.get(path) for path in paths]

    return asyncio.run(run()), datasette


def test_no_redirect_leaves_the_host(tmp_path: Path) -> None:
    db = _results_db(tmp_path / "results.db", rows=3)
    (evil, crlf, ours), _ = _get(
        [db], "/%5Cevil.com/runs/x", "/results/runs/a%0d%0aSet-Cookie:x", "/results/runs/run-00001"
    )
    # Before: a 302 to /\\evil.com/..., which browsers follow off-site. Now Datasette's own
    # redirect to the tilde-encoded path on this host, or nothing.
    location = evil.headers.get("location", "/")
    assert location.startswith("/") and location[1:2] not in ("/", "\\")
    # Before: a traceback (a line break in a header).
    assert crlf.status_code == 302
    assert "\r" not in crlf.headers["location"] and "\n" not in crlf.headers["location"]
    assert crlf.headers["location"].startswith("/results/-/run/")
    assert (ours.status_code, ours.headers["location"]) == (
        302, "/results/-/run/run-00001"
    )


def test_another_databases_runs_table_is_left_alone(tmp_path: Path) -> None:
    ours, other = _results_db(tmp_path / "results.db", rows=3), _other_db(tmp_path / "other.db")
    (row,), datasette = _get([ours, other], "/other/runs/1")
    assert row.status_code == 200  # before: redirected to other/benchmark_runs/1, a 404
    assert "a run of something else" in row.text
    # A server that serves more than our databases keeps Datasette's CSV limit.
    assert datasette.setting("max_csv_mb") == 100


def test_a_file_name_with_a_hash_is_quoted(tmp_path: Path) -> None:
    # The plugin's own read-only look at a database (its schema, for metadata). Datasette
    # 0.65 itself opens `file:{path}` unquoted too: that one is Datasette's to fix.
    from types import SimpleNamespace

    from pytest_profllm.browse.plugin import _schema

    db = _results_db(tmp_path / "re#s.db", rows=3)
    datasette = SimpleNamespace(databases={"re#s": SimpleNamespace(path=str(db))})
    schema = _schema(datasette, "re#s")
    assert not (tmp_path / "re").exists()  # before: SQLite opened (and made) `re`
    assert schema is not None and "run_id" in schema.columns


@pytest.mark.parametrize("query", ["", "?_stream=on", "?_stream=on&_sort=timestamp",
                                   "?_sort_desc=timestamp&_stream=1"])
def test_a_streamed_csv_has_every_row_once(tmp_path: Path, query: str) -> None:
    db = _results_db(tmp_path / "results.db")
    (csv,), _ = _get([db], f"/results/benchmark_runs.csv{query}")
    assert csv.status_code == 200
    run_ids = [line.split(",")[0] for line in csv.text.splitlines()[1:] if line]
    # Before, with _stream=on in the URL: 2,199 rows for 2,000, some twice, others lost.
    assert len(run_ids) == 2000
    assert len(set(run_ids)) == 2000
