"""The summaries each load takes for the canned queries that group every run
(results/summaries.py): after any sequence of loads, a query over a summary answers what the
same query over the rows answers, and a database no load summarised runs the latter."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasette import get
from test_facet_counts import record, runs

from pytest_profllm.browse import sql_functions
from pytest_profllm.browse.queries import canned_queries
from pytest_profllm.results.facet_counts import FACET_COUNTS
from pytest_profllm.results.store import load_records
from pytest_profllm.results.summaries import SUMMARIES

SUMMARISED = ("best_configuration", "latest_per_configuration", "not_passed")
BOUNDS = ({"max_p99_ttft_ms": "", "max_p99_tpot_ms": ""},
          {"max_p99_ttft_ms": "1.5", "max_p99_tpot_ms": ""},
          {"max_p99_ttft_ms": "0.5", "max_p99_tpot_ms": "2"})


def answers(connection: sqlite3.Connection, summarised: bool) -> dict[str, list[Any]]:
    queries = canned_queries(True, summarised)
    found = {}
    for name in SUMMARISED:
        for at, bounds in enumerate(BOUNDS if name == "best_configuration" else ({},)):
            found[f"{name}{at}"] = connection.execute(queries[name]["sql"], bounds).fetchall()
    return found


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loads=st.lists(st.lists(runs, min_size=1, max_size=6), min_size=1, max_size=4),
       slower=st.sets(st.integers(0, 11)))
def test_a_summary_answers_what_the_rows_answer_after_any_loads(
    tmp_path_factory: Any, loads: list[list[tuple[Any, ...]]], slower: set[int]
) -> None:
    db_path = tmp_path_factory.mktemp("summaries") / "results.db"
    for load in loads:
        records = []
        for run in load:
            made = record(*run)
            if run[0] in slower:  # figures that differ between runs, so medians matter
                made["results"]["output_throughput"] *= 1 + run[0] / 10
                made["results"]["p99_ttft_ms"] = run[0] / 4
            records.append(made)
        load_records(db_path, records)
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        sql_functions.register(connection)
        summarised, grouped = answers(connection, True), answers(connection, False)
    assert summarised == grouped
    assert any(summarised.values())


def test_the_pages_read_the_summaries_and_an_unsummarised_database_groups(
    tmp_path: Path
) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(n, "Qwen/Qwen3-8B", ("passed", "failed")[n % 2], 8, 4.0)
                           for n in range(6)])
    query = "/results/not_passed.json?_shape=array"
    before, database = get([db_path], query, "/results.json")
    # Tables a load takes again from the runs are hidden from the database's page.
    hidden = {table["name"] for table in database.json()["tables"] if table["hidden"]}
    assert {*SUMMARIES, FACET_COUNTS} <= hidden and "runs" not in hidden
    with sqlite3.connect(db_path) as connection:
        assert {name for (name,) in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")} >= set(SUMMARIES)
        for name in SUMMARIES:
            connection.execute(f"DROP TABLE [{name}]")
    (after,) = get([db_path], query)
    assert before.status_code == after.status_code == 200
    assert before.json() == after.json()
    assert [row["runs_not_passed"] for row in before.json()] == [3]
