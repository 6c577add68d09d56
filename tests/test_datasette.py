"""The Datasette plugin, in-process: metadata (facets), canned queries and chart links on a
results.db made by `load_records`, and nothing of it on a database without our table."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import html
import io
import json
import re
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
from datasette.app import Datasette
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.browse import filters, sql_functions
from pytest_profllm.browse.dashboards import BY_NAME, DASHBOARDS
from pytest_profllm.browse.queries import CANNED_QUERIES, REQUEST_QUERIES, canned_queries
from pytest_profllm.plan import metric_names
from pytest_profllm.results import gate_tables
from pytest_profllm.results.ingest import ingest
from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.record import BenchmarkRecord
from pytest_profllm.results.store import load_records
from pytest_profllm.results.table import TABLE

CASE_A = "bench_smoke.yaml::qwen3-8b-seqs8::random"
CASE_B = "bench_smoke.yaml::qwen3-8b-seqs16::random"


def make_record(
    run_id: str,
    session_id: str,
    case_id: str,
    timestamp: str,
    status: str = "passed",
    *,
    throughput: float = 10.0,
    missed: tuple[str, ...] = (),
    latency_metrics: tuple[str, ...] = metric_names.LATENCY_METRICS,
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0),
    max_num_seqs: int = 8,
    request_rate: float | str = 4.0,
    p99_ttft: float = 1.0,
) -> dict[str, Any]:
    results: dict[str, float | int | None] = {
        name: 1.0 for name in metric_names.result_names(latency_metrics, percentiles)
    }
    # A measurement: every request completed (a failed one makes the run no data point).
    results.update(completed=10, failed=0, completed_requests=10, failed_requests=0)
    results["request_throughput"] = throughput
    results["output_throughput"] = throughput * 10
    if "p99_ttft_ms" in results:
        results["p99_ttft_ms"] = p99_ttft
    return BenchmarkRecord.model_validate({
        "run_id": run_id,
        "session_id": session_id,
        "suite": "smoke",
        "source": "benchmarks/bench_smoke.yaml",
        "case_id": case_id,
        "nodeid": f"benchmarks/{case_id}",
        "timestamp": timestamp,
        "duration": 5.0,
        "status": status,
        "message": None if status == "passed" else f"{status} here",
        "engine": {"name": "sim", "reason": "test", "version": "0.1.0"},
        "config": {"server": {"model": "Qwen/Qwen3-8B", "max_num_seqs": max_num_seqs},
                   "benchmark": {"num_prompts": 10, "request_rate": request_rate}},
        "results": results,
        "system": {"host": "box", "platform": "Linux", "python": "3.11"},
        "runtime": {"worker": "main", "server_key": "0123456789ab"},
        "threshold_results": [
            {"metric": name, "bound": "min", "limit": 100.0, "value": 1.0, "passed": False}
            for name in missed
        ],
    }).model_dump(mode="json")


# Two sessions of two cases; the second session is the latest.
RECORDS = [
    make_record("s1-a", "s1", CASE_A, "2026-01-01T10:00:00+00:00", throughput=11.0),
    make_record("s1-b", "s1", CASE_B, "2026-01-01T10:05:00+00:00", "failed", throughput=12.0,
                missed=("output_throughput", "request_throughput")),
    make_record("s2-a", "s2", CASE_A, "2026-01-02T10:00:00+00:00", throughput=21.0),
    make_record("s2-b", "s2", CASE_B, "2026-01-02T10:05:00+00:00", "error", throughput=22.0),
]


def get(db_paths: list[Path], *urls: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        datasette = Datasette([str(path) for path in db_paths])
        await datasette.invoke_startup()
        return [await datasette.client.get(url) for url in urls]

    return asyncio.run(run())


@pytest.fixture
def results_db(tmp_path: Path) -> Path:
    db_path = tmp_path / "results.db"
    assert load_records(db_path, RECORDS) == len(RECORDS)
    return db_path


@pytest.fixture
def other_db(tmp_path: Path) -> Path:
    db_path = tmp_path / "other.db"
    with sqlite3.connect(db_path) as connection:
        connection.execute("create table notes (id integer primary key, text text)")
        connection.execute("insert into notes (text) values ('hello')")
    return db_path


def dashboard_links(page: str) -> dict[str, str]:
    links = re.findall(r'<a href="([^"]+)">Dashboard: ([^<]*)</a>', page)
    return {html.unescape(label): html.unescape(href) for href, label in links}


def test_table_json_answers_with_the_rows(results_db: Path) -> None:
    (response,) = get([results_db], f"/results/{TABLE}.json?_shape=objects")
    assert response.status_code == 200
    rows = response.json()["rows"]
    assert {row["run_id"] for row in rows} == {record["run_id"] for record in RECORDS}
    # The metadata sorts newest first.
    assert [row["run_id"] for row in rows] == ["s2-b", "s2-a", "s1-b", "s1-a"]


def test_plugin_is_registered_with_its_hooks(results_db: Path) -> None:
    (response,) = get([results_db], "/-/plugins.json")
    assert response.status_code == 200
    ours = [plugin for plugin in response.json() if plugin["name"] == "pytest-profllm"]
    # Two modules: the results' hooks, and the regression gate's (its change-point aggregate
    # and canned query).
    assert len(ours) == 2
    # The package is the entry point, so Datasette serves its templates/ and static/.
    assert any(plugin["static"] and plugin["templates"] for plugin in ours)
    assert set().union(*(plugin["hooks"] for plugin in ours)) >= {
        "asgi_wrapper",
        "get_metadata",
        "canned_queries",
        "table_actions",
        "database_actions",
        "startup",
        "prepare_connection",
        "extra_css_urls",
        "register_routes",
    }


def test_our_table_gets_no_facet_suggestions_other_tables_do(
    results_db: Path, tmp_path: Path
) -> None:
    other_db = tmp_path / "other.db"
    with sqlite3.connect(other_db) as connection:
        connection.execute("create table notes (id integer primary key, kind text)")
        connection.executemany(
            "insert into notes (kind) values (?)", [("a",), ("b",), ("a",), ("b",), ("a",)]
        )
    ours, other = get([results_db, other_db], f"/results/{TABLE}.json", "/other/notes.json")
    assert ours.json()["suggested_facets"] == []
    assert other.json()["suggested_facets"]
    # Asked-for facets still work on our table.
    (faceted,) = get([results_db], f"/results/{TABLE}.json?_facet=case_id")
    assert "case_id" in faceted.json()["facet_results"]


def test_table_has_the_default_facets(results_db: Path) -> None:
    data, page = get([results_db], f"/results/{TABLE}.json", f"/results/{TABLE}")
    facets = data.json()["facet_results"]
    assert {"suite", "engine", "status"} <= set(facets)
    counts = {item["value"]: item["count"] for item in facets["status"]["results"]}
    assert counts == {"passed": 2, "failed": 1, "error": 1}
    assert page.status_code == 200
    for column in ("suite", "engine", "status"):
        assert f'id="facet-{column}"' in page.text


def test_every_facet_of_both_tables_is_counted_from_an_index(tmp_path: Path) -> None:
    # An unindexed facet reads every wide row: the full table page took 0.8 s at 100,000
    # runs for two of them (bench_kind, runtime_node_id).
    db_path = tmp_path / "results.db"
    records = [dict(record, config=dict(record["config"], benchmark={
        **record["config"]["benchmark"], "kind": "serve"}), runtime={
        **record["runtime"], "node_id": "n1"}) for record in RECORDS]
    load_records(db_path, records)
    data, landing = get([db_path], f"/results/{TABLE}.json", f"/results/{LANDING}.json")
    faceted = {TABLE: set(data.json()["facet_results"]),
               LANDING: set(landing.json()["facet_results"])}
    assert {"bench_kind", "runtime_node_id", "suite"} <= faceted[TABLE]
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        for table, columns in faceted.items():
            for column in columns:
                plan = " ".join(str(row[-1]) for row in connection.execute(
                    f"EXPLAIN QUERY PLAN SELECT [{column}], count(*) FROM [{table}] "
                    f"GROUP BY [{column}]"))
                assert "COVERING INDEX" in plan, (table, column, plan)


def test_table_and_landing_pages_link_to_the_dashboards(results_db: Path) -> None:
    for page_url in (f"/results/{TABLE}", f"/results/{LANDING}", "/results"):
        (page,) = get([results_db], page_url)
        links = dashboard_links(page.text)
        assert links == {d.title: f"/results/-/dashboards/{d.name}" for d in DASHBOARDS}, (
            page_url)
    responses = get([results_db], *links.values())
    assert [response.status_code for response in responses] == [200] * len(DASHBOARDS)


def test_dashboard_links_follow_the_database_name(tmp_path: Path) -> None:
    db_path = tmp_path / "nightly.db"
    load_records(db_path, RECORDS)
    (page,) = get([db_path], f"/nightly/{TABLE}")
    links = dashboard_links(page.text)
    assert links and all(href.startswith("/nightly/-/dashboards/") for href in links.values())


def rows_of(db_path: Path, url: str) -> list[dict[str, Any]]:
    (response,) = get([db_path], url)
    assert response.status_code == 200, response.text[:500]
    rows: list[dict[str, Any]] = response.json()
    return rows


def points_of(db_path: Path, name: str, query: str = "", **args: str) -> list[dict[str, Any]]:
    """The points a dashboard draws, in its output-throughput charts (or its one chart)."""
    connection = sqlite3.connect(db_path)
    sql_functions.register(connection)
    try:
        schema = filters.read_schema(connection)
        selection = filters.Selection.parse(parse_qsl(query), schema)
        view = BY_NAME[name].build(connection, schema, selection, args)
    finally:
        connection.close()
    return [row for chart_id, chart in view.charts.items()
            if len(view.charts) == 1 or chart_id.endswith("output_throughput")
            for row in chart["data"]["values"]]


def test_charts_over_two_sessions_of_a_case_show_per_run_values_not_their_sum(
    results_db: Path,
) -> None:
    # Case A ran in session s1 at 11 req/s and in s2 at 21 req/s: no chart may show 32.
    history = points_of(results_db, "history", case_id=CASE_A)
    assert [(row["session"], row["value"]) for row in history] == [("s1", 110.0), ("s2", 210.0)]
    # Case B's run of s2 is an `error`: its figures are no data point.
    latest = points_of(results_db, "load")
    assert {(row["session"], row["workload"], row["output_throughput"]) for row in latest} == {
        ("s2", CASE_A.rsplit("::", 1)[1], 210.0)}
    # Both sessions, drawn apart: one point per configuration, load and session.
    both = points_of(results_db, "load", "session=all")
    assert sorted((row["session"], row["output_throughput"]) for row in both) == [
        ("s1", 110.0), ("s1", 120.0), ("s2", 210.0)]


def test_the_root_opens_on_the_landing_view(results_db: Path, other_db: Path) -> None:
    root, landing = get([results_db], "/", f"/results/{LANDING}.json?_shape=objects")
    assert root.status_code == 302
    assert root.headers["location"] == f"/results/{LANDING}"
    data = landing.json()
    assert len(data["columns"]) <= 30
    assert data["columns"][:3] == ["run_id", "status", "gate"]
    # Newest first, rounded figures, units in the names.
    assert [row["run_id"] for row in data["rows"]] == ["s2-b", "s2-a", "s1-b", "s1-a"]
    assert data["rows"][0]["req_per_s"] == 22.0
    assert {"output_tok_per_s", "median_ttft_ms", "p99_tpot_ms"} <= set(data["columns"])
    # With another results database beside it, the root is Datasette's own index.
    second = other_db.with_name("second.db")
    load_records(second, RECORDS[:1])
    (root,) = get([results_db, second], "/")
    assert root.status_code == 200


def test_the_menus_dashboards_link_leads_to_our_dashboards(results_db: Path) -> None:
    # datasette-dashboards puts "Dashboards" in the menu, to its own page: with no YAML
    # dashboards configured it said "No dashboards found".
    database, menu, index = get([results_db], "/results", "/-/dashboards",
                                "/results/-/dashboards")
    assert 'href="/-/dashboards"' in database.text
    assert (menu.status_code, menu.headers["location"]) == (302, "/results/-/dashboards")
    assert index.status_code == 200 and "Latest session" in index.text
    # With two results databases the menu's link leads to the index that lists both (each
    # database's page links its dashboards). Before: "No dashboards found".
    second = results_db.with_name("second.db")
    load_records(second, RECORDS[:1])
    menu, listing = get([results_db, second], "/-/dashboards", "/")
    assert (menu.status_code, menu.headers["location"]) == (302, "/")
    assert listing.status_code == 200
    assert 'href="/results"' in listing.text and 'href="/second"' in listing.text


def test_the_landing_view_shows_the_swept_axes_with_facets(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    records = [make_record(f"r{i}", "s1", CASE_A, f"2026-01-01T10:0{i}:00+00:00",
                           max_num_seqs=seqs)
               for i, seqs in enumerate((8, 16, 16))]
    load_records(db_path, records)
    data, page, faceted = get(
        [db_path], f"/results/{LANDING}.json", f"/results/{LANDING}",
        f"/results/{LANDING}.json?server_max_num_seqs=16")
    assert "server_max_num_seqs" in data.json()["columns"]
    # The verdicts, then the axes, then the headline metrics: all on the first screen.
    columns = data.json()["columns"]
    assert columns[:4] == ["run_id", "status", "gate", "validity"]
    assert columns.index("output_tok_per_s") < columns.index("server_max_num_seqs") < 20
    facets = data.json()["facet_results"]
    # The gate's verdict and the axes; a column with one value in every row is no facet.
    assert {"gate", "server_max_num_seqs"} <= set(facets)
    assert not {"engine", "device", "suite", "server_model"} & set(facets)
    counts = {item["value"]: item["count"] for item in facets["server_max_num_seqs"]["results"]}
    assert counts == {8: 1, 16: 2}
    assert faceted.json()["filtered_table_rows_count"] == 2
    # The run id opens the run's page.
    assert f'<a href="/results/{LANDING}/r0">r0</a>' in page.text
    (row,) = get([db_path], f"/results/{LANDING}/r0")
    assert (row.status_code, row.headers["location"]) == (302, "/results/-/run/r0")


def test_csv_exports_every_row(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    records = [make_record(f"r{i:03d}", "s1", CASE_A, f"2026-01-01T10:00:{i % 60:02d}+00:00")
               for i in range(250)]
    load_records(db_path, records)
    table, landing, filtered = get(
        [db_path], f"/results/{TABLE}.csv", f"/results/{LANDING}.csv",
        f"/results/{LANDING}.csv?status=passed&_size=10")
    for response in (table, landing, filtered):
        assert response.status_code == 200
        rows = list(csv.reader(io.StringIO(response.text)))
        assert len(rows) == 251, len(rows)
        assert len({row[0] for row in rows[1:]}) == 250
    assert "server_max_num_seqs" in next(csv.reader(io.StringIO(table.text)))


def test_infinity_is_a_number_in_sql_null_in_json_inf_in_csv(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        make_record("r-inf", "s1", CASE_A, "2026-01-01T10:00:00+00:00", request_rate="inf"),
        make_record("r-8", "s1", CASE_B, "2026-01-01T10:01:00+00:00", request_rate=8.0),
    ])
    sorted_, above, csv_ = get(
        [db_path],
        f"/results/{TABLE}.json?_shape=objects&_sort=bench_request_rate&_col=bench_request_rate",
        f"/results/{TABLE}.json?_shape=objects&bench_request_rate__gt=5",
        f"/results/{TABLE}.csv?_col=bench_request_rate&_sort=bench_request_rate",
    )
    assert [row["bench_request_rate"] for row in sorted_.json()["rows"]] == [8.0, None]
    assert {row["run_id"] for row in above.json()["rows"]} == {"r-inf", "r-8"}
    assert csv_.text.split() == ["run_id,bench_request_rate", "r-8,8.0", "r-inf,inf"]


def test_max_csv_mb_is_lifted_unless_set(results_db: Path) -> None:
    async def settings(**options: Any) -> Any:
        datasette = Datasette([str(results_db)], **options)
        await datasette.invoke_startup()
        return datasette.setting("max_csv_mb")

    assert asyncio.run(settings()) == 0
    assert asyncio.run(settings(settings={"max_csv_mb": 5})) == 5


def test_latest_session_lists_the_newest_session(results_db: Path) -> None:
    (response,) = get([results_db], "/results/latest_session.json?_shape=array")
    assert response.status_code == 200
    rows = response.json()
    assert [(row["case_id"], row["status"]) for row in rows] == [
        (CASE_B, "error"), (CASE_A, "passed")
    ]
    assert {row["req_per_s"] for row in rows} == {21.0, 22.0}


def test_not_passed_lists_each_case_that_failed_or_errored(results_db: Path) -> None:
    rows = rows_of(results_db, "/results/not_passed.json?_shape=array")
    assert [(row["configuration"], row["status"], row["runs_not_passed"]) for row in rows] == [
        (CASE_B.rsplit("::", 1)[0], "error", 2)
    ]
    assert rows[0]["message"] == "error here"


def test_compare_sessions_defaults_to_the_two_latest(results_db: Path) -> None:
    rows = rows_of(results_db, "/results/compare_sessions.json?_shape=array")
    by_case = {row["configuration"]: row for row in rows}
    a = by_case[CASE_A.rsplit("::", 1)[0]]
    assert (a["session_a"], a["session_b"]) == ("s1", "s2")
    assert (a["a_output_tok_per_s"], a["b_output_tok_per_s"]) == (110.0, 210.0)
    assert a["b_over_a_throughput"] == pytest.approx(210 / 110, abs=1e-3)
    assert a["output_tok_per_s_change_pct"] == 90.9
    explicit = rows_of(results_db, "/results/compare_sessions.json?_shape=array&"
                       "session_a=s2&session_b=s1")
    flipped = {row["configuration"]: row for row in explicit}[CASE_A.rsplit("::", 1)[0]]
    assert (flipped["a_output_tok_per_s"], flipped["b_output_tok_per_s"]) == (210.0, 110.0)


def test_compare_sessions_takes_the_newest_earlier_session_that_shares_a_case(
        tmp_path: Path) -> None:
    """The newest session measured CASE_B alone; the one before it CASE_A alone: A is the
    session before that, the only one that measured CASE_B, and only CASE_B is compared."""
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        make_record("s1-a", "s1", CASE_A, "2026-01-01T10:00:00+00:00", throughput=11.0),
        make_record("s1-b", "s1", CASE_B, "2026-01-01T10:05:00+00:00", throughput=12.0),
        make_record("s2-a", "s2", CASE_A, "2026-01-02T10:00:00+00:00", throughput=21.0),
        make_record("s3-b", "s3", CASE_B, "2026-01-03T10:00:00+00:00", throughput=32.0),
    ])
    rows = rows_of(db_path, "/results/compare_sessions.json?_shape=array")
    assert [(row["session_a"], row["session_b"], row["configuration"], row["a_output_tok_per_s"],
             row["b_output_tok_per_s"]) for row in rows] == [
        ("s1", "s3", CASE_B.rsplit("::", 1)[0], 120.0, 320.0)]
    # Two sessions named that share no case: one row says so.
    (none,) = rows_of(db_path, "/results/compare_sessions.json?_shape=array&"
                      "session_a=s2&session_b=s3")
    assert none["configuration"] == "sessions s2 and s3 measured no case in common"
    assert none["a_output_tok_per_s"] is None


def test_compare_sessions_says_when_no_earlier_session_shares_a_case(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        make_record("s1-a", "s1", CASE_A, "2026-01-01T10:00:00+00:00"),
        make_record("s2-b", "s2", CASE_B, "2026-01-02T10:00:00+00:00"),
    ])
    (row,) = rows_of(db_path, "/results/compare_sessions.json?_shape=array")
    assert (row["session_a"], row["session_b"], row["configuration"]) == (
        None, "s2", "no session before s2 measured a case that it measured")
    with sqlite3.connect(db_path) as connection:
        assert connection.execute(
            "SELECT count(*) FROM benchmark_runs r JOIN benchmark_runs s USING (configuration, "
            "workload) WHERE r.session_id = 's2' AND s.session_id = 's1'").fetchone() == (0,)


def test_compare_runs_side_by_side(results_db: Path) -> None:
    rows = rows_of(results_db, "/results/compare_runs.json?_shape=array&run_a=s1-a&run_b=s2-a")
    figures = {row["metric"]: (row["a"], row["b"], row["change"]) for row in rows}
    assert figures["request_throughput"] == ("11.00 req/s", "21.00 req/s",
                                             "+10.00 req/s (+90.9%)")
    assert figures["output_throughput"] == ("110.0 tok/s", "210.0 tok/s",
                                            "+100.0 tok/s (+90.9%)")
    assert figures["p99_ttft_ms"] == ("1.0 ms", "1.0 ms", "+0.0 ms (+0.0%)")
    assert figures["failed"] == ("0 requests", "0 requests", "+0 requests")
    assert figures["status"] == ("passed", "passed", "same")
    # No gate's table in this database: no verdicts, and the query still answers.
    assert {(row["gate_a"], row["gate_b"]) for row in rows} == {(None, None)}
    with sqlite3.connect(results_db) as connection:
        assert connection.execute(
            "SELECT request_throughput, output_throughput FROM benchmark_runs WHERE run_id IN "
            "('s1-a', 's2-a') ORDER BY run_id").fetchall() == [(11.0, 110.0), (21.0, 210.0)]


def test_the_landing_table_alone_gets_the_compare_boxes(results_db: Path,
                                                        tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as connection:
        # A timestamp column: our landing metadata (sorted on it) reaches any `runs` table.
        connection.execute(f"CREATE TABLE {LANDING} (run_id TEXT, timestamp TEXT)")
    landing, full, theirs = get([results_db, other], f"/results/{LANDING}", f"/results/{TABLE}",
                                f"/other/{LANDING}")
    assert "/-/static-plugins/pytest-profllm/compare.js" in landing.text
    assert "compare.js" not in full.text and "compare.js" not in theirs.text
    assert theirs.status_code == 200


def test_compare_runs_shows_the_gates_interval(results_db: Path) -> None:
    with sqlite3.connect(results_db) as connection:
        gate_tables.create(connection)
        connection.execute(
            "INSERT INTO regression_verdicts (run_id, metric, verdict, change, ci_low, ci_high, "
            "confidence, baseline_session) VALUES ('s2-a', 'p99_ttft_ms', 'regressed', 0.12, "
            "0.05, 0.2, 0.95, 's1')")
    rows = rows_of(results_db, "/results/compare_runs.json?_shape=array&run_a=s1-a&run_b=s2-a")
    gates = {row["metric"]: (row["gate_a"], row["gate_b"]) for row in rows}
    assert gates["p99_ttft_ms"] == (None, "regressed +12.0% [+5.0%, +20.0%] at 95% vs s1")
    assert gates["output_throughput"] == (None, None)


_FIGURE = st.floats(min_value=0, max_value=1e15, allow_nan=False)
_MAYBE = st.one_of(st.none(), st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))


@settings(max_examples=40, deadline=None)
@given(a=_FIGURE, b=_FIGURE, change=_MAYBE, ci_low=_MAYBE, confidence=_MAYBE,
       run_a=st.sampled_from(["x-a", ""]) | st.text(max_size=30),
       session_a=st.sampled_from(["x", "y", ""]) | st.text(max_size=30), gate=st.booleans())
def test_compare_queries_answer_any_figures_and_ids(
        a: float, b: float, change: float | None, ci_low: float | None,
        confidence: float | None, run_a: str, session_a: str, gate: bool) -> None:
    """Whatever the figures stored and the ids typed (the query string's, any text): each
    comparison answers, compare_runs one row a metric with units, never an SQL error."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        db_path = Path(folder) / "results.db"
        load_records(db_path, [
            make_record("x-a", "x", CASE_A, "2026-01-01T10:00:00+00:00", throughput=a),
            make_record("y-a", "y", CASE_A, "2026-01-02T10:00:00+00:00", throughput=b),
        ])
        with contextlib.closing(sqlite3.connect(db_path)) as connection:
            sql_functions.register(connection)
            if gate:
                gate_tables.create(connection)
                connection.execute(
                    "INSERT INTO regression_verdicts (run_id, metric, verdict, change, ci_low, "
                    "ci_high, confidence) VALUES ('y-a', 'output_throughput', 'unsure', ?, ?, "
                    "?, ?)", (change, ci_low, change, confidence))
            queries = canned_queries(gate)
            runs = connection.execute(queries["compare_runs"]["sql"],
                                      {"run_a": run_a, "run_b": "y-a"}).fetchall()
            sessions = connection.execute(queries["compare_sessions"]["sql"],
                                          {"session_a": session_a, "session_b": ""}).fetchall()
    figures = {row[0]: row for row in runs}
    assert len(runs) == 17
    _, shown_a, shown_b, moved = figures["output_throughput"][:4]
    assert shown_b is not None and shown_b.endswith(" tok/s")
    assert shown_a is None if run_a != "x-a" else shown_a.endswith(" tok/s")
    assert moved is None if run_a != "x-a" else moved.startswith(("+", "-"))
    assert sessions and all(row[1] == "y" for row in sessions)


def test_best_configuration_under_a_bound(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        make_record("fast", "s1", CASE_A, "2026-01-01T10:00:00+00:00", throughput=30.0,
                    p99_ttft=900.0),
        make_record("slow", "s1", CASE_B, "2026-01-01T10:01:00+00:00", throughput=10.0,
                    p99_ttft=100.0),
    ])
    unbounded = rows_of(db_path, "/results/best_configuration.json?_shape=array")
    assert [row["output_tok_per_s"] for row in unbounded] == [300.0]
    bounded = rows_of(db_path, "/results/best_configuration.json?_shape=array&"
                      "max_p99_ttft_ms=500")
    assert [(row["configuration"], row["output_tok_per_s"]) for row in bounded] == [
        (CASE_B.rsplit("::", 1)[0], 100.0)]


