"""The dashboards: prepared charts and tables over valid measurements, each answering one
question people open the results with. Every function here takes a sqlite3 connection and a
selection (browse/filters.py) and returns what the page shows, so the data path is tested
without a browser; browse/plugin.py serves them at `/{database}/-/dashboards/{name}`.

Rules every chart keeps:
- points are valid measurements (the `measured_runs` view) of the selected sessions: the
  latest of each suite by default; repeats are combined with a median, and sessions are never
  blended unless asked (`blend=1`): each selected session is its own series;
- a series is named by the axes that differ between the series drawn, never by a cut case id;
- load is the axis the suite sweeps (request rate or concurrency), an infinite rate shown as
  `inf` at the end of an ordinal axis rather than left out.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pytest_profllm.browse import charts

# Re-exported (`X as X`): pages and tests name them as this module's (`dashboards.View`).
from pytest_profllm.browse.dashboard_view import Dashboard as Dashboard
from pytest_profllm.browse.dashboard_view import Table as Table
from pytest_profllm.browse.dashboard_view import View as View
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.browse.precision_dashboard import precision_dashboard
from pytest_profllm.browse.queue_chart import queue_charts
from pytest_profllm.results.table import MEASURED_RUNS, TABLE, quote

# The columns that can name a series, in the order their values are written.
_NAMING = ("suite", "server_model", "engine", "device")
_WORKLOAD_NAMING = ("bench_dataset_name", "bench_random_input_len", "bench_random_output_len")
# The load a suite sweeps: the x axis, never part of a series' key.
_LOAD_COLUMNS = ("bench_request_rate", "bench_max_concurrency")
# Server arguments that never name a series: they differ with every run or say nothing.
_NOT_AXES = {"server_model", "server_api_key", "server_port", "server_host", "server_seed"}
# The metrics a point carries (median over the repeats of one case in one session).
POINT_METRICS = (
    ("output_throughput", "output tok/s"),
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("p99_ttft_ms", "p99 TTFT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
    ("p99_tpot_ms", "p99 TPOT (ms)"),
)
# The latest dashboard compares these too: a capacity case's headline (its throughput is at
# whatever load its search ended, so no like-for-like figure).
CAPACITY_METRIC = ("capacity", "capacity (req/s or concurrent requests)")
HISTORY_METRICS = (*POINT_METRICS, ("median_itl_ms", "median ITL (ms)"),
                   ("p99_e2el_ms", "p99 E2EL (ms)"))
INF_LABEL = "inf"
# The load dashboard draws the most recent suites of a selection, this many at most.
MAX_SUITES = 10
# Sessions drawn apart (each its own series) on one page, at most, and the points they may
# bring (whole sessions are drawn: the newest until this many points are reached).
MAX_SESSIONS = 12
MAX_POINTS = 1500
# A latest-dashboard bar of a case whose runs did not pass, where no gate verdict is on it.
CASE_FAILED = "case failed"
# The regression gate's verdicts (gates/verdict.py), each always the same colour.
_VERDICT_COLOURS = {
    "domain": ["regressed", "improved", "unchanged", "no-baseline", "not-judged", "no verdict",
               CASE_FAILED],
    "range": ["#c62828", "#2e7d32", "#1565c0", "#ef6c00", "#6a1b9a", "#9e9e9e", "#212121"],
}
_INF_ORDER = 1e300


@dataclass(frozen=True)
class Point:
    """One case in one session (or in all selected sessions, blended): medians over repeats."""

    series_key: tuple[Any, ...]
    configuration: str
    workload: str
    session: str
    rate: float | None
    concurrency: int | None
    metrics: Mapping[str, float | None]
    runs: int
    run_id: str
    context: Mapping[str, Any]
    # When its newest run started: run ids are not in time order within a session.
    timestamp: str = ""
    # Its runs whose status is not `passed` (a threshold or SLO missed, the gate's verdict):
    # valid measurements, but the latest dashboard marks such a case.
    not_passed: int = 0


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _rate(value: Any) -> float | None:
    """A request rate: a number, infinity (all at once) or None (not set)."""
    if isinstance(value, int | float):
        return float(value)
    return None


def load_points(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                notes: list[str] | None = None) -> list[Point]:
    """The points of the selection: one per case (configuration, workload, engine, device)
    and session (unless blended), medians over its repeats, valid measurements only.

    Sessions drawn apart are at most MAX_SESSIONS, the newest that have points: "all
    sessions" of a big database would otherwise be a page of a hundred megabytes. They are
    looked for newest first, a growing chunk at a time, each chunk found by its index."""
    conditions, params = selection.conditions(schema)
    chosen = selection.session_ids(schema)
    if selection.blend or (chosen is not None and not selection.sessions):
        # Blended, or the default (the latest session of each suite): one query.
        return _points(connection, schema, selection, *selection.where(schema))
    sessions = chosen if chosen is not None else [s.session_id for s in schema.sessions]
    points: list[Point] = []
    found: list[str] = []
    dropped = False
    at, size = 0, 2
    while at < len(sessions) and len(found) < MAX_SESSIONS and len(points) < MAX_POINTS:
        chunk = sessions[at:at + size]
        at += size
        marks = ", ".join("?" for _ in chunk)
        rank = {session: index for index, session in enumerate(chunk)}
        for point in sorted(_points(connection, schema, selection,
                                    f"session_id IN ({marks}) AND {conditions}",
                                    [*chunk, *params]), key=lambda p: rank[p.session]):
            if point.session not in found:
                if len(found) == MAX_SESSIONS or (found and len(points) >= MAX_POINTS):
                    dropped = True
                    continue
                found.append(point.session)
            points.append(point)
        # The next chunk: the sessions the points still wanted need, at the rate the sessions
        # so far brought them, and no more than twice the sessions still wanted (doubling
        # while none brought any). A fixed 16 computed 6,883 points at 100,000 runs to draw
        # 1,721; sized by points alone, a filter that leaves 8 points a session read 197
        # sessions at a million runs to draw 10 more.
        per_session = len(points) / len(found) if found else 0.0
        size = min(512, max(2, min(math.ceil((MAX_POINTS - len(points)) / per_session) + 1,
                                   2 * (MAX_SESSIONS - len(found))))
                   if per_session else size * 2)
    if dropped and notes is not None:
        notes.append(f"More sessions match than a page draws apart: the {len(found)} newest "
                     f"with valid measurements are drawn (at most {MAX_SESSIONS} sessions, "
                     f"{MAX_POINTS} points); pick sessions, or blend them, for others.")
    return points


def workload_columns(schema: Schema) -> list[str]:
    """The benchmark settings that tell one workload from another, load aside: the usual
    dataset and lengths, and every other benchmark setting a suite sweeps (the image sizes of a
    multimodal suite, say), so two workloads are never drawn as one series."""
    have = schema.types
    swept = [c for c in schema.axes if c.startswith("bench_") and c not in _LOAD_COLUMNS]
    return list(dict.fromkeys(c for c in (*_WORKLOAD_NAMING, *swept) if c in have))


def _points(connection: sqlite3.Connection, schema: Schema, selection: Selection,
            where: str, params: Sequence[Any]) -> list[Point]:
    have = schema.types
    metrics = [name for name, _ in (*POINT_METRICS, CAPACITY_METRIC) if name in have]
    session = "'(blended)'" if selection.blend else "session_id"
    workload_naming = workload_columns(schema)
    throughput = "(" + (" OR ".join(f"{quote(m)} IS NOT NULL" for m in (
        "output_throughput", "request_throughput") if m in have) or "0") + ")"
    group = ["suite", "configuration", "workload", "engine", "device", *_LOAD_COLUMNS,
             *workload_naming]
    if not selection.blend:
        group.append("session_id")
    sql = (
        f"SELECT {', '.join(quote(c) for c in group if c != 'session_id')}, {session} AS "
        f"session, server_model, "
        + ", ".join(f"median({quote(m)}) AS {quote(m)}" for m in metrics)
        + ", count(*) AS runs, max(run_id) AS run_id, max(timestamp) AS newest, "
        "sum(status IS NOT 'passed') AS not_passed "
        f"FROM [{MEASURED_RUNS}] WHERE {where} "
        # A pooling (embedding) model has no output tokens: a point is any throughput.
        f"AND {throughput} GROUP BY {', '.join(quote(c) for c in group)}"
    )
    cursor = connection.execute(sql, list(params))
    names = [d[0] for d in cursor.description]
    rows = [dict(zip(names, row, strict=True)) for row in cursor]
    axes = server_axes(connection, schema, [row["run_id"] for row in rows])
    points = []
    for row in rows:
        context = {c: row.get(c) for c in (*_NAMING, *workload_naming) if c in row}
        context.update(axes.get(row["configuration"], {}))
        if not selection.blend:
            context["session"] = row["session"]
        workload_key = tuple(row.get(c) for c in workload_naming)
        points.append(Point(
            series_key=(row["suite"], row["configuration"], row["engine"], row["device"],
                        row["session"], workload_key),
            configuration=row["configuration"] or "",
            workload=row["workload"] or "",
            session=row["session"] or "",
            rate=_rate(row["bench_request_rate"]),
            concurrency=row["bench_max_concurrency"],
            metrics={m: _finite(row[m]) for m in metrics},
            runs=row["runs"],
            run_id=row["run_id"],
            context=context,
            timestamp=str(row["newest"] or ""),
            not_passed=int(row["not_passed"] or 0),
        ))
    return points


def server_axes(connection: sqlite3.Connection, schema: Schema,
                run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per configuration, the values of the swept server arguments (constant within one
    configuration), read from one run of each: the points' names come from them."""
    columns = [c for c in schema.axes if c.startswith("server_") and c not in _NOT_AXES]
    if not columns or not run_ids:
        return {}
    values: dict[str, dict[str, Any]] = {}
    for start in range(0, len(run_ids), 500):
        chunk = list(run_ids[start:start + 500])
        for row in connection.execute(
            f"SELECT configuration, {', '.join(quote(c) for c in columns)} FROM [{TABLE}] "
            f"WHERE run_id IN ({', '.join('?' for _ in chunk)})", chunk
        ):
            values.setdefault(row[0], {}).update(
                {c: v for c, v in zip(columns, row[1:], strict=True) if not _is_json(v)})
    return values


