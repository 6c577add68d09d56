"""Every page of the plugin asks Datasette for the permissions Datasette's own pages ask: a
database private to root by Datasette's own `allow` block answers 403 to anyone else on every
route the plugin registers, uploads included; root gets through. The routes are listed
from the plugin's own `register_routes`, so a new route cannot escape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
from datasette.app import Datasette
from test_datasette import make_record

from pytest_profllm.browse import change_points, plugin, sql_functions
from pytest_profllm.browse.queries import canned_queries as canned_queries_for
from pytest_profllm.results.ingest import ingest

CASE = "bench_smoke.yaml::qwen3-8b::random"
PRIVATE = {
    "databases": {"results": {"allow": {"id": "root"}}},
    # alice may write (upload, presets) by the plugin's own rule, but not see the database.
    "plugins": {"pytest-profllm": {"upload": {"allow": {"id": ["alice"]}}}},
}
# A value for each URL part a route of ours names: a route with a part missing here fails
# the test, so that a new route is walked too.
SAMPLES = {"database": "results", "run_id": "r1", "file": "r1.json", "dashboard": "load",
           "page": "run", "rest": "r1/more"}
SECRET = "a-case-only-the-database-knows"


def results_db(folder: Path) -> Path:
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["case_id"] = SECRET
    (folder / "r1.json").write_text(json.dumps(record))
    db = folder / "results.db"
    ingest(db, [folder / "r1.json"])
    return db


def paths() -> list[str]:
    """One concrete path per route the plugin registers."""
    found = []
    for pattern, _ in plugin.register_routes():
        names = re.findall(r"\(\?P<(\w+)>", pattern)
        assert set(names) <= set(SAMPLES), f"no sample value for {names} of {pattern}"
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: SAMPLES[m.group(1)], pattern)
        found.append(path.removeprefix("^").removesuffix("$"))
    return found


def walk(db: Path, actor: dict[str, Any] | None, metadata: dict[str, Any]
         ) -> dict[tuple[str, str], httpx.Response]:
    """GET and POST (with a valid CSRF token and a record as body) on every route."""

    async def run() -> dict[tuple[str, str], httpx.Response]:
        datasette = Datasette([str(db)], metadata=metadata)
        await datasette.invoke_startup()
        root = {"ds_actor": datasette.sign({"a": {"id": "root"}}, "actor")}
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        form = await datasette.client.get("/results/-/upload", cookies=root)
        token = form.cookies.get("ds_csrftoken") or ""
        body = json.dumps(make_record("posted", "s2", CASE, "2026-01-02T10:00:00+00:00"))
        answers = {}
        for path in paths():
            answers[("GET", path)] = await datasette.client.get(path, cookies=cookies)
            answers[("POST", path)] = await datasette.client.post(
                path, content=body.encode(),
                headers={"x-csrftoken": token, "x-profllm-filename": "posted.json"},
                cookies={**cookies, "ds_csrftoken": token})
        answers[("GET", "/results/benchmark_runs")] = await datasette.client.get(
            "/results/benchmark_runs", cookies=cookies)
        return answers

    return asyncio.run(run())


def test_the_plugin_registers_the_routes_walked() -> None:
    # The walk below covers these; a route added to a module's ROUTES shows here too.
    assert len(paths()) == len(plugin.register_routes()) >= 9
    assert "/results/-/upload" in paths() and "/api/export/traces/r1" in paths()


def test_a_private_database_is_private_on_every_page(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    for actor in (None, {"id": "alice"}, {"id": "bob"}):
        answers = walk(db, actor, PRIVATE)
        # Datasette's own page refuses, and so does every page of ours, GET and POST.
        assert {key: r.status_code for key, r in answers.items()} == dict.fromkeys(
            answers, 403), actor
        for response in answers.values():
            assert SECRET not in response.text and b"SQLite format" not in response.content
    # Nothing was uploaded by those who may not see the database.
    assert not (tmp_path / "uploads").exists()


def test_root_gets_through_every_page(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    answers = walk(db, {"id": "root"}, PRIVATE)
    statuses = {key: r.status_code for key, r in answers.items()}
    assert all(status not in (401, 403) and status < 500 for status in statuses.values()), \
        statuses
    assert statuses[("GET", "/results/-/run/r1")] == 200
    assert SECRET in answers[("GET", "/results/-/run/r1")].text
    assert statuses[("GET", "/results/-/dashboards/load")] == 200
    assert answers[("POST", "/results/-/upload")].json()["outcome"] == "loaded"


def test_a_table_of_ours_hidden_hides_the_pages_that_show_it(tmp_path: Path) -> None:
    # The database is public, but one table the run page draws from is root's: as with
    # Datasette's own pages, the visitor sees none of it.
    db = results_db(tmp_path)
    hidden = {"databases": {"results": {"tables": {"request_samples": {
        "allow": {"id": "root"}}}}}}
    answers = walk(db, None, hidden)
    assert answers[("GET", "/results/-/run/r1")].status_code == 403
    assert answers[("GET", "/results/benchmark_runs")].status_code == 200
    assert walk(db, {"id": "root"}, hidden)[("GET", "/results/-/run/r1")].status_code == 200


def every_table_private(db: Path) -> dict[str, Any]:
    """Metadata with a root-only `allow` block on every table and view of `db`, and SQL
    for root only: the database itself stays public."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        names = [name for (name,) in connection.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
    return {"databases": {"results": {"allow_sql": {"id": "root"}, "tables": {
        name: {"allow": {"id": "root"}} for name in names}}}}