def test_latest_per_configuration(results_db: Path) -> None:
    # The latest valid measurement of each: case B's latest run (s2-b) is an `error`.
    rows = rows_of(results_db, "/results/latest_per_configuration.json?_shape=array")
    assert sorted((row["configuration"], row["run_id"]) for row in rows) == [
        (CASE_B.rsplit("::", 1)[0], "s1-b"), (CASE_A.rsplit("::", 1)[0], "s2-a")]


def test_case_history_lists_one_case_newest_first(results_db: Path) -> None:
    (response,) = get(
        [results_db], f"/results/case_history.json?_shape=array&case_id={CASE_A}"
    )
    assert response.status_code == 200
    rows = response.json()
    assert [(row["session_id"], row["req_per_s"]) for row in rows] == [
        ("s2", 21.0), ("s1", 11.0)
    ]


def test_database_without_our_table_gets_no_queries_or_charts(
    results_db: Path, other_db: Path
) -> None:
    other, table, query, ours = get(
        [results_db, other_db],
        "/other.json", "/other/notes", "/other/latest_session.json", "/results.json",
    )
    assert other.status_code == 200
    assert other.json()["queries"] == []
    assert table.status_code == 200 and "hello" in table.text
    assert dashboard_links(table.text) == {}
    assert query.status_code == 404
    # The results database served beside it keeps its queries (and the gate's, over its
    # gate_runs, and the requests', over request_samples: every load makes the gate's tables).
    assert {q["name"] for q in ours.json()["queries"]} == {*CANNED_QUERIES, *REQUEST_QUERIES,
                                                            "metric_change_points"}


