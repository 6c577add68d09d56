"""Datasette plugin: `datasette results.db` shows `benchmark_runs` with default facets, units,
column descriptions, canned queries and chart links (datasette-vega keeps a chart's state in
the URL fragment, so a link can open a ready-made chart).

Every hook returns early for databases without our table.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any
from urllib.parse import urlencode

from datasette import hookimpl

from pytest_profllm.metrics import COUNT_METRICS, LATENCY_METRICS
from pytest_profllm.store import STANDARD_METRICS, TABLE

# Datasette lists column descriptions above the table: only the columns whose meaning is not
# plain from their name get one; the latency metrics are explained once in the description.
COLUMN_DESCRIPTIONS: dict[str, str] = {
    "case_id": "suite file :: server :: workload",
    "status": "passed; failed (threshold missed, or the test failed); invalid (the client fell "
    "behind its schedule: the figures measure the client); error (no measurement)",
    "engine": "vllm, or sim for the simulated engine: never compare the two",
    "duration": "seconds the benchmark's requests took, failed ones included (vLLM's duration)",
    "case_duration": "seconds the whole case took, server start included",
    "total_output_tokens": "output tokens of completed requests, from the usage chunk",
    "request_goodput": "requests per second that met every goodput SLO of the workload",
    "failed_verdicts": "metrics that missed their threshold",
    "p99_schedule_lag_ms": "how late the client sent requests against their intended times",
    "achieved_request_rate": "requests per second the client actually sent (target_request_rate: "
    "the schedule's)",
    "client_cpu_percent": "the client event loop's CPU use during the load (100 = one core)",
    "runtime_node_id": "the Ray node the case ran on (--profllm-ray); empty on one host",
}
DESCRIPTION = (
    "One row per benchmark case, written by pytest-profllm. server_* columns are vLLM engine "
    "arguments, bench_* the workload, system_* and runtime_* where and how it ran. Metrics keep "
    "the names and definitions of vllm bench serve, latencies in ms: ttft = time to first token, "
    "tpot = time per output token after the first, itl = gaps between streamed messages (pooled "
    "over requests), e2el = end-to-end latency; each as mean_, median_, std_ and pNN_."
)

DEFAULT_FACETS = ["suite", "engine", "status", "server_model"]
# Where a run used --profllm-ray: the node each case ran on. Only for tables that have the
# column (a database loaded before records named their node has not): a facet on a missing
# column fails the whole page.
NODE_FACET = "runtime_node_id"
CHARTS = (
    (
        "Chart: median TTFT against request throughput",
        "circle",
        "request_throughput",
        "median_ttft_ms",
        "case_id",
    ),
    ("Chart: output throughput by case", "bar", "case_id", "output_throughput", "engine"),
    ("Chart: median TPOT by case", "bar", "case_id", "median_tpot_ms", "engine"),
)


def table_metadata(node_facet: bool = False) -> dict[str, Any]:
    units = {name: "ms" for name in STANDARD_METRICS if name.endswith("_ms")}
    units["duration"] = units["case_duration"] = "s"
    return {
        "title": "vLLM serving benchmarks",
        "description": DESCRIPTION,
        "facets": DEFAULT_FACETS + ([NODE_FACET] if node_facet else []),
        "sort_desc": "timestamp",
        "units": units,
        "columns": COLUMN_DESCRIPTIONS,
    }


@hookimpl
def asgi_wrapper(datasette: Any) -> Any:
    """No facet suggestions on our table: Datasette tries every column for them, and with one
    column per engine argument (400+) that made its table page take seconds instead of a
    fraction of one. Default facets and `?_facet=` work as ever."""

    def wrap(app: Any) -> Any:
        async def without_suggestions(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope.get("type") == "http" and _is_our_table(scope.get("path", "")):
                query: bytes = scope.get("query_string", b"")
                if b"_nosuggest=" not in query:
                    query += (b"&" if query else b"") + b"_nosuggest=1"
                    scope = {**scope, "query_string": query}
            await app(scope, receive, send)

        return without_suggestions

    return wrap


def _is_our_table(path: str) -> bool:
    # /<database>/benchmark_runs, with or without a format (.json, .csv)
    parts = path.strip("/").split("/")
    return len(parts) == 2 and parts[1].split(".", 1)[0] == TABLE


@hookimpl
def get_metadata(
    datasette: Any, key: Any, database: str | None, table: str | None
) -> dict[str, Any]:
    if table not in (None, TABLE):
        return {}
    names = [database] if database else list(datasette.databases)
    return {
        "databases": {
            name: {"tables": {TABLE: table_metadata(_has_node_column(datasette, name))}}
            for name in names
        }
    }


_WITH_NODE_COLUMN: set[str] = set()  # database files known to have it (columns never go)


def _has_node_column(datasette: Any, name: str) -> bool:
    # get_metadata cannot await Datasette's own connection: a read-only look of our own.
    path = getattr(datasette.databases.get(name), "path", None)
    if not path:
        return False
    if path not in _WITH_NODE_COLUMN:
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                columns = {row[1] for row in db.execute(f"PRAGMA table_info([{TABLE}])")}
        except sqlite3.Error:
            return False
        if NODE_FACET in columns:
            _WITH_NODE_COLUMN.add(path)
    return path in _WITH_NODE_COLUMN


@hookimpl
def canned_queries(datasette: Any, database: str, actor: Any) -> Any:
    async def queries() -> dict[str, Any]:
        if not await datasette.get_database(database).table_exists(TABLE):
            return {}
        return CANNED_QUERIES

    return queries


def _latency_columns() -> str:
    return ", ".join(f"median_{m}_ms, p99_{m}_ms" for m in LATENCY_METRICS)


CANNED_QUERIES: dict[str, Any] = {
    "latest_session": {
        "title": "Latest session",
        "description": "Every case of the most recent pytest session.",
        "sql": f"select case_id, status, engine, {', '.join(COUNT_METRICS[:3])}, "
        f"request_throughput, output_throughput, {_latency_columns()} from {TABLE} "
        f"where session_id = (select session_id from {TABLE} order by timestamp desc limit 1) "
        "order by case_id",
    },
    "not_passed": {
        "title": "Cases that did not pass",
        "description": "Failed and errored cases with their message and missed thresholds.",
        "sql": f"select timestamp, case_id, status, failed_verdicts, message, engine from {TABLE} "
        "where status != 'passed' order by timestamp desc",
    },
    "case_history": {
        "title": "History of one case",
        "description": "A case's figures over time, newest first: regressions show here.",
        "sql": f"select timestamp, session_id, engine, status, request_throughput, "
        f"output_throughput, {_latency_columns()} from {TABLE} where case_id = :case_id "
        "order by timestamp desc",
    },
}


@hookimpl
def table_actions(datasette: Any, actor: Any, database: str, table: str, request: Any) -> Any:
    if table != TABLE:
        return None
    base = datasette.urls.table(database, table)
    return [
        {
            "href": f"{base}?{urlencode({'_size': 'max'})}#"
            + urlencode(
                {
                    "g.mark": mark,
                    "g.x_column": x,
                    "g.x_type": "quantitative" if mark == "circle" else "ordinal",
                    "g.y_column": y,
                    "g.y_type": "quantitative",
                    "g.color_column": color,
                }
            ),
            "label": label,
        }
        for label, mark, x, y, color in CHARTS
    ]
