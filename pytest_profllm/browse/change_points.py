"""The gate's Datasette hooks: a SQL aggregate `profllm_change_points(order_key, value)` that
returns the change points of a history as JSON (gates/history.py), and a canned query
`metric_change_points` over the `gate_runs` table that uses it."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from datasette import hookimpl

from pytest_profllm.gates.history import Point, change_points, session_means
from pytest_profllm.results import gate_tables as tables

_QUERY = f"""
select case_id, fingerprint, count(distinct session_id) as sessions,
  profllm_change_points(session_id, json_extract(results,
    '$.' || coalesce(nullif(:metric, ''), 'output_throughput'))) as change_points
from [{tables.RUNS}] where validity = 'valid'
group by fingerprint order by case_id
"""
# The tables whose rows the query shows: a visitor who may not see them is refused it
# (browse/plugin.py's permission_allowed).
TABLES_SHOWN = {"metric_change_points": (tables.RUNS,)}


class ChangePointsAggregate:
    """SQLite aggregate: collects (order key, value) and returns the change points as JSON."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float]] = []

    def step(self, key: Any, value: Any) -> None:
        if value is not None:
            self.points.append((str(key), float(value)))

    def finalize(self) -> str:
        means = session_means(Point(key, value) for key, value in self.points)
        return json.dumps(
            [
                {
                    "session": found.point.key,
                    "before": found.before,
                    "after": found.after,
                    "change": found.change,
                }
                for found in change_points(means)
            ]
        )


@hookimpl
def prepare_connection(conn: sqlite3.Connection) -> None:
    conn.create_aggregate("profllm_change_points", 2, ChangePointsAggregate)  # type: ignore[arg-type]


@hookimpl
def canned_queries(datasette: Any, database: str) -> Any:
    async def queries() -> dict[str, Any]:
        names = await datasette.get_database(database).table_names()
        if tables.RUNS not in names:
            return {}
        return {
            "metric_change_points": {
                "sql": _QUERY,
                "title": "Change points of a metric",
                "description": "Per fingerprint, the sessions after which the metric's mean "
                "(?metric=, default output_throughput) "
                "shifted by 5 % or more (ruptures' PELT over per-session means); "
                "`profllm history` fills the change_points table with the same analysis.",
                "params": ["metric"],
            }
        }

    return queries