def _is_json(value: Any) -> bool:
    return isinstance(value, str) and value[:1] in ("{", "[")


def series_names(
    contexts: Mapping[tuple[Any, ...], Mapping[str, Any]],
) -> dict[tuple[Any, ...], str]:
    """Each series named by the values that differ between the series drawn together: the
    suite first where several are drawn, then, within its suite, the axes that differ there
    (so one suite's arguments never show up in another's names)."""
    suites = {_cell(context.get("suite")) for context in contexts.values()}
    by_suite: dict[str, dict[tuple[Any, ...], Mapping[str, Any]]] = defaultdict(dict)
    for key, context in contexts.items():
        by_suite[_cell(context.get("suite"))][key] = context
    names = {}
    for group in by_suite.values():
        differing = _differing(group.values(), exclude={"suite"})
        for key, context in group.items():
            parts = [_label(k, context.get(k)) for k in differing]
            if len(suites) > 1:
                parts.insert(0, str(context.get("suite")))
            if len(parts) <= (1 if len(suites) > 1 else 0):
                # Alone in its suite: the suite's own name for the configuration.
                parts.append(str(key[1]).rsplit("::", 1)[-1])
            names[key] = " · ".join(parts)
    # Two series the differing values cannot tell apart still get distinct names.
    seen: dict[str, int] = defaultdict(int)
    for key in sorted(names, key=str):
        seen[names[key]] += 1
        if seen[names[key]] > 1:
            names[key] = f"{names[key]} ({key[1]})"
    return names


