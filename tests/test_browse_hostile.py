"""The Datasette plugin touches only what is ours: redirects are built from a
database it serves, never from the raw path; another database's `runs` table and settings are
left alone; file names are quoted; a streamed CSV pages on the unique run id, whatever the
query string says."""

from __future__ import annotations

import asyncio
import html
import re
import sqlite3
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
from datasette.app import Datasette
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st


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
    (row, table, alone), datasette = _get([ours, other], "/other/runs/1", "/other/runs",
                                          "/other/runs.json")
    assert row.status_code == 200  # before: redirected to other/benchmark_runs/1, a 404
    assert "a run of something else" in row.text
    # Before: 500 "Cannot sort table by timestamp" (our landing table's order, given to it).
    assert (table.status_code, alone.status_code) == (200, 200)
    assert "a run of something else" in table.text
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


# The prepared pages on foreign databases, odd query strings and missing things.

CASE = "bench_smoke.yaml::qwen3-8b::random"


def _served(tmp_path: Path) -> list[Path]:
    """A results database with one run, and a foreign one with a `benchmark_runs` of its own."""
    from test_datasette import make_record

    from pytest_profllm.results.store import load_records

    ours = tmp_path / "results.db"
    load_records(ours, [make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")])
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE benchmark_runs (id INTEGER PRIMARY KEY, x TEXT)")
        db.execute("INSERT INTO benchmark_runs VALUES (1, 'a')")
    return [ours, foreign]


def _route_paths(database: str) -> list[str]:
    from test_browse_permissions import SAMPLES, paths

    return [p.replace("/" + SAMPLES["database"] + "/", f"/{database}/", 1) for p in paths()]


def _error_line(response: httpx.Response) -> str:
    """The one line of an error page (Datasette's error.html, red box)."""
    found = re.search(r'border: 3px solid red;">(.*?)</div>', response.text, re.S)
    assert found, response.text[:500]
    line = html.unescape(found.group(1)).strip()
    assert "\n" not in line
    return line


def test_a_foreign_benchmark_runs_gets_one_line_on_every_page(tmp_path: Path) -> None:
    # Before: 500s (no such column: run_id / session_id) on the run page and dashboards.
    served = _served(tmp_path)
    routes = [p for p in _route_paths("foreign") if "/foreign/" in p]
    responses, _ = _get(served, *routes)
    assert [r.status_code for r in responses] == [404] * len(routes)
    assert _error_line(responses[0]) == (
        "foreign is not a results database: its benchmark_runs table has no run_id, "
        "session_id, case_id, suite, timestamp, status column (not one pytest-profllm wrote)")


def test_a_long_query_string_is_refused_in_one_line(tmp_path: Path) -> None:
    # Before: a 500 (SQLite: LIKE or GLOB pattern too complex) for q of 50,000 characters.
    (response,), _ = _get(_served(tmp_path), "/results/-/dashboards/load?q=" + "x" * 50_000)
    assert response.status_code == 414
    assert _error_line(response) == ("The query string is 50,002 bytes, over the limit of "
                                     "16,384: choose fewer filters")


def test_a_missing_thing_is_a_404_and_at_most_one_line_of_log(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Before: /api/export/traces/x answered 500 where no trace existed, and every 404 of
    # ours printed Datasette's rich traceback (about 1,300 lines) into the server's log.
    served = _served(tmp_path)
    capfd.readouterr()
    responses, _ = _get(served, "/api/export/traces/x", "/api/export/traces/r1",
                        "/results/-/run/nope", "/results/-/run/r1/files/nope",
                        "/results/-/dashboards/nope", "/nope/-/run/r1")
    assert [r.status_code for r in responses] == [404] * len(responses)
    assert [_error_line(r) for r in responses] == [
        "No run 'x' in results",
        "Run r1 has no profiler trace in the results folder",
        "No run 'nope' in results",
        "No file 'nope' of run r1 in the results folder",
        "No dashboard named 'nope'",
        "No database named 'nope' is served",
    ]
    out, err = capfd.readouterr()
    assert len((out + err).splitlines()) <= len(responses)


_TEXT = (st.text(max_size=40)
         | st.sampled_from(["\x00", "r1\x00", "' OR 1=1 --", "]; DROP TABLE runs; --", "%",
                            "~2E~2E~2Fresults.db", "../results.db", "é" * 300, "☃🙂",
                            "9" * 400, "-1e309", "NaN"])
         # Long: a character repeated (long generated text is slow to make and shrink).
         | st.builds(lambda text, times: text * times, st.text(min_size=1, max_size=3),
                     st.integers(min_value=500, max_value=20_000)))
# A URL part our routes can receive: Datasette's router hands them no empty part and no "/"
# (those paths are Datasette's own pages, which 0.65 with `rich` installed answers "//-/x"
# with an exception of its own).
_PART = _TEXT.filter(lambda text: text != "" and "/" not in text)
_KEYS = st.sampled_from(["q", "session", "match", "blend", "min.request_throughput",
                         "max.p99_ttft_ms", "server_model", "status", "case_id", "metric",
                         "_sort", "x\x00"]) | st.text(max_size=20)


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.integers(min_value=0, max_value=50), database=st.sampled_from(
           ["results", "foreign", "nope"]) | _PART,
       parts=st.lists(_PART, min_size=3, max_size=3),
       pairs=st.lists(st.tuples(_KEYS, _TEXT), max_size=6), method=st.sampled_from(
           ["GET", "POST"]))
def test_any_path_and_query_string_gets_an_answer_not_a_500(
        tmp_path_factory: pytest.TempPathFactory, route: int, database: str,
        parts: list[str], pairs: list[tuple[str, str]], method: str) -> None:
    from test_browse_permissions import paths

    datasette, loop = _hostile_datasette(tmp_path_factory)
    patterns = paths()
    pattern = patterns[route % len(patterns)]
    # The sample values of the route's parts, each replaced by generated text.
    path = pattern.replace("/results/", "/" + urllib.parse.quote(database, safe="") + "/", 1)
    for sample, text in zip(("r1", "r1.json", "load"), parts, strict=True):
        path = path.replace("/" + sample, "/" + urllib.parse.quote(text, safe=""), 1)
    query = urllib.parse.urlencode(pairs)
    url = path + ("?" + query if query else "")
    assume(len(url) < 65_000)  # httpx's own limit on a URL
    started = time.monotonic()
    response = loop.run_until_complete(datasette.client.request(method, url,
                                                                cookies=_ROOT_COOKIES))
    assert response.status_code < 500, (path, query[:200], response.text[:300])
    assert time.monotonic() - started < 20  # seconds: generous, the host is loaded


_ROOT_COOKIES: dict[str, str] = {}
_HOSTILE: list[tuple[Datasette, asyncio.AbstractEventLoop]] = []


def _hostile_datasette(factory: pytest.TempPathFactory
                       ) -> tuple[Datasette, asyncio.AbstractEventLoop]:
    """One Datasette for every example (the test's own loop), serving ours and a foreign
    database, visited as root (who sees everything: the pages, not the permission check)."""
    if not _HOSTILE:
        served = _served(factory.mktemp("hostile"))
        datasette = Datasette([str(f) for f in served])
        loop = asyncio.new_event_loop()
        loop.run_until_complete(datasette.invoke_startup())
        _ROOT_COOKIES["ds_actor"] = datasette.sign({"a": {"id": "root"}}, "actor")
        _HOSTILE.append((datasette, loop))
    return _HOSTILE[0]
