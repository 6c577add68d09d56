"""The capacity dashboard: the highest load each configuration carried under its SLOs,
with its bracket, its figure on each bar, and a table of the runs (each linked to its page)."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import Table, View
from pytest_profllm.browse.dashboards.common import (
    series_names,
)
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import MEASURED_RUNS, TABLE, quote


def capacity_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                       args: Mapping[str, str]) -> View:
    """The highest load each configuration carried under its SLOs, with its bracket."""
    view = View()
    if "capacity" not in schema.types or connection.execute(
        f"SELECT 1 FROM [{TABLE}] WHERE capacity IS NOT NULL LIMIT 1"  # indexed
    ).fetchone() is None:
        view.notes.append("No capacity case in this database (benchmark kind: capacity).")
        return view
    where, params = selection.where(schema)
    columns = [c for c in ("capacity", "capacity_low", "capacity_high", "capacity_limit")
               if c in schema.types]
    cursor = connection.execute(
        f"SELECT configuration, workload, engine, device, suite, session_id, run_id, "
        f"{', '.join(quote(c) for c in columns)} FROM [{MEASURED_RUNS}] WHERE {where} "
        "AND capacity IS NOT NULL ORDER BY timestamp", params)
    names_ = [d[0] for d in cursor.description]
    rows = [dict(zip(names_, row, strict=True)) for row in cursor]
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        latest[(row["configuration"], row["workload"], row["engine"], row["device"],
                row["session_id"])] = row
    contexts = {key: {"suite": row["suite"], "engine": row["engine"], "device": row["device"],
                      "configuration": row["configuration"], "workload": row["workload"],
                      "session": row["session_id"]}
                for key, row in latest.items()}
    names = series_names(contexts)
    values = [{**row, "series": names[key]} for key, row in latest.items()]
    layers: list[dict[str, Any]] = [
        {"mark": {"type": "bar", "tooltip": True},
         "encoding": {"y": charts.field("series", "nominal", "configuration",
                                        axis={"labelLimit": 520, "title": None}),
                      "x": charts.field("capacity", "quantitative",
                                        "capacity: the highest load that met every SLO "
                                        "(req/s, or concurrent requests)"),
                      "tooltip": charts.tooltips("series", *columns, "run_id")}},
    ]
    if {"capacity_low", "capacity_high"} <= set(columns):
        layers.append({"mark": {"type": "rule", "color": "#222", "strokeWidth": 2},
                       "encoding": {"y": {"field": "series", "type": "nominal"},
                                    "x": {"field": "capacity_low", "type": "quantitative"},
                                    "x2": {"field": "capacity_high"}}})
    # The figure itself at the end of each bar, above the bracket's rule.
    layers.append({"mark": {"type": "text", "align": "left", "dx": 4, "dy": -10,
                            "fontWeight": "bold"},
                   "encoding": {"y": {"field": "series", "type": "nominal"},
                                "x": {"field": "capacity", "type": "quantitative"},
                                "text": {"field": "capacity", "type": "quantitative",
                                         "format": ".3~g"}}})
    view.add("capacity", charts.spec(values, title="Capacity per configuration",
                                     height=max(220, 36 * len(values)), layers=layers),
             "Bars: the highest load that met every SLO, its figure beside it; black rules: "
             "the bracket between the last load that met them and the first that missed. "
             "Valid measurements only: a search the host held back, or whose re-check found "
             "the server changed, is no capacity and is not drawn (the notes count such runs).",
             wide=True)
    view.tables.append(Table(
        "Capacity runs (each links to its run page: probes, re-check, SLO readings)",
        ["series", *columns, "validity", "session_id", "run_id"],
        [{**row, **{c: _shown(row.get(c)) for c in columns}, "validity": "valid"}
         for row in sorted(values, key=lambda r: -r["capacity"])],
        empty="No valid capacity measurement in this selection."))
    if not values:
        view.notes.append("No valid capacity measurement in this selection.")
    return view


def _shown(value: Any) -> Any:
    """A figure to four significant digits, as the bars' labels (a search's loads are
    geometric steps: their sixteen digits say nothing)."""
    return float(f"{value:.4g}") if isinstance(value, float) else value
