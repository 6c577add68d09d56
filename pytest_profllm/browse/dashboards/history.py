"""The history dashboard: one case over time, every valid run coloured by its regression decision,
change points marked."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import Table, View
from pytest_profllm.browse.dashboards.common import (
    _VERDICT_COLOURS,
    POINT_METRICS,
    _finite,
    _table_exists,
)
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import MEASURED_RUNS, TABLE, quote

HISTORY_METRICS = (*POINT_METRICS, ("median_itl_ms", "median ITL (ms)"),
                   ("p99_e2el_ms", "p99 E2EL (ms)"))


def history_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                      args: Mapping[str, str]) -> View:
    """One case over time: every valid run, coloured by its regression decision, change points
    marked. The filter panel's conditions apply; its session choice does not (history is
    every session)."""
    view = View()
    offered = [(m, label) for m, label in HISTORY_METRICS if m in schema.types]
    if "capacity" in schema.types and connection.execute(
            f"SELECT 1 FROM [{TABLE}] WHERE capacity IS NOT NULL LIMIT 1").fetchone():  # indexed
        offered.append(("capacity", "capacity (req/s or concurrent requests)"))
    metric = args.get("metric", "output_throughput")
    if metric not in dict(offered):
        # Said on the page: a metric it cannot draw is never swapped for another in silence.
        view.notes.append(f"No history of metric {_cut(metric)!r} here: it is one of "
                          f"{', '.join(m for m, _ in offered)}; showing output_throughput.")
        metric = "output_throughput"
    conditions, params = selection.conditions(schema)
    case_id = args.get("case_id", "").strip()
    if not case_id:
        row = connection.execute(
            f"SELECT case_id FROM [{TABLE}] WHERE {conditions} ORDER BY timestamp DESC LIMIT 1",
            params).fetchone()
        case_id = row[0] if row else ""
    # The cases of the newest runs (read through the timestamp index, not by grouping every
    # run): the ones people look back on.
    cases = list(dict.fromkeys(r[0] for r in connection.execute(
        f"SELECT case_id FROM [{TABLE}] WHERE {conditions} ORDER BY timestamp DESC LIMIT 5000",
        params)))[:300]
    view.inputs["case_id"] = ("case", case_id, cases)
    view.inputs["metric"] = ("metric", metric, [m for m, _ in offered])
    if not case_id:
        view.notes.append("No run in this selection.")
        return view
    has_verdicts = _table_exists(connection, "regression_verdicts")
    verdict = ("(SELECT verdict FROM regression_verdicts v WHERE v.run_id = r.run_id AND "
               "v.metric = ?)" if has_verdicts else "NULL")
    rows = [dict(zip(("timestamp", "session", "run_id", "value", "gate"), row, strict=True))
            for row in connection.execute(
                f"SELECT timestamp, session_id, run_id, {quote(metric)}, {verdict} "
                f"FROM [{MEASURED_RUNS}] r WHERE case_id = ? AND {quote(metric)} IS NOT NULL "
                f"AND {conditions} ORDER BY timestamp",
                [*([metric] if has_verdicts else []), case_id, *params])]
    for row in rows:
        row["gate"] = row["gate"] or "not gated"
        row["value"] = _finite(row["value"])
    changes: list[dict[str, Any]] = []
    if _table_exists(connection, "change_points"):
        changes = [dict(zip(("timestamp", "before", "after", "change"), row, strict=True))
                   for row in connection.execute(
                       "SELECT timestamp, before, after, change FROM change_points "
                       "WHERE case_id = ? AND metric = ? ORDER BY timestamp",
                       (case_id, metric))]
    label = dict(offered)[metric]
    # In UTC, as the records' timestamps are, whatever the browser's time zone; on a 24-hour
    # clock (Vega's default labels read 17:03 as "05:03") and never finer than a second (runs
    # seconds apart got ".500" ticks).
    time = charts.field("timestamp", "temporal", "time (UTC)", scale={"type": "utc"},
                        axis={"format": _time_format([r["timestamp"] for r in rows]),
                              "tickMinStep": 1000, "labelAngle": -30,
                              "labelOverlap": True})
    layers: list[dict[str, Any]] = [
        {"mark": {"type": "line", "color": "#999"},
         "encoding": {"x": time, "y": charts.field("value", "quantitative", label)}},
        {"mark": {"type": "point", "filled": True, "size": 90, "tooltip": True},
         "encoding": {
             "x": time, "y": charts.field("value", "quantitative", label),
             "color": charts.field("gate", "nominal", "regression", scale=_VERDICT_COLOURS),
             "tooltip": charts.tooltips("timestamp", "session", "value", "gate", "run_id")}},
    ]
    if changes:
        layers.append({"data": {"values": charts.rows_as_values(changes)},
                       "mark": {"type": "rule", "color": "#6a1b9a", "strokeWidth": 2,
                                "tooltip": True},
                       "encoding": {"x": time,
                                    "tooltip": charts.tooltips("timestamp", "before", "after",
                                                               "change")}})
    view.add("history", charts.spec(rows, title=f"{case_id}: {label} over time",
                                    layers=layers),
             "Every valid run of the case; colour: the regression gate's decision on this "
             "metric; purple rules: change points found in its history.")
    view.tables.append(Table("Change points", ["timestamp", "before", "after", "change"],
                             changes, empty="No change point found for this case and metric."))
    return view


def _time_format(timestamps: Sequence[Any]) -> str:
    """A 24-hour d3 time format as fine as the span of `timestamps` needs: seconds within an
    hour, the date where they cross days."""
    moments = []
    for text in timestamps:
        try:
            moments.append(datetime.fromisoformat(str(text)))
        except ValueError:
            continue
    if len(moments) < 2:
        return "%Y-%m-%d %H:%M:%S"
    try:
        span = (max(moments) - min(moments)).total_seconds()
    except TypeError:  # naive and aware times mixed
        return "%Y-%m-%d %H:%M:%S"
    if span < 3600:
        return "%H:%M:%S"
    return "%H:%M" if span < 86400 else "%Y-%m-%d %H:%M"


def _cut(text: str, length: int = 60) -> str:
    return text if len(text) <= length else text[:length] + "..."
