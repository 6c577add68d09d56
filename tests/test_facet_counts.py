"""The facet counts a load keeps (results/facet_counts.py) and the facets that read them
(browse/facets.py): after any sequence of loads they are the counts SQLite groups from the
rows, and an unfiltered page shows them as Datasette's column facet would."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from datasette.app import Datasette
from datasette.database import QueryInterrupted
from datasette.utils.asgi import Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasette import get, make_record

from pytest_profllm.browse.facets import CountedFacet
from pytest_profllm.results.facet_counts import FACET_COUNTS, counted_columns
from pytest_profllm.results.landing import LANDING, swept_axes
from pytest_profllm.results.store import load_records
from pytest_profllm.results.table import TABLE

# A run as the strategy draws it: (run number, model, status, max_num_seqs, request rate).
runs = st.tuples(st.integers(0, 11), st.sampled_from(["Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"]),
                 st.sampled_from(["passed", "failed", "error"]), st.sampled_from([8, 16]),
                 st.sampled_from([4.0, 8.0, "inf"]))


def record(number: int, model: str, status: str, seqs: int, rate: float | str) -> dict[str, Any]:
    made = make_record(f"r{number}", f"s{number % 3}", f"bench_x.yaml::m-seqs{seqs}::w{rate}",
                       f"2026-03-01T10:{number:02d}:00+00:00", status, max_num_seqs=seqs,
                       request_rate=rate)
    made["config"]["server"]["model"] = model
    if number % 4 == 0:
        made["runtime"]["node_id"] = f"node{number % 2}"  # a column only some loads bring
    return made


def grouped(connection: sqlite3.Connection, table: str, column: str) -> dict[Any, int]:
    return dict(connection.execute(
        f'SELECT "{column}", count(*) FROM [{table}] GROUP BY "{column}"').fetchall())


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(loads=st.lists(st.lists(runs, min_size=1, max_size=6), min_size=1, max_size=4))
def test_the_kept_counts_are_those_of_the_rows_after_any_loads(
    tmp_path_factory: Any, loads: list[list[tuple[Any, ...]]]
) -> None:
    # Loads that add runs, change a stored run's values (the same run id again) and bring
    # new columns and swept axes.
    db_path = tmp_path_factory.mktemp("counts") / "results.db"
    for load in loads:
        load_records(db_path, [record(*run) for run in load])
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        swept = swept_axes(connection)
        for table, columns in counted_columns(swept).items():
            present = {row[1] for row in connection.execute(f"PRAGMA table_info([{table}])")}
            for column in columns:
                kept = dict(connection.execute(
                    f"SELECT value, count FROM [{FACET_COUNTS}] WHERE table_name = ? AND "
                    "column_name = ?", (table, column)).fetchall())
                if column not in present:
                    assert kept == {}, (table, column)
                    continue
                expected = grouped(connection, table, column)
                expected.setdefault(None, 0)
                assert kept == expected, (table, column)


def facets(response: Any) -> dict[str, list[tuple[Any, int, bool]]]:
    return {name: [(item["value"], item["count"], item["selected"]) for item in facet["results"]]
            for name, facet in response.json()["facet_results"].items()}


def test_an_unfiltered_page_shows_the_kept_counts_a_filtered_one_groups(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(n, "Qwen/Qwen3-8B" if n % 3 else "Qwen/Qwen3-0.6B",
                                  "passed" if n % 2 else "failed", 8 * (1 + n % 2), 4.0)
                           for n in range(9)])
    for table in (TABLE, LANDING):
        # `_where=1` filters nothing but makes the page a filtered one: grouped by Datasette.
        kept, grouped_page = get([db_path], f"/results/{table}.json",
                                 f"/results/{table}.json?_where=1")
        assert facets(kept) == facets(grouped_page)
        assert facets(kept)["server_model"] == [("Qwen/Qwen3-8B", 6, False),
                                                ("Qwen/Qwen3-0.6B", 3, False)]
        # Toggle links as Datasette's own facet makes them (filtered, it adds `_where=1`).
        for ours, theirs in zip(kept.json()["facet_results"]["status"]["results"],
                                grouped_page.json()["facet_results"]["status"]["results"],
                                strict=True):
            assert ours["toggle_url"] == theirs["toggle_url"].replace("_where=1&", "")
            assert ours["toggle_url"].endswith(f"/{table}.json?_nosuggest=1&status="
                                               f"{ours['value']}")
    # The unfiltered page reads the kept counts (changed behind the load's back here), the
    # filtered one its rows.
    with sqlite3.connect(db_path) as connection:
        connection.execute(f"UPDATE [{FACET_COUNTS}] SET count = 99 WHERE table_name = ? AND "
                           "value = 'Qwen/Qwen3-0.6B'", (LANDING,))
    kept, filtered = get([db_path], f"/results/{LANDING}.json",
                         f"/results/{LANDING}.json?status=passed")
    assert facets(kept)["server_model"][0] == ("Qwen/Qwen3-0.6B", 99, False)
    assert {facet["type"] for facet in kept.json()["facet_results"].values()} == {"column"}
    (html_page,) = get([db_path], f"/results/{LANDING}")
    assert "(counted)" not in html_page.text and 'id="facet-server_model"' in html_page.text
    assert dict((v, c) for v, c, _ in facets(filtered)["server_model"]) == {
        "Qwen/Qwen3-8B": 3, "Qwen/Qwen3-0.6B": 1}
    assert facets(filtered)["status"] == [("passed", 4, True)]


def test_a_database_loaded_before_counts_were_kept_groups_its_rows(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(n, "Qwen/Qwen3-8B" if n else "Qwen/Qwen3-0.6B", "passed", 8,
                                  4.0) for n in range(3)])
    with sqlite3.connect(db_path) as connection:
        connection.execute(f"DROP TABLE [{FACET_COUNTS}]")
    (page,) = get([db_path], f"/results/{LANDING}.json")
    assert facets(page)["server_model"] == [("Qwen/Qwen3-8B", 2, False),
                                            ("Qwen/Qwen3-0.6B", 1, False)]
    # The next load counts them, whether or not it changed a row.
    load_records(db_path, [record(0, "Qwen/Qwen3-8B", "passed", 8, 4.0)])
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        assert connection.execute(f"SELECT count(*) FROM [{FACET_COUNTS}]").fetchone()[0] > 0


def test_a_filtered_page_counts_each_facet_as_sqlite_groups_it(tmp_path: Path) -> None:
    # One read of the filtered rows counts every facet: the counts and their order are
    # SQLite's GROUP BY of the same rows (count, most first, then value; numbers before text).
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(n, "Qwen/Qwen3-8B" if n % 3 else "Qwen/Qwen3-0.6B",
                                  ("passed", "failed", "error")[n % 3], 8 * (1 + n % 2),
                                  (4.0, 8.0, "inf")[n % 3 // 2]) for n in range(12)])
    filters = {"status=passed": "status = 'passed'",
               "server_max_num_seqs=16": "server_max_num_seqs = 16",
               "server_model=Qwen%2FQwen3-8B&status__not=error":
                   "server_model = 'Qwen/Qwen3-8B' AND status != 'error'"}
    pages = get([db_path], *(f"/results/{LANDING}.json?{query}" for query in filters))
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        for page, where in zip(pages, filters.values(), strict=True):
            shown = facets(page)
            assert shown, where
            for column, values in shown.items():
                expected = connection.execute(
                    f'SELECT "{column}", count(*) FROM [{LANDING}] WHERE {where} AND '
                    f'"{column}" IS NOT NULL GROUP BY "{column}" ORDER BY 2 DESC, 1').fetchall()
                assert [(value, count) for value, count, _ in values] == expected, (where,
                                                                                   column)


def test_counting_past_the_facets_time_says_which_facets_timed_out(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(n, "Qwen/Qwen3-8B", "passed", 8, 4.0) for n in range(3)])

    async def run(grouped: bool) -> Any:
        datasette = Datasette([str(db_path)])
        await datasette.invoke_startup()
        request = Request.fake(f"/results/{LANDING}?status=passed")
        facet = CountedFacet(datasette, request, "results", table=LANDING,
                             sql=f"select * from [{LANDING}] where status = :p0 ",
                             params={"p0": "passed"})
        connection = sqlite3.connect(db_path)
        try:
            if grouped:  # one column alone, as an unfiltered page without counts does
                return facet._grouped(connection, "suite", 30, limit_ms=0)
            return facet._count_rows(connection, ["suite", "engine"], limit_ms=0)
        finally:
            connection.close()

    for grouped in (False, True):
        with pytest.raises(QueryInterrupted):
            asyncio.run(run(grouped))


def test_the_planner_is_told_how_many_runs_each_value_has(tmp_path: Path) -> None:
    # The wide table is analysed by samples of 1,000 entries: an index on two models' column
    # looked as if each model had 1,001 runs, and a filter on a model and on many sessions
    # went through the model's index. The counts correct it.
    db_path = tmp_path / "results.db"
    records = []
    for number in range(2400):
        made = make_record(f"r{number}", f"s{number // 10:03d}", f"bench_x.yaml::c{number % 10}::w",
                           "2026-03-01T10:00:00+00:00")
        made["config"]["server"]["model"] = ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B")[number % 2]
        made["suite"] = "x" if number else "y"  # one run of its own
        records.append(made)
    load_records(db_path, records)
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        stats = dict(connection.execute(
            "SELECT idx, stat FROM sqlite_stat1 WHERE tbl = ?", (TABLE,)).fetchall())
        assert stats[f"idx_{TABLE}_server_model"] == "2400 1200"
        assert stats[f"idx_{TABLE}_suite"] == "2400 1200"  # the average of 2,399 and 1
        assert all(stat.split()[0] == "2400" for stat in stats.values())
        sessions = [f"s{n:03d}" for n in range(60)]
        plan = " ".join(row[-1] for row in connection.execute(
            f"EXPLAIN QUERY PLAN SELECT count(message) FROM [{TABLE}] WHERE session_id IN "
            f"({', '.join('?' * len(sessions))}) AND server_model = ?",
            [*sessions, "Qwen/Qwen3-8B"]))
        assert "idx_benchmark_runs_session_id" in plan, plan


def test_a_skipped_run_is_never_counted_invalid(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [record(number, "Qwen/Qwen3-8B", status, 8, 4.0)
                           for number, status in enumerate(("passed", "invalid", "skipped"))])
    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        kept = dict(connection.execute(
            f"SELECT value, count FROM [{FACET_COUNTS}] WHERE table_name = ? "
            "AND column_name = 'validity'", (LANDING,)).fetchall())
        assert kept == {"valid": 1, "invalid": 1, None: 1}
        assert grouped(connection, LANDING, "validity") == kept
        # The record keeps its own word: the wide table is unchanged.
        assert grouped(connection, TABLE, "validity") == {"valid": 1, "invalid": 2}
