"""The load dashboard's chart of the server's own queue time against load: where saturation
shows first (requests wait in the engine's queue before its throughput stops rising).

One chart per suite over the selection's valid measurements, one line per configuration: the
median over repeats of `system_server_queue_mean_ms`, the mean of vLLM's
`vllm:request_queue_time_seconds` over each case's load (load/server_view.py).
"""

from __future__ import annotations

import math
import sqlite3
from collections import defaultdict
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import View
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import MEASURED_RUNS, quote

METRIC = "system_server_queue_mean_ms"
_LOADS = ("bench_request_rate", "bench_max_concurrency")


def queue_charts(
    connection: sqlite3.Connection, schema: Schema, selection: Selection, view: View
) -> None:
    """Adds a chart per suite whose runs have the server's queue time and sweep a load."""
    if METRIC not in schema.types or not all(load in schema.types for load in _LOADS):
        return
    where, params = selection.where(schema)
    sql = (
        f"SELECT suite, configuration, {', '.join(quote(c) for c in _LOADS)}, "
        f"median({quote(METRIC)}) AS queue_ms, count(*) AS runs, max(run_id) AS run_id "
        f"FROM [{MEASURED_RUNS}] WHERE {where} AND {quote(METRIC)} IS NOT NULL "
        f"GROUP BY suite, configuration, workload, {', '.join(quote(c) for c in _LOADS)}"
    )
    by_suite: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for suite, configuration, rate, concurrency, queue_ms, runs, run_id in connection.execute(
        sql, params
    ):
        by_suite[str(suite)].append({
            "series": str(configuration), "rate": rate, "concurrency": concurrency,
            "queue_ms": queue_ms, "runs": runs, "run_id": run_id,
        })
    for suite, rows in sorted(by_suite.items()):
        axis = _swept(rows)
        if axis is None:
            continue
        for row in rows:
            value = row["rate"] if axis == "rate" else row["concurrency"]
            number = float(value) if isinstance(value, int | float) else math.inf
            row["load"] = "inf" if math.isinf(number) else f"{number:g}"
            row["load_order"] = 1e300 if math.isinf(number) else number
        words = "request rate (req/s)" if axis == "rate" else "max concurrency"
        view.add(
            f"queue-{suite}",
            charts.spec(
                rows, title=f"{suite}: the server's mean queue time against {words}",
                mark={"type": "line", "point": {"size": 70}, "tooltip": True},
                encoding={
                    "x": charts.field("load", "ordinal", words, sort={"field": "load_order"},
                                      axis={"labelAngle": 0}),
                    "y": charts.field("queue_ms", "quantitative", "server mean queue (ms)"),
                    "color": charts.series_colour(len({row["series"] for row in rows})),
                    "tooltip": charts.tooltips("series", "load", "queue_ms", "runs", "run_id"),
                },
            ),
            "The server's own mean queue time (vLLM's vllm:request_queue_time_seconds, queued "
            "to scheduled), median over repeats, against the load the suite sweeps; one line "
            "per configuration. A queue that grows is saturation, before throughput shows it.",
        )


def _swept(rows: list[dict[str, Any]]) -> str | None:
    """Which load the rows sweep (`rate` first), or None where every row ran at one load."""
    for axis in ("rate", "concurrency"):
        if len({repr(row[axis]) for row in rows}) > 1:
            return axis
    return None