def _differing(contexts: Iterable[Mapping[str, Any]], exclude: set[str]) -> list[str]:
    group = list(contexts)
    keys = sorted({k for context in group for k in context} - exclude)
    differing = [k for k in keys if len({_cell(context.get(k)) for context in group}) > 1]
    # The settings that differ come before the session: a legend cuts a long name at its
    # end, and the setting is what tells a configuration apart.
    ordered = [k for k in (*_NAMING, *_WORKLOAD_NAMING) if k in differing]
    ordered += [k for k in differing if k not in ordered and k != "session"]
    return ordered + (["session"] if "session" in differing else [])


def _cell(value: Any) -> str:
    return json.dumps(value, default=str)


def _label(column: str, value: Any) -> str:
    if column in ("suite", "server_model", "engine", "device"):
        return str(value)
    if column == "bench_max_concurrency" and value is None:
        return "no concurrency cap"
    name = column.removeprefix("server_").removeprefix("bench_").removeprefix("random_")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{name}={value}"


def _load_value(value: float | None) -> tuple[str, float]:
    if value is None:
        return "-", -1.0
    if math.isinf(value):
        return INF_LABEL, _INF_ORDER
    text = str(int(value)) if float(value).is_integer() else f"{value:g}"
    return text, float(value)


def load_axis(points: Sequence[Point]) -> str:
    """Which load the points of one series sweep: `request_rate` or `max_concurrency`."""
    rates = {p.rate for p in points}
    concurrencies = {p.concurrency for p in points}
    if len(rates) > 1:
        return "request_rate"
    if len(concurrencies) > 1:
        return "max_concurrency"
    only = next(iter(points))
    finite_rate = only.rate is not None and math.isfinite(only.rate)
    return "max_concurrency" if only.concurrency is not None and not finite_rate else "request_rate"


def _series(points: Iterable[Point]) -> dict[tuple[Any, ...], list[Point]]:
    """The points by series. A series holds one point per load: where two of its points
    share a load, they are two workloads no recorded setting tells apart, and each workload
    is its own series (named by it) rather than one line drawn up and down between them."""
    grouped: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
    for point in points:
        grouped[point.series_key].append(point)
    split: dict[tuple[Any, ...], list[Point]] = defaultdict(list)
    for key, members in grouped.items():
        if len({(p.rate, p.concurrency) for p in members}) == len(members):
            split[key] = members
            continue
        for point in members:
            split[(*key, point.workload)].append(replace(
                point, series_key=(*key, point.workload),
                context={**point.context, "workload": point.workload}))
    drawn: dict[tuple[Any, ...], list[Point]] = {}
    for key, members in split.items():
        drawn.update(_one_load_axis(key, members))
    return drawn


def _one_load_axis(
    key: tuple[Any, ...], members: list[Point]
) -> dict[tuple[Any, ...], list[Point]]:
    """A series that sweeps both loads (rates at a concurrency cap, or a rate sweep beside a
    concurrency sweep at rate inf) as series that sweep one: the points of each concurrency
    that sweep the rate, then the rest by rate, each named by the load it holds. Drawn as one
    line against either load, it went up and down between the points of the other."""
    if len({p.rate for p in members}) < 2 or len({p.concurrency for p in members}) < 2:
        return {key: members}
    out: dict[tuple[Any, ...], list[Point]] = {}
    by_concurrency: dict[int | None, list[Point]] = defaultdict(list)
    for point in members:
        by_concurrency[point.concurrency].append(point)
    rest: dict[float | None, list[Point]] = defaultdict(list)
    for concurrency, group in by_concurrency.items():
        if len({p.rate for p in group}) > 1:
            named = (*key, "max_concurrency", concurrency)
            out[named] = [replace(p, series_key=named, context={
                **p.context, "bench_max_concurrency": concurrency}) for p in group]
        else:
            for point in group:
                rest[point.rate].append(point)
    for rate, group in rest.items():
        named = (*key, "request_rate", rate)
        out[named] = [replace(p, series_key=named, context={
            **p.context, "bench_request_rate": rate}) for p in group]
    return out


def _point_row(point: Point, name: str, x_column: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"series": name, "workload": point.workload,
                           "configuration": point.configuration, "session": point.session,
                           "runs": point.runs, "run_id": point.run_id}
    row.update({k: (round(v, 3) if v is not None else None) for k, v in point.metrics.items()})
    if x_column is not None:
        raw = point.rate if x_column == "request_rate" else (
            float(point.concurrency) if point.concurrency is not None else None)
        row["load"], row["load_order"] = _load_value(raw)
    return row


# -- the dashboards ------------------------------------------------------------------------


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


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def pareto_frontier(rows: Sequence[Mapping[str, Any]], x: str, y: str,
                    y_higher_is_better: bool) -> list[Mapping[str, Any]]:
    """The points no other point beats on both: higher `x`, and higher (or lower) `y`."""
    candidates = [r for r in rows if r.get(x) is not None and r.get(y) is not None]
    candidates.sort(key=lambda r: (-r[x], -r[y] if y_higher_is_better else r[y]))
    frontier: list[Mapping[str, Any]] = []
    best: float | None = None
    for row in candidates:
        value = row[y]
        if best is None or (value > best if y_higher_is_better else value < best):
            frontier.append(row)
            best = value
    return sorted(frontier, key=lambda r: r[x])


