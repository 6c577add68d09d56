"""The one "latest session" every page uses (browse/latest.py): by default each suite is drawn
from its own latest session, and from that session only; a figure is its linked run's."""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dashboards import ingested, pages
from test_datasette import make_record

from pytest_profllm.browse import filters, latest, sql_functions
from pytest_profllm.browse.dashboard_pages import data_quality
from pytest_profllm.browse.dashboards import BY_NAME, View
from pytest_profllm.browse.filters import Selection

# (session, day, suites): smoke ran in all three sessions, `other` beside it in the first two.
SESSIONS = (("s1", "01", ("smoke", "other")), ("s2", "02", ("smoke", "other")),
            ("s3", "03", ("smoke",)))
# Each suite's latest session: s3 for smoke (not s2, which the `other` suite keeps drawn).
LATEST = {("smoke", "s3"), ("other", "s2")}


def three_sessions() -> list[dict[str, Any]]:
    """Each session's cases, two loads each, every run's throughput its own (so a median over
    two sessions is no run's figure)."""
    records = []
    for number, (session, day, suites) in enumerate(SESSIONS, start=1):
        for suite in suites:
            for minute, rate in enumerate((2.0, 8.0)):
                run_id = f"{session}-{suite}-{int(rate)}"
                record = make_record(
                    run_id, session, f"bench_{suite}.yaml::qwen::random-rate{int(rate)}",
                    f"2026-01-{day}T10:{minute + (10 if suite == 'smoke' else 0):02d}:00+00:00",
                    throughput=rate * (1 + number / 10), request_rate=rate)
                record["suite"] = suite
                records.append(record)
    return records


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ingested(tmp_path_factory.mktemp("three"), three_sessions())


@pytest.fixture
def connection(db: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(db)
    sql_functions.register(connection)
    yield connection
    connection.close()


def build(connection: sqlite3.Connection, name: str, query: str = "") -> View:
    schema = filters.read_schema(connection)
    selection = Selection.parse(urllib.parse.parse_qsl(query), schema)
    return BY_NAME[name].build(connection, schema, selection, {})


def run_ids(found: Any) -> set[str]:
    """Every run id a view's charts and tables name, however deep."""
    if isinstance(found, dict):
        own = {v for k, v in found.items() if k.endswith("run_id") and isinstance(v, str)}
        return own.union(*(run_ids(v) for v in found.values()))
    if isinstance(found, list):
        return set().union(*(run_ids(v) for v in found))
    return set()


def suite_sessions(connection: sqlite3.Connection, ids: set[str]) -> set[tuple[str, str]]:
    marks = ", ".join("?" for _ in ids)
    return set(connection.execute(
        f"SELECT suite, session_id FROM benchmark_runs WHERE run_id IN ({marks})", list(ids)))


def test_the_latest_session_of_each_suite_is_one_session_per_suite() -> None:
    sessions = (latest.Session("s3", "3", "3", 2, ("smoke",)),
                latest.Session("s2", "2", "2", 4, ("other", "smoke")),
                latest.Session("s1", "1", "1", 4, ("other", "smoke")))
    assert latest.latest_of_each_suite(sessions) == [latest.SuiteSession("smoke", "s3"),
                                                     latest.SuiteSession("other", "s2")]
    assert latest.latest_session(sessions) == sessions[0]


@pytest.mark.parametrize("name", sorted(set(BY_NAME) - {"history", "latest"}))
def test_every_dashboard_draws_each_suite_from_its_latest_session_only(
        connection: sqlite3.Connection, name: str) -> None:
    # Once, s2 was drawn whole because `other` last ran in it, so smoke was
    # drawn twice (bars from s2, lines from s3) and its medians were over two sessions.
    view = build(connection, name)
    shown = run_ids([view.charts, [table.rows for table in view.tables]])
    assert suite_sessions(connection, shown) <= LATEST
    if name == "load":
        assert suite_sessions(connection, shown) == LATEST


def test_the_latest_dashboard_shows_the_newest_session_alone(
        connection: sqlite3.Connection) -> None:
    view = build(connection, "latest")
    # Every bar is a case of the latest session: s2's `other` suite drew empty rows there.
    bars = [row for chart in view.charts.values() for row in chart["data"]["values"]]
    assert bars and all(row["run_id"] for row in bars)
    assert {session for _, session in suite_sessions(
        connection, run_ids([view.charts, [t.rows for t in view.tables]]))} == {"s3"}


def test_a_load_point_is_its_runs_figure(connection: sqlite3.Connection) -> None:
    view = build(connection, "load")
    figures = dict(connection.execute("SELECT run_id, output_throughput FROM benchmark_runs"))
    points = [row for chart in view.charts.values() for row in chart["data"]["values"]
              if "output_throughput" in row and "run_id" in row]
    assert points
    assert all(row["output_throughput"] == pytest.approx(figures[row["run_id"]])
               for row in points)


def test_the_panel_and_the_counts_are_of_the_same_runs(connection: sqlite3.Connection) -> None:
    schema = filters.read_schema(connection)
    selection = Selection.parse([], schema)
    where, params = selection.where(schema)
    found = set(connection.execute(
        f"SELECT suite, session_id FROM benchmark_runs WHERE {where}", params))
    assert found == LATEST
    # A run of s2's smoke, invalid, is not this selection's to count.
    connection.execute("UPDATE benchmark_runs SET validity = 'invalid' "
                       "WHERE run_id = 's2-smoke-2'")
    assert data_quality(connection, schema, selection) == []
    connection.rollback()


def test_the_pages_say_one_session_per_suite(db: Path) -> None:
    (page,) = pages(db, "/results/-/dashboards/load")
    assert page.status_code == 200
    assert "s3-smoke-8" in page.text and "s2-other-8" in page.text
    assert "s2-smoke-8" not in page.text


def test_the_latest_page_counts_the_runs_of_its_own_session(tmp_path: Path) -> None:
    # It shows s3 alone, but counted s2's skipped run beside it ("1 of the 4 runs ...").
    records = three_sessions()
    for record in records:
        if record["run_id"] == "s2-other-2":
            record["status"] = "skipped"
            record["results"] = {}
    db = ingested(tmp_path, records)
    latest_page, load_page = pages(db, "/results/-/dashboards/latest",
                                   "/results/-/dashboards/load")
    assert "were skipped" not in latest_page.text
    assert "1 of the 4 runs in this selection were skipped" in load_page.text