def queries_walk(db: Path, actor: dict[str, Any] | None, metadata: dict[str, Any]
                 ) -> tuple[list[str], dict[str, httpx.Response]]:
    """The canned queries root is offered, and each one's answer (HTML and JSON) to
    `actor`, with the database page's own list of queries and the SQL page."""

    async def run() -> tuple[list[str], dict[str, httpx.Response]]:
        datasette = Datasette([str(db)], metadata=metadata)
        await datasette.invoke_startup()
        root = {"ds_actor": datasette.sign({"a": {"id": "root"}}, "actor")}
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        names = [query["name"] for query in
                 (await datasette.client.get("/results.json", cookies=root)).json()["queries"]]
        answers = {}
        for name in names:
            for suffix in ("", ".json"):
                answers[f"/results/{name}{suffix}"] = await datasette.client.get(
                    f"/results/{name}{suffix}?run_a=r1&run_b=r1&case_id={SECRET}",
                    cookies=cookies)
        answers["/results.json"] = await datasette.client.get("/results.json",
                                                              cookies=cookies)
        answers["sql"] = await datasette.client.get(
            "/results.json?sql=select+case_id+from+benchmark_runs", cookies=cookies)
        return names, answers

    return asyncio.run(run())


def test_table_allow_blocks_guard_every_page_and_canned_query(tmp_path: Path) -> None:
    # The database is public, every table in it root's: a page or a canned query of ours
    # would show their rows (a canned query's SQL runs past a table's allow block).
    db = results_db(tmp_path)
    private = every_table_private(db)
    names, answers = queries_walk(db, None, private)
    assert {"latest_session", "best_configuration", "latest_per_configuration",
            "compare_sessions", "compare_runs", "not_passed", "case_history",
            "metric_change_points"} <= set(names)
    listed = answers.pop("/results.json")
    assert listed.status_code == 200 and listed.json()["queries"] == []
    assert {path: r.status_code for path, r in answers.items()} == dict.fromkeys(answers, 403)
    for response in answers.values():
        assert SECRET not in response.text and "r1" not in response.text
    routes = walk(db, None, private)
    assert {key: r.status_code for key, r in routes.items()} == dict.fromkeys(routes, 403)
    for response in routes.values():
        assert SECRET not in response.text
    # Root sees every query and every page.
    _, answers = queries_walk(db, {"id": "root"}, private)
    assert {path: r.status_code for path, r in answers.items()} == dict.fromkeys(answers, 200)
    assert SECRET in answers["/results/latest_session"].text
    statuses = {key: r.status_code for key, r in walk(db, {"id": "root"}, private).items()}
    assert all(status not in (401, 403) and status < 500 for status in statuses.values()), \
        statuses
    assert statuses[("GET", "/results/-/run/r1")] == 200
    assert statuses[("GET", "/results/-/dashboards/load")] == 200


def test_canned_queries_follow_the_tables_whose_rows_they_show(tmp_path: Path) -> None:
    # Only the run tables are root's: the queries over runs and the tables taken from them
    # are refused, the gate's change points and a run's requests (over public tables) stay
    # offered; the requests' query follows its own table where that is private too.
    db = results_db(tmp_path)
    requests_private = {"databases": {"results": {"allow_sql": {"id": "root"}, "tables": {
        "request_samples": {"allow": {"id": "root"}}}}}}
    _, answers = queries_walk(db, None, requests_private)
    assert answers["/results/run_requests"].status_code == 403
    private = {"databases": {"results": {"allow_sql": {"id": "root"}, "tables": {
        "benchmark_runs": {"allow": {"id": "root"}}, "runs": {"allow": {"id": "root"}}}}}}
    names, answers = queries_walk(db, None, private)
    offered = [query["name"] for query in answers.pop("/results.json").json()["queries"]]
    assert offered == ["metric_change_points", "run_requests"]
    for name in names:
        expected = 200 if name in offered else 403
        assert answers[f"/results/{name}"].status_code == expected, name
    derived = walk_tables(db, ["summary_best_points", "summary_latest_per_configuration",
                               "summary_not_passed", "measured_runs", "facet_counts",
                               "gate_runs"], private)
    assert derived == {"summary_best_points": 403, "summary_latest_per_configuration": 403,
                       "summary_not_passed": 403, "measured_runs": 403, "facet_counts": 403,
                       "gate_runs": 200}


def walk_tables(db: Path, tables: list[str], metadata: dict[str, Any]) -> dict[str, int]:
    async def run() -> dict[str, int]:
        datasette = Datasette([str(db)], metadata=metadata)
        await datasette.invoke_startup()
        return {table: (await datasette.client.get(f"/results/{table}")).status_code
                for table in tables}

    return asyncio.run(run())


def test_each_canned_query_names_every_table_it_reads(tmp_path: Path) -> None:
    # SQLite's authorizer lists what a statement reads as it is prepared: a query that
    # reads a table its TABLES_SHOWN does not name would skip that table's allow block.
    db = results_db(tmp_path)
    queries = {name: query["sql"] for has in ((True, True), (False, False))
               for name, query in canned_queries_for(*has).items()}
    queries["metric_change_points"] = change_points._QUERY
    read: set[str] = set()

    def note(action: int, table: str | None, *_: Any) -> int:
        if action == sqlite3.SQLITE_READ and table:
            read.add(table)
        return sqlite3.SQLITE_OK

    with contextlib.closing(sqlite3.connect(db)) as connection:
        sql_functions.register(connection)
        change_points.prepare_connection(connection)
        stored = {name for (name,) in connection.execute("SELECT name FROM sqlite_master")}
        for name, sql in queries.items():
            read.clear()
            connection.set_authorizer(note)
            connection.execute("EXPLAIN " + sql, dict.fromkeys(re.findall(r":(\w+)", sql)))
            connection.set_authorizer(None)
            read &= stored  # not the WITH clauses' names
            assert read and read <= {*plugin._QUERY_TABLES[name], *plugin._FOLLOW_RUNS}, name