def _gpus(connection: sqlite3.Connection, schema: Schema, run_ids: Sequence[str]) -> dict[str, int]:
    parts = [c for c in ("server_tensor_parallel_size", "server_pipeline_parallel_size",
                         "server_data_parallel_size") if c in schema.types]
    if not parts or not run_ids:
        return {}
    product = " * ".join(f"max(coalesce({quote(c)}, 1), 1)" for c in parts)
    found: dict[str, int] = {}
    for start in range(0, len(run_ids), 500):
        chunk = list(run_ids[start:start + 500])
        found.update({run_id: int(gpus) for run_id, gpus in connection.execute(
            f"SELECT run_id, {product} FROM [{TABLE}] WHERE run_id IN "
            f"({', '.join('?' for _ in chunk)})", chunk)})
    return found


def pareto_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                     args: Mapping[str, str]) -> View:
    """Per-user speed (or p99 TTFT) against throughput per GPU, with the frontier; and the
    best configuration under a p99 TTFT bound."""
    view = View()
    y_choice = args.get("y", "per_user")
    if y_choice not in ("per_user", "p99_ttft_ms"):
        y_choice = "per_user"
    bound_text = args.get("max_p99_ttft_ms", "").strip()
    bound = _finite(_number(bound_text))
    view.inputs["y"] = ("y axis", y_choice, ["per_user", "p99_ttft_ms"])
    view.inputs["max_p99_ttft_ms"] = ("p99 TTFT bound (ms)", bound_text, [])
    points = load_points(connection, schema, selection, view.notes)
    run_ids = [p.run_id for p in points]
    gpus = _gpus(connection, schema, run_ids)
    servers = (_column(connection, "runtime_server_key", run_ids)
               if "runtime_server_key" in schema.types else {})
    # A configuration is a server: two suites measured on the same server (one server_key in
    # one session, the same settings) are one configuration, whatever suite or workload.
    configurations: dict[tuple[Any, ...], list[tuple[Point, str]]] = defaultdict(list)
    contexts: dict[tuple[Any, ...], dict[str, Any]] = {}
    suites: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    aliases: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    workload_naming = set(workload_columns(schema)) | {"suite", "workload"}
    for key, members in _series(points).items():
        axis = load_axis(members)
        for point in members:
            server = servers.get(point.run_id)
            settings = {k: v for k, v in point.context.items() if k not in workload_naming}
            config_key = ((server, point.session, _cell(sorted(settings.items())))
                          if server else key)
            # Named by its first configuration's own name where nothing else tells it apart.
            config_key = aliases.setdefault(config_key, (config_key, point.configuration))
            configurations[config_key].append((point, axis))
            contexts.setdefault(config_key, settings)
            suites[config_key].add(str(point.context.get("suite")))
    for config_key, context in contexts.items():
        context["suite"] = "+".join(sorted(suites[config_key]))
    names = series_names(contexts)
    rows = []
    for config_key, members_ in configurations.items():
        for point, axis in members_:
            row = _point_row(point, names[config_key], axis)
            row["config_key"] = config_key
            count = gpus.get(point.run_id, 1)
            output = point.metrics.get("output_throughput")
            tpot = point.metrics.get("median_tpot_ms")
            row["model"] = str(point.context.get("server_model") or "-")
            row["device"] = str(point.context.get("device") or "-")
            row["gpus"] = count
            row["output_tok_per_s_per_gpu"] = round(output / count, 2) if output else None
            row["per_user_tok_per_s"] = round(1000.0 / tpot, 2) if tpot else None
            row["meets_bound"] = bound is None or (
                row.get("p99_ttft_ms") is not None and row["p99_ttft_ms"] <= bound)
            row["bound"] = "meets the bound" if row["meets_bound"] else "misses the bound"
            rows.append(row)
    y_field = "per_user_tok_per_s" if y_choice == "per_user" else "p99_ttft_ms"
    y_title = ("per-user output tok/s (1000 / median TPOT)" if y_choice == "per_user"
               else "p99 TTFT (ms)")
    # A frontier is per model and device: a small model on one GPU beats a large one on both
    # axes, and one frontier over both says nothing about either. One chart each.
    facets: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        facets[(row["model"], row["device"])].append(row)
    for (model, device), of_facet in sorted(facets.items()):
        if not any(row["output_tok_per_s_per_gpu"] for row in of_facet):
            view.notes.append(f"{model} on {device}: no output throughput (a pooling model, "
                              "say): no Pareto chart.")
            continue
        # Named within the chart: what its own configurations differ by.
        local = series_names({row["config_key"]: contexts[row["config_key"]]
                              for row in of_facet})
        of_facet = [{**{k: v for k, v in row.items() if k != "config_key"},
                     "series": local[row["config_key"]]} for row in of_facet]
        frontier = pareto_frontier(of_facet, "output_tok_per_s_per_gpu", y_field,
                                   y_higher_is_better=y_choice == "per_user")
        for row in of_facet:
            row["on_frontier"] = any(row is f for f in frontier)
        count = len({row["series"] for row in of_facet})
        x = charts.field("output_tok_per_s_per_gpu", "quantitative", "output tok/s per GPU")
        y = charts.field(y_field, "quantitative", y_title)
        layers: list[dict[str, Any]] = [
            {"data": {"values": charts.rows_as_values(frontier)},
             "mark": {"type": "line", "strokeDash": [6, 4], "color": "#444"},
             "encoding": {"x": x, "y": y}},
            {"mark": {"type": "point", "filled": True, "size": 90, "tooltip": True},
             "encoding": {
                 "x": x, "y": y,
                 "color": charts.series_colour(count),
                 **({"shape": charts.field("bound", "nominal", f"p99 TTFT <= {bound_text} ms")}
                    if bound is not None else {}),
                 "tooltip": charts.tooltips("series", "workload", "load",
                                            "output_tok_per_s_per_gpu", y_field, "p99_ttft_ms",
                                            "gpus", "session", "run_id")}},
        ]
        where = f"{model} on {device}"
        view.add(f"pareto-{_slug(model)}-{_slug(device)}", charts.spec(
            # The axes say what is drawn: a title naming them too is cut in a half-width chart.
            of_facet, title=f"Pareto: {where}",
            height=460 if len(facets) == 1 else charts.HEIGHT, layers=layers),
            f"{where}: each point is one configuration at one load. The dashed line is the "
            "frontier of this model on this device: no other of its points is better on both "
            "axes. " + ("Up and right is better." if y_choice == "per_user"
                        else "Down and right is better."))
        crowded = charts.too_many_series(
            count, f"Pareto, {where}",
            "filter on suite or a server setting, or pick fewer sessions")
        if crowded:
            view.notes.append(crowded)
    ranked = sorted((r for r in rows if r["meets_bound"] and r["output_tok_per_s_per_gpu"]),
                    key=lambda r: -r["output_tok_per_s_per_gpu"])
    title = ("Best configurations under p99 TTFT <= " + bound_text + " ms" if bound is not None
             else "Configurations by output tok/s per GPU (set a p99 TTFT bound above)")
    view.tables.append(_ranked_table(title, ranked[:25]))
    if bound_text and bound is None:
        view.notes.append(f"p99 TTFT bound {bound_text!r} is not a number: ignored.")
    if not rows:
        view.notes.append("No valid measurement in this selection.")
    return view


