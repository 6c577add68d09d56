"""The load dashboard: throughput and latency against the load a suite sweeps, one series
per configuration, a set of charts per suite and load axis."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import View
from pytest_profllm.browse.dashboards.common import (
    CAPACITY_LOAD,
    POINT_METRICS,
    Point,
    _listed,
    _point_row,
    _series,
    _slug,
    load_axis,
    load_points,
    series_names,
)
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.browse.queue_chart import queue_charts

# The load dashboard draws the most recent suites of a selection, this many at most.
MAX_SUITES = 10


def load_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                   args: Mapping[str, str]) -> View:
    """Throughput and latency against load, one series per configuration."""
    view = View()
    points = load_points(connection, schema, selection, view.notes)
    by_series = _series(points)
    # One set of charts per suite and load axis: suites sweep different things, and a chart
    # of every suite's series at once has a legend nobody can read.
    by_chart: dict[tuple[str, str], dict[tuple[Any, ...], list[Point]]] = defaultdict(dict)
    newest: dict[str, str] = {}
    for key, members in by_series.items():
        suite = str(members[0].context.get("suite"))
        by_chart[(suite, load_axis(members))][key] = members
        newest[suite] = max(newest.get(suite, ""), max(p.timestamp for p in members))
    suites_shown = sorted(newest, key=lambda suite: (newest[suite], suite), reverse=True)
    if len(suites_shown) > MAX_SUITES:
        left_out = suites_shown[MAX_SUITES:]
        view.notes.append(
            f"{len(suites_shown)} suites in this selection: the {MAX_SUITES} that ran last are "
            f"drawn; not drawn: {_listed(left_out, 10)} (filter on suite to draw them).")
        suites_shown = suites_shown[:MAX_SUITES]
    order = {suite: at for at, suite in enumerate(suites_shown)}
    for (suite, axis), series in sorted(
        ((k, v) for k, v in by_chart.items() if k[0] in order),
        key=lambda item: (order[item[0][0]], item[0][1]),
    ):
        names = series_names({key: members[0].context for key, members in series.items()})
        points_rows = [_point_row(p, names[key], axis) for key, members in series.items()
                       for p in members]
        x = charts.field("load", "ordinal", axis.replace("_", " ") + (
            " (req/s)" if axis == "request_rate" else " (requests in flight)"),
            sort={"field": "load_order"}, axis={"labelAngle": 0})
        prefix = f"{suite}: "
        unmeasured: list[str] = []
        axis_words = axis.replace("_", " ")
        # A suite that does not sweep load has one point per series: a line chart of single
        # points would claim a sweep that never ran.
        swept = any(len({row["load"] for row in points_rows if row["series"] == names[key]}) > 1
                    for key in series)
        loads = sorted({row["load"] for row in points_rows},
                       key=lambda text: next(r["load_order"] for r in points_rows
                                             if r["load"] == text))
        at = f"{axis_words} {', '.join(loads)}"
        if all(load.endswith(CAPACITY_LOAD) for load in loads):
            # Capacity cases: each ran at the capacity its search found (the suite's rate,
            # often inf, is only where the search started).
            unit = "req/s" if axis == "request_rate" else "requests in flight"
            at = "its capacity (" + ", ".join(
                load.removesuffix(CAPACITY_LOAD).strip() for load in loads) + f" {unit})"
        if all(p.context.get("bench_dataset_name") == "timed_trace"
               for members in series.values() for p in members):
            # A replayed trace sends at its own timestamps: its request rate is not a load.
            at = "the trace's own arrival times"
        for metric, label in (("output_throughput", "output tok/s"),
                              ("p99_ttft_ms", "p99 TTFT (ms)"),
                              ("median_tpot_ms", "median TPOT (ms)"),
                              ("request_throughput", "req/s")):
            if metric not in schema.types:
                continue
            chart_id = f"load-{_slug(suite)}-{axis}-{metric}"
            # Each chart carries the fields it draws and shows, no more: a page of many
            # sessions is megabytes otherwise.
            keep = ("series", "workload", "load", "load_order", metric, "runs", "session",
                    "run_id")
            rows = [{k: row.get(k) for k in keep} for row in points_rows]
            if all(row.get(metric) is None for row in rows):
                unmeasured.append(label)
                continue
            if not swept:
                view.add(chart_id, _single_load_bars(rows, metric, f"{prefix}{label} at {at}"),
                         f"{label}, median over repeats, one bar per configuration: the suite "
                         f"does not sweep load, every configuration ran at {at} only.")
                continue
            view.add(chart_id, charts.spec(
                rows, title=f"{prefix}{label} against {axis.replace('_', ' ')}",
                mark={"type": "line", "point": {"size": 70}, "tooltip": True},
                encoding={
                    "x": x,
                    "y": charts.field(metric, "quantitative", label),
                    "color": charts.series_colour(len(series)),
                    "tooltip": charts.tooltips("series", "workload", "load", metric, "runs",
                                               "session", "run_id"),
                },
            ), f"{label}, median over repeats, against the {axis_words} "
               "the suite sweeps; one line per configuration.")
        if unmeasured:
            view.notes.append(f"{suite}: no run measured {', '.join(unmeasured)} (a pooling "
                              "model has no output tokens, say): those charts are not drawn.")
        crowded = charts.too_many_series(
            len(series), f"{suite}, against {axis_words}",
            "filter on a setting in the legend, or pick fewer sessions (or blend them)")
        if crowded:
            view.notes.append(crowded)
    if not points:
        view.notes.append("No valid measurement in this selection.")
    queue_charts(connection, schema, selection, view)
    return view


def _single_load_bars(rows: Sequence[Mapping[str, Any]], metric: str,
                      title: str) -> dict[str, Any]:
    """One bar per series, for a suite whose series each ran at a single load."""
    count = len({row["series"] for row in rows})
    label = dict(POINT_METRICS)[metric]
    return charts.spec(
        rows, title=title,
        height=max(charts.SMALL_HEIGHT // 2, 28 * count),
        mark={"type": "bar", "tooltip": True},
        encoding={
            "y": charts.field("series", "nominal", "configuration", sort="-x",
                              axis={"labelLimit": 520, "title": None}),
            "x": charts.field(metric, "quantitative", label),
            "color": charts.series_colour(count),
            "tooltip": charts.tooltips("series", "workload", "load", metric, "runs",
                                       "session", "run_id"),
        })
