"""What the dashboards share: the points they draw (one per case and session, medians over
its repeats, valid measurements only), the series those points make and their names, and the
small SQL and chart helpers more than one dashboard uses."""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pytest_profllm.browse.filters import Schema, Selection
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
# How a capacity case's load is labelled: the capacity its search found, not its suite's rate.
CAPACITY_LOAD = "(capacity)"
INF_LABEL = "inf"
# Sessions drawn apart (each its own series) on one page, at most, and the points they may
# bring (whole sessions are drawn: the newest until this many points are reached).
MAX_SESSIONS = 12
MAX_POINTS = 1500
# A latest-dashboard bar of a case whose runs did not pass, where no gate verdict is on it.
CASE_FAILED = "case failed"
# The regression gate's verdicts (gates/regression.py), each always the same colour.
_VERDICT_COLOURS = {
    "domain": ["regressed", "improved", "unchanged", "no-baseline", "not-judged", "not gated",
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
        capacity = point.metrics.get("capacity")
        if capacity is not None:
            # A capacity case's figures are its probe's at the capacity it found, whatever
            # rate (inf) its suite names: that load is the one it ran at.
            row["load"] = f"{capacity:.3g} {CAPACITY_LOAD}"
            row["load_order"] = float(capacity)
    return row


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


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


def _listed(names: Sequence[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