def _ranked_table(title: str, rows: Sequence[Mapping[str, Any]]) -> Table:
    columns = ["rank", "series", "model", "workload", "load", "output_tok_per_s_per_gpu",
               "output_throughput", "p99_ttft_ms", "median_tpot_ms", "gpus", "run_id"]
    return Table(title, columns,
                 [{"rank": i + 1, **{c: r.get(c) for c in columns[1:]}}
                  for i, r in enumerate(rows)],
                 empty="No configuration meets the bound in this selection.")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# The most cases the latest dashboard's change charts draw (besides every regressed one).
MAX_CHANGE_BARS = 40
_GPU_COUNT = re.compile(r"\b\d+x ")


def scaling_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                      args: Mapping[str, str]) -> View:
    """Tensor-parallel scaling: throughput per GPU, and efficiency against the smallest
    tensor-parallel size of the same model, workload, load and other arguments."""
    view = View()
    if "server_tensor_parallel_size" not in schema.types:
        view.notes.append("No tensor_parallel_size column in this database.")
        return view
    points = load_points(connection, schema, selection, view.notes)
    tp_of = {run_id: tp for run_id, tp in _column(connection, "server_tensor_parallel_size",
                                                  [p.run_id for p in points]).items()}
    groups: dict[tuple[Any, ...], list[tuple[int, Point]]] = defaultdict(list)
    for point in points:
        tp = int(tp_of.get(point.run_id) or 1)
        context = {k: v for k, v in point.context.items()
                   if k != "server_tensor_parallel_size"}
        # The device column counts the GPUs (`2x NVIDIA H100 ...`), which tp 2 doubles: the
        # model of GPU is what must be the same.
        if isinstance(context.get("device"), str):
            context["device"] = _GPU_COUNT.sub("", context["device"])
        key = (json.dumps(context, sort_keys=True, default=str), point.workload, point.rate,
               point.concurrency)
        groups[key].append((tp, point))
    scaled = {key: members for key, members in groups.items()
              if len({tp for tp, _ in members}) > 1}
    if not scaled:
        view.notes.append("No configuration in this selection was run at more than one "
                          "tensor_parallel_size with everything else the same.")
        return view
    contexts = {key: {**dict(json.loads(key[0])), "workload": key[1]}
                for key in scaled}
    names = series_names(contexts)
    crowded = charts.too_many_series(
        len(scaled), "Scaling", "filter on model, device, a server setting or the workload")
    if crowded:
        view.notes.append(crowded)
    rows = []
    for key, members in scaled.items():
        base_tp, base = min(members, key=lambda m: m[0])
        base_output = base.metrics.get("output_throughput")
        for tp, point in sorted(members, key=lambda m: m[0]):
            output = point.metrics.get("output_throughput")
            efficiency = (100.0 * (output / tp) / (base_output / base_tp)
                          if output and base_output else None)
            rows.append({"series": names[key], "tensor_parallel_size": tp,
                         "output_throughput": output,
                         "output_tok_per_s_per_gpu": round(output / tp, 2) if output else None,
                         "efficiency_percent": round(efficiency, 1) if efficiency else None,
                         "session": point.session, "run_id": point.run_id})
    tp_field = charts.field("tensor_parallel_size", "ordinal", "tensor parallel size")
    view.add("scaling-efficiency", charts.spec(
        rows, title="Scaling efficiency: throughput per GPU against the smallest tp",
        layers=[
            {"mark": {"type": "rule", "strokeDash": [4, 4], "color": "#888"},
             "encoding": {"y": {"datum": 100}}},
            {"mark": {"type": "line", "point": {"size": 70}, "tooltip": True},
             "encoding": {"x": tp_field,
                          "y": charts.field("efficiency_percent", "quantitative",
                                            "efficiency (%)"),
                          "color": charts.field("series", "nominal", "configuration"),
                          "tooltip": charts.tooltips("series", "tensor_parallel_size",
                                                     "efficiency_percent",
                                                     "output_tok_per_s_per_gpu", "run_id")}},
        ]), "100 % is perfect scaling: each GPU added serves as much as the first.")
    view.add("scaling-throughput", charts.spec(
        rows, title="Output throughput against tensor parallel size",
        mark={"type": "bar", "tooltip": True},
        encoding={"x": tp_field,
                  "xOffset": charts.field("series", "nominal", "configuration"),
                  "y": charts.field("output_throughput", "quantitative", "output tok/s"),
                  "color": charts.field("series", "nominal", "configuration")}),
        "Total output throughput at each tensor parallel size.")
    return view