def test_canned_queries_run_on_records_with_custom_percentiles(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        make_record("s1-a", "s1", CASE_A, "2026-01-01T10:00:00+00:00",
                    latency_metrics=("ttft", "tpot"), percentiles=(50.0, 90.0)),
    ])
    latest, history = get(
        [db_path], "/results/latest_session.json?_shape=array",
        f"/results/case_history.json?_shape=array&case_id={CASE_A}",
    )
    assert (latest.status_code, history.status_code) == (200, 200)


def test_a_run_whose_requests_all_failed_is_no_data_point(tmp_path: Path) -> None:
    # Once, a `failed` run that measured nothing (every request failed: completed 0,
    # metrics 0.0) halved the median of the throughput and Pareto charts and was a "best" or
    # "latest" configuration. A run that missed a threshold stays a point.
    dead = make_record("s3-a", "s3", CASE_A, "2026-01-03T10:00:00+00:00", "failed",
                       throughput=0.0)
    dead["results"].update(completed=0, failed=10, completed_requests=0, failed_requests=10)
    dead["validity"] = None  # as a record of before, read back: its validity is derived
    db_path = tmp_path / "results.db"
    load_records(db_path, [*RECORDS, dead])
    points = points_of(db_path, "load", "session=all")
    assert "s3" not in {row["session"] for row in points}
    assert sorted((row["session"], row["output_throughput"]) for row in points) == [
        ("s1", 110.0), ("s1", 120.0), ("s2", 210.0)]
    latest = rows_of(db_path, "/results/latest_per_configuration.json?_shape=array")
    assert "s3-a" not in {row["run_id"] for row in latest}
    best = rows_of(db_path, "/results/best_configuration.json?_shape=array")
    assert all(row["output_tok_per_s"] > 0 for row in best)


