"""The Datasette plugin, in-process: metadata (facets), canned queries and chart links on a
results.db made by `load_records`, and nothing of it on a database without our table."""

from __future__ import annotations

import asyncio
import html
import re
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from datasette.app import Datasette

from pytest_profllm import metrics
from pytest_profllm.record import BenchmarkRecord
from pytest_profllm.store import TABLE, load_records

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
    latency_metrics: tuple[str, ...] = metrics.LATENCY_METRICS,
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0),
) -> dict[str, Any]:
    results: dict[str, float | int | None] = {
        name: 1.0 for name in metrics.result_names(latency_metrics, percentiles)
    }
    results["request_throughput"] = throughput
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
        "config": {"server": {"model": "Qwen/Qwen3-8B"}, "benchmark": {"num_prompts": 10}},
        "results": results,
        "system": {"host": "box", "platform": "Linux", "python": "3.11"},
        "runtime": {"worker": "main", "server_key": "0123456789ab"},
        "verdicts": [
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


def chart_links(page: str) -> dict[str, str]:
    links = re.findall(r'<a href="([^"]+)">(Chart:[^<]*)</a>', page)
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
    assert len(ours) == 1
    assert set(ours[0]["hooks"]) == {
        "asgi_wrapper",
        "get_metadata",
        "canned_queries",
        "table_actions",
        "prepare_connection",  # the regression gate's change-point aggregate
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


def test_table_page_links_to_ready_made_charts(results_db: Path) -> None:
    table, page = get([results_db], f"/results/{TABLE}.json", f"/results/{TABLE}")
    columns = set(table.json()["columns"])
    links = chart_links(page.text)
    assert len(links) == 3
    for label, href in links.items():
        assert label.startswith("Chart:")
        assert href.startswith(f"/results/{TABLE}?")
        assert "#g.mark=" in href and "g.x_column=" in href
        # Every column a chart plots exists in the table.
        state = parse_qs(urlsplit(href).fragment)
        for key in ("g.x_column", "g.y_column", "g.color_column"):
            assert state[key][0] in columns, (label, key)


def test_chart_links_follow_the_database_name(tmp_path: Path) -> None:
    db_path = tmp_path / "nightly.db"
    load_records(db_path, RECORDS)
    (page,) = get([db_path], f"/nightly/{TABLE}")
    links = chart_links(page.text)
    assert links and all(href.startswith(f"/nightly/{TABLE}?") for href in links.values())


def test_latest_session_lists_the_newest_session(results_db: Path) -> None:
    (response,) = get([results_db], "/results/latest_session.json?_shape=array")
    assert response.status_code == 200
    rows = response.json()
    assert [(row["case_id"], row["status"]) for row in rows] == [
        (CASE_B, "error"), (CASE_A, "passed")
    ]
    assert {row["request_throughput"] for row in rows} == {21.0, 22.0}


def test_not_passed_lists_failed_and_errored_cases(results_db: Path) -> None:
    (response,) = get([results_db], "/results/not_passed.json?_shape=array")
    assert response.status_code == 200
    rows = response.json()
    assert [(row["timestamp"][:10], row["status"]) for row in rows] == [
        ("2026-01-02", "error"), ("2026-01-01", "failed")
    ]
    assert rows[1]["failed_verdicts"] == "output_throughput,request_throughput"
    assert rows[0]["message"] == "error here"


def test_case_history_lists_one_case_newest_first(results_db: Path) -> None:
    (response,) = get(
        [results_db], f"/results/case_history.json?_shape=array&case_id={CASE_A}"
    )
    assert response.status_code == 200
    rows = response.json()
    assert [(row["session_id"], row["request_throughput"]) for row in rows] == [
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
    assert chart_links(table.text) == {}
    assert query.status_code == 404
    # The results database served beside it keeps its queries.
    assert {q["name"] for q in ours.json()["queries"]} == {
        "latest_session", "not_passed", "case_history"
    }


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