def _column(connection: sqlite3.Connection, column: str,
            run_ids: Sequence[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for start in range(0, len(run_ids), 500):
        chunk = list(run_ids[start:start + 500])
        found.update(dict(connection.execute(
            f"SELECT run_id, {quote(column)} FROM [{TABLE}] WHERE run_id IN "
            f"({', '.join('?' for _ in chunk)})", chunk).fetchall()))
    return found


def _table_exists(connection: sqlite3.Connection, name: str) -> bool:
    return connection.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                              (name,)).fetchone() is not None


def history_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                      args: Mapping[str, str]) -> View:
    """One case over time: every valid run, coloured by its gate verdict, change points
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
        row["gate"] = row["gate"] or "no verdict"
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
             "color": charts.field("gate", "nominal", "gate verdict", scale=_VERDICT_COLOURS),
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
             "Every valid run of the case; colour: the regression gate's verdict on this "
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


def _measured_cases(connection: sqlite3.Connection, session_id: str, conditions: str,
                    params: Sequence[Any]) -> set[tuple[Any, ...]]:
    """The cases (as the dashboard tells them apart) a session measured validly."""
    return {tuple(row) for row in connection.execute(
        f"SELECT DISTINCT configuration, workload, engine, device FROM [{MEASURED_RUNS}] "
        f"WHERE session_id = ? AND output_throughput IS NOT NULL AND {conditions}",
        [session_id, *params])}


@dataclass(frozen=True)
class _Pair:
    """The session the latest dashboard shows, the one it compares with, and the newer
    sessions it passed over for that: none of their valid measurements was of a case the
    latest measured (all failed, say)."""

    latest: str | None
    previous: str | None = None
    skipped: tuple[str, ...] = ()
    measured: bool = True  # whether the latest session has any valid measurement


def _sessions_in_order(connection: sqlite3.Connection, schema: Schema,
                       selection: Selection) -> _Pair:
    """The session to show and the newest one before it that ran any of the same suites
    and measured one of its cases validly: a session where every case failed compares
    with nothing."""
    chosen = [s for s in selection.sessions if s != "all"]
    sessions = list(schema.sessions)
    latest = next((s for s in sessions if s.session_id == chosen[0]), None) if chosen else (
        sessions[0] if sessions else None)
    if latest is None:
        return _Pair(None)
    if len(chosen) > 1:
        return _Pair(latest.session_id, chosen[1])
    conditions, params = selection.conditions(schema)
    cases = _measured_cases(connection, latest.session_id, conditions, params)
    if not cases:
        return _Pair(latest.session_id, measured=False)
    skipped: list[str] = []
    for older in sessions:
        if older.last < latest.first and set(older.suites) & set(latest.suites):
            if cases & _measured_cases(connection, older.session_id, conditions, params):
                return _Pair(latest.session_id, older.session_id, tuple(skipped))
            skipped.append(older.session_id)
    return _Pair(latest.session_id, None, tuple(skipped))


def latest_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                     args: Mapping[str, str]) -> View:
    """The latest session against the one before it: what changed, by how much, and what the
    regression gate called regressed."""
    view = View()
    pair = _sessions_in_order(connection, schema, selection)
    latest, previous = pair.latest, pair.previous
    if latest is None:
        view.notes.append("No session in this database.")
        return view
    pinned = Selection(values=selection.values, low=selection.low, high=selection.high,
                       text=selection.text, match_any=selection.match_any,
                       sessions=[latest] + ([previous] if previous else []))
    points = load_points(connection, schema, pinned)
    view.counted = Selection(values=selection.values, low=selection.low, high=selection.high,
                             text=selection.text, match_any=selection.match_any,
                             sessions=[latest])
    by_case: dict[tuple[Any, ...], dict[str, Point]] = defaultdict(dict)
    for point in points:
        by_case[(point.configuration, point.workload, point.series_key[2],
                 point.series_key[3])][point.session] = point
    contexts = {}
    for key, sessions in by_case.items():
        point = sessions.get(latest) or next(iter(sessions.values()))
        contexts[key] = {k: v for k, v in point.context.items() if k != "session"} | {
            "workload": point.workload}
    names = series_names(contexts)
    gate = _gate_verdicts(connection, [p.run_id for p in points if p.session == latest])
    metrics = [*POINT_METRICS, *([CAPACITY_METRIC] if "capacity" in schema.types else [])]
    rows: list[dict[str, Any]] = []
    failed_cases = 0
    for key, sessions in by_case.items():
        now, before = sessions.get(latest), sessions.get(previous or "")
        # A capacity case is compared by its capacity: its throughput and latencies are at
        # whatever load its search ended (a capacity that fell 44 % was charted as +6.6 %).
        capacity_case = any(p.metrics.get("capacity") is not None for p in (now, before) if p)
        failed = [which for which, p in (("latest", now), ("previous", before))
                  if p is not None and p.not_passed]
        failed_cases += bool(failed)
        for metric, label in metrics:
            if capacity_case != (metric == "capacity"):
                continue
            value = now.metrics.get(metric) if now else None
            old = before.metrics.get(metric) if before else None
            change = 100.0 * (value - old) / old if value is not None and old else None
            verdict = gate.get((now.run_id, metric)) if now else None
            rows.append({"case": names[key], "metric": metric, "label": label,
                         "previous": _rounded(old), "latest": _rounded(value),
                         "change_percent": round(change, 1) if change is not None else None,
                         "status": (f"failed in the {' and the '.join(failed)} session"
                                    if failed else "passed"),
                         "gate": (verdict[0] if verdict else
                                  CASE_FAILED if failed else "no verdict"),
                         "gate_change_percent": (round(100 * verdict[1], 1)
                                                 if verdict and verdict[1] is not None
                                                 else None),
                         "run_id": now.run_id if now else None})
    gated = {metric for (_, metric) in gate}
    # With no earlier session there is no change to draw: no empty chart, no table headed
    # "against session -"; the note below says why.
    compared = {r["metric"] for r in rows if r["change_percent"] is not None}
    shown = [m for m, _ in metrics if previous is not None and m in compared | {
        r["metric"] for r in rows if r["gate"] == "regressed"} and (
        m in gated or m in ("output_throughput", "capacity"))]
    for metric in shown:
        # A bar is a change (or a regression): a case of one session alone drew an empty
        # row, an earlier session's case under the latest session's heading.
        of_metric = [r for r in rows if r["metric"] == metric and (
            r["change_percent"] is not None or r["gate"] == "regressed")]
        label = dict(metrics)[metric]
        worse = "lower" if metric.endswith("throughput") or metric == "capacity" else "higher"
        # Hundreds of cases made a chart thousands of pixels tall, above the regressed
        # table: the gate's regressions and the largest changes are the bars worth drawing.
        cases = len(of_metric)
        of_metric = sorted(of_metric, key=lambda r: (r["gate"] != "regressed",
                                                     -abs(r["change_percent"] or 0)))
        of_metric = of_metric[:max(MAX_CHANGE_BARS, sum(r["gate"] == "regressed"
                                                        for r in of_metric))]
        which = ("One bar per case" if len(of_metric) == cases else
                 f"The {len(of_metric)} of {cases} cases that changed most or regressed (the "
                 "table below lists more, the largest change first), one bar each")
        view.add(f"latest-change-{metric}", charts.spec(
            of_metric, title=f"{label}: change from the previous session",
            height=max(160, 26 * len(of_metric)),
            mark={"type": "bar", "tooltip": True},
            encoding={
                "y": charts.field("case", "nominal", "", sort="-x",
                                  axis={"labelLimit": 520, "title": None}),
                "x": charts.field("change_percent", "quantitative", f"change of {label} (%)"),
                "color": charts.field("gate", "nominal", "gate verdict", scale=_VERDICT_COLOURS),
                "tooltip": charts.tooltips("case", "previous", "latest", "change_percent",
                                           "gate", "status", "run_id")}),
            f"{which}: the change of its median {label} from the previous session "
            f"({worse} is worse). Red: the regression gate called it regressed; black: the "
            "case failed (its figures measured, but not passed) and no gate judged it.",
            # A bar's label names its whole case: in half the page, the labels left the bars
            # a few pixels.
            wide=True)
    _regressed(connection, schema, selection, latest, view)
    changed = sorted((r for r in rows if r["change_percent"] is not None),
                     key=lambda r: -abs(r["change_percent"]))
    if previous is not None:
        view.tables.append(Table(
            f"Every change against session {previous}",
            ["case", "metric", "previous", "latest", "change_percent", "gate", "status",
             "run_id"],
            changed[:200], empty="No case ran in both sessions."))
    passed_over = (f" Passed over, with no valid measurement of these cases: "
                   f"{_listed(pair.skipped)}." if pair.skipped else "")
    if failed_cases and previous is not None:
        view.notes.append(f"{failed_cases} case(s) failed in the latest or the previous "
                          f"session: their changes are marked {CASE_FAILED!r} (black) where "
                          "no gate verdict is on them, never drawn as a passed case's change; "
                          "runs that are not a valid measurement are left out.")
    if not pair.measured:
        view.notes.append(f"Session {latest} has no valid measurement (every case failed, or "
                          "measured the client): nothing to compare.")
    elif previous is None:
        view.notes.append(f"Session {latest} has no earlier session of the same suites with a "
                          f"valid measurement of its cases: nothing to compare.{passed_over}")
    else:
        view.notes.append(f"Session {latest} (the latest) against session {previous}, the "
                          "newest before it that measured the same cases; pick others in the "
                          "filters (the first session chosen is compared with the second)."
                          + passed_over)
    return view


# What the regressed table shows of each verdict, in this order.
_REGRESSED_COLUMNS = ["case_id", "metric", "baseline", "value", "change_percent",
                      "interval_percent", "tolerance_percent", "baseline_session", "run_id"]


def _regressed(connection: sqlite3.Connection, schema: Schema, selection: Selection,
               session: str, view: View) -> None:
    """Every `regressed` verdict the gate stored for the session's runs (each repeat, any
    metric: capacity, a mean, a percentile), by how much and against which baseline, and one
    chart per regressed metric of all the session's verdicts on it. Read from
    `regression_verdicts` itself: the session-to-session points above hold one run per case
    and only the point metrics, and missed the rest."""
    title = "Regressed (the regression gate's verdicts in the latest session)"
    if not _table_exists(connection, "regression_verdicts"):
        view.tables.append(Table(title, _REGRESSED_COLUMNS, [],
                                 empty="No regression gate verdicts in this database."))
        return
    conditions, params = selection.conditions(schema)
    names = ("case_id", "metric", "verdict", "baseline", "value", "change", "ci_low",
             "ci_high", "tolerance", "baseline_session", "run_id")
    verdicts = [dict(zip(names, row, strict=True)) for row in connection.execute(
        f"SELECT {', '.join(names)} FROM regression_verdicts WHERE run_id IN "
        f"(SELECT run_id FROM [{TABLE}] WHERE session_id = ? AND {conditions}) "
        "ORDER BY case_id, metric, run_id", [session, *params])]
    for verdict in verdicts:
        low, high = _percent(verdict["ci_low"]), _percent(verdict["ci_high"])
        verdict |= {"baseline": _rounded(_finite(verdict["baseline"])),
                    "value": _rounded(_finite(verdict["value"])),
                    "change_percent": _percent(verdict["change"]),
                    "ci_low_percent": low, "ci_high_percent": high,
                    "interval_percent": (f"[{low}, {high}]" if low is not None
                                         and high is not None else None),
                    "tolerance_percent": _percent(verdict["tolerance"]),
                    "gate": verdict["verdict"] or "no verdict"}
    flagged = sorted((v for v in verdicts if v["verdict"] == "regressed"),
                     key=lambda v: -abs(v["change_percent"] or 0))
    # "Nothing regressed" is a verdict: where no gate ran, say that instead.
    view.tables.append(Table(title, _REGRESSED_COLUMNS, flagged,
                             empty="Nothing regressed by the gate's verdicts." if verdicts
                             else "No regression gate ran in this session (no "
                             "--profllm-baseline, or no regression: block): nothing was judged."))
    for metric in dict.fromkeys(v["metric"] for v in flagged):
        of_metric = [v for v in verdicts if v["metric"] == metric]
        x = charts.field("change_percent", "quantitative", f"change of {metric} (%)")
        y = charts.field("case_id", "nominal", "", sort="x",
                         axis={"labelLimit": 520, "title": None})
        view.add(f"latest-gate-{_slug(metric)}", charts.spec(
            of_metric, title=f"{metric}: the gate's verdicts against the baseline",
            height=max(160, 26 * len({v["case_id"] for v in of_metric})), layers=[
                {"mark": {"type": "rule", "color": "#777"},
                 "encoding": {"y": y, "x": charts.field("ci_low_percent", "quantitative",
                                                        f"change of {metric} (%)"),
                              "x2": {"field": "ci_high_percent"}}},
                {"mark": {"type": "point", "filled": True, "size": 80, "tooltip": True},
                 "encoding": {"y": y, "x": x,
                              "color": charts.field("gate", "nominal", "gate verdict",
                                                    scale=_VERDICT_COLOURS),
                              "tooltip": charts.tooltips(
                                  "case_id", "metric", "baseline", "value", "change_percent",
                                  "interval_percent", "baseline_session", "run_id")}},
            ]),
            f"Every verdict of the latest session on {metric}, one point per run: its change "
            "from the baseline (%) with the gate's interval. Red: regressed.")


def _percent(fraction: Any) -> float | None:
    value = _finite(fraction)
    return round(100 * value, 1) if value is not None else None


def _listed(names: Sequence[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _rounded(value: float | None) -> float | None:
    """A figure to four significant digits: what a table of changes needs."""
    if value is None or value == 0:
        return value
    return round(value, max(0, 3 - math.floor(math.log10(abs(value)))))


def _gate_verdicts(connection: sqlite3.Connection,
                   run_ids: Sequence[str]) -> dict[tuple[str, str], tuple[str, float | None]]:
    if not run_ids or not _table_exists(connection, "regression_verdicts"):
        return {}
    found = {}
    for start in range(0, len(run_ids), 500):
        chunk = list(run_ids[start:start + 500])
        for run_id, metric, verdict, change in connection.execute(
            "SELECT run_id, metric, verdict, change FROM regression_verdicts WHERE run_id IN "
            f"({', '.join('?' for _ in chunk)})", chunk
        ):
            found[(run_id, metric)] = (verdict, _finite(change))
    return found


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
    view.add("capacity", charts.spec(values, title="Capacity per configuration",
                                     height=max(220, 36 * len(values)), layers=layers),
             "Bars: the highest load that met every SLO; black rules: the bracket between "
             "the last load that met them and the first that missed.")
    if not values:
        view.notes.append("No valid capacity measurement in this selection.")
    return view


DASHBOARDS: tuple[Dashboard, ...] = (
    Dashboard("load", "Throughput and latency against load",
              "How did throughput and latency scale with load, per configuration?",
              load_dashboard),
    Dashboard("pareto", "Pareto: per-user speed against throughput per GPU",
              "Which configuration is best under a p99 TTFT bound?", pareto_dashboard),
    Dashboard("latest", "Latest session against the one before",
              "What regressed against the last session, and by how much?", latest_dashboard),
    Dashboard("history", "One case over time",
              "When did a case change, and did the gate see it?", history_dashboard),
    Dashboard("scaling", "Tensor-parallel scaling",
              "How well does a model scale across GPUs?", scaling_dashboard),
    Dashboard("capacity", "Capacity per configuration",
              "How much load does each configuration carry under its SLOs?",
              capacity_dashboard),
    Dashboard("precision", "Precision: accuracy against throughput and cost",
              "What does a lower precision cost in accuracy, for how much throughput?",
              precision_dashboard),
)
BY_NAME = {dashboard.name: dashboard for dashboard in DASHBOARDS}