def test_change_points_open_without_a_metric(tmp_path: Path) -> None:
    # It opened on a red "JSON path error": an empty metric made the path '$.'.
    db_path = tmp_path / "results.db"
    for record in RECORDS:
        (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    ingest(db_path, sorted(tmp_path.glob("*.json")))
    bare, named = get([db_path], "/results/metric_change_points.json",
                      "/results/metric_change_points.json?metric=p99_ttft_ms")
    assert (bare.status_code, named.status_code) == (200, 200)
    assert bare.json()["ok"] and bare.json()["rows"]


def test_the_comparisons_ask_for_a_before_b(results_db: Path) -> None:
    (sessions, runs) = get([results_db], "/results/compare_sessions.json",
                           "/results/compare_runs.json")
    assert sessions.json()["query"]["params"] == {"session_a": "", "session_b": ""}
    assert list(sessions.json()["query"]["params"]) == ["session_a", "session_b"]
    assert list(runs.json()["query"]["params"]) == ["run_a", "run_b"]


def test_the_rankings_quick_links_skip_invalid_runs(tmp_path: Path) -> None:
    # Before: "highest output tok/s" opened on an invalid run, whose figure was the host's.
    db_path = tmp_path / "results.db"
    fast_but_invalid = make_record("run-invalid", "s1", CASE_A, "2026-01-01T10:00:00+00:00",
                                   "invalid", throughput=1000.0, p99_ttft=900.0)
    load_records(db_path, [
        make_record("run-slow", "s1", CASE_A, "2026-01-01T10:01:00+00:00", throughput=5.0,
                    p99_ttft=50.0),
        make_record("run-fast", "s1", CASE_A, "2026-01-01T10:02:00+00:00", throughput=20.0,
                    p99_ttft=5.0),
        {**fast_but_invalid, "validity": "invalid"},
    ])
    (landing,) = get([db_path], f"/results/{LANDING}")
    orders = dict(re.findall(r'<a href="([^"]+)">([^<]+)</a>',
                             landing.text.split("profllm-order-links", 1)[1].split("</p>")[0]))
    firsts = {}
    for href, label in orders.items():
        if label.startswith(("slowest", "highest")):
            href = html.unescape(href).replace(f"/{LANDING}?", f"/{LANDING}.json?_shape=array&")
            (page,) = get([db_path], href)
            firsts[label] = page.json()[0]["run_id"]
    assert firsts == {"slowest p99 TTFT": "run-slow", "highest output tok/s": "run-fast"}
