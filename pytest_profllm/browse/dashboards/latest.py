"""The latest dashboard: the latest session against the one before it, what changed and by
how much, and what the regression gate called regressed."""

from __future__ import annotations

import math
import sqlite3
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import Table, View
from pytest_profllm.browse.dashboards.common import (
    _VERDICT_COLOURS,
    CAPACITY_METRIC,
    CASE_FAILED,
    POINT_METRICS,
    Point,
    _finite,
    _listed,
    _slug,
    _table_exists,
    load_points,
    series_names,
)
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import MEASURED_RUNS, TABLE

# The most cases the latest dashboard's change charts draw (besides every regressed one).
MAX_CHANGE_BARS = 40


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
                                  CASE_FAILED if failed else "not gated"),
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
        of_metric = [{**r, "bar_label": _bar_label(r)} for r in of_metric]
        y = charts.field("case", "nominal", "", sort="-x",
                         axis={"labelLimit": 520, "title": None})
        x = charts.field("change_percent", "quantitative", f"change of {label} (%)")
        colour = charts.field("gate", "nominal", "regression", scale=_VERDICT_COLOURS)
        view.add(f"latest-change-{metric}", charts.spec(
            of_metric, title=f"{label}: change from the previous session",
            height=max(160, 26 * len(of_metric)),
            layers=[
                {"mark": {"type": "bar", "tooltip": True},
                 "encoding": {"y": y, "x": x, "color": colour,
                              "tooltip": charts.tooltips("case", "previous", "latest",
                                                         "change_percent", "gate", "status",
                                                         "run_id")}},
                # A change of 0 % is a bar of no width: a mark at its end keeps an
                # `unchanged` verdict in sight.
                {"mark": {"type": "point", "shape": "diamond", "filled": True, "size": 90},
                 "encoding": {"y": y, "x": x, "color": colour}},
                *[{"transform": [{"filter": f"datum.change_percent {test} 0"}],
                   "mark": {"type": "text", "align": align, "dx": dx},
                   "encoding": {"y": y, "x": x, "text": {"field": "bar_label"}}}
                  for test, align, dx in ((">=", "left", 9), ("<", "right", -9))],
            ]),
            f"{which}: the change of its median {label} from the previous session "
            f"({worse} is worse), with the figure and the regression gate's decision beside it. "
            "Red: the regression gate called it regressed; black: the case failed (its figures "
            "measured, but not passed) and no gate judged it.",
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
                          "no regression decision is on them, never drawn as a passed case's "
                          "change; runs that are not a valid measurement are left out.")
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


def _bar_label(row: dict[str, Any]) -> str:
    change = row.get("change_percent")
    figure = f"{change:+.1f} %" if change is not None else "no change"
    return f"{figure}, {row.get('gate')}"


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
    title = "Regressed (the regression gate's decisions in the latest session)"
    if not _table_exists(connection, "regression_verdicts"):
        view.tables.append(Table(title, _REGRESSED_COLUMNS, [],
                                 empty="No regression decisions in this database."))
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
                    "gate": verdict["verdict"] or "not gated"}
    flagged = sorted((v for v in verdicts if v["verdict"] == "regressed"),
                     key=lambda v: -abs(v["change_percent"] or 0))
    # "Nothing regressed" is a verdict: where no gate ran, say that instead.
    view.tables.append(Table(title, _REGRESSED_COLUMNS, flagged,
                             empty=("Nothing regressed by the regression gate's decisions."
                                    if verdicts else
                                    "No regression gate ran in this session (no "
                                    "--profllm-baseline, or no regression: block): nothing was "
                                    "judged.")))
    for metric in dict.fromkeys(v["metric"] for v in flagged):
        of_metric = [v for v in verdicts if v["metric"] == metric]
        x = charts.field("change_percent", "quantitative", f"change of {metric} (%)")
        y = charts.field("case_id", "nominal", "", sort="x",
                         axis={"labelLimit": 520, "title": None})
        view.add(f"latest-gate-{_slug(metric)}", charts.spec(
            of_metric, title=f"{metric}: the regression gate's decisions against the baseline",
            height=max(160, 26 * len({v["case_id"] for v in of_metric})), layers=[
                {"mark": {"type": "rule", "color": "#777"},
                 "encoding": {"y": y, "x": charts.field("ci_low_percent", "quantitative",
                                                        f"change of {metric} (%)"),
                              "x2": {"field": "ci_high_percent"}}},
                {"mark": {"type": "point", "filled": True, "size": 80, "tooltip": True},
                 "encoding": {"y": y, "x": x,
                              "color": charts.field("gate", "nominal", "regression",
                                                    scale=_VERDICT_COLOURS),
                              "tooltip": charts.tooltips(
                                  "case_id", "metric", "baseline", "value", "change_percent",
                                  "interval_percent", "baseline_session", "run_id")}},
            ]),
            f"Every regression decision of the latest session on {metric}, one point per run: "
            "its change from the baseline (%) with the gate's interval. Red: regressed.")


def _percent(fraction: Any) -> float | None:
    value = _finite(fraction)
    return round(100 * value, 1) if value is not None else None


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
