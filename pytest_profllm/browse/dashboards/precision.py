"""The precision-analysis dashboard: what a configuration's numeric precision (dtype,
quantization, KV-cache dtype) gives up in accuracy for what it gains in output throughput and
in cost per million output tokens. One chart per model and accuracy task and metric for
each, its frontier dashed.

Accuracy is lm-eval's metric as `kind: accuracy` cases record it in their results (the `acc`
column of the `measured_runs` view for a multiple-choice task, else `exact_match`), per task
(`accuracy_task`): two tasks' scores are never one figure.
Throughput and cost come from the serve cases of the same server: a configuration is one
effective server configuration (`runtime_server_key`, the hash the plan gives it), on one
engine and device, whichever suite measured it.
"""

from __future__ import annotations

import re
import sqlite3
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import Table, View
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import MEASURED_RUNS, quote

# Where accuracy lives: lm-eval's metrics among an accuracy case's results (fractions, higher
# is better), in this order: a run that has the first is read by it.
ACCURACY_COLUMNS = ("acc", "exact_match")
NO_ACCURACY = ("No accuracy cases in this database: add a `kind: accuracy` case "
               "(the manual: Writing suites, Accuracy).")
NO_ACCURACY_SELECTED = ("No accuracy cases in this selection: add a `kind: accuracy` case "
                        "(the manual: Writing suites, Accuracy), or pick the sessions that ran "
                        "one.")
# The settings a precision study sweeps, by which its configurations are named.
PRECISION_AXES = ("server_dtype", "server_quantization", "server_kv_cache_dtype")
COST_COLUMN = "cost_usd_per_million_output_tokens"
SIMULATED = " on the simulated engine (whose accuracy checks the path, not a model)"
PRICE_COLUMN = "cost_gpu_hour_price_usd"
_COLUMNS = ["model", "configuration", "task", "metric", "accuracy", "output_throughput",
            "usd_per_million_output_tokens", "gpu_hour_price_usd", "frontier", "device",
            "engine", "accuracy_run_id", "throughput_run_id", "cost_run_id"]
# The load a serve case was measured at: a configuration's loads are told apart by them.
_LOAD_COLUMNS = ("bench_request_rate", "bench_max_concurrency")


def frontier(rows: Sequence[Mapping[str, Any]], x: str, y: str,
             x_higher_is_better: bool) -> list[Mapping[str, Any]]:
    """The rows no other row beats on both: better `x` (higher, or lower) and higher `y`."""
    candidates = [r for r in rows if r.get(x) is not None and r.get(y) is not None]
    candidates.sort(key=lambda r: (-r[x] if x_higher_is_better else r[x], -r[y]))
    best: float | None = None
    kept: list[Mapping[str, Any]] = []
    for row in candidates:
        if best is None or row[y] > best:
            kept.append(row)
            best = row[y]
    return sorted(kept, key=lambda r: r[x])


def accuracy_missing(connection: sqlite3.Connection, schema: Schema,
                     selection: Selection) -> str | None:
    """Why there is no accuracy to draw (None: there is some): no such column in the
    database, or no run of the selection measured it. Only the selection's runs are read (by
    the session index): looking through a whole million-run table took seconds."""
    accuracy = accuracy_of(schema)
    if accuracy is None:
        return NO_ACCURACY
    where, params = selection.where(schema)
    found = connection.execute(
        f"SELECT 1 FROM [{MEASURED_RUNS}] WHERE {where} "
        f"AND {accuracy} IS NOT NULL LIMIT 1", params).fetchone()
    return None if found is not None else NO_ACCURACY_SELECTED


def accuracy_of(schema: Schema) -> str | None:
    """The SQL expression of a run's accuracy (its first metric of ACCURACY_COLUMNS); None
    where the database has none of them."""
    present = [quote(name) for name in ACCURACY_COLUMNS if name in schema.types]
    if not present:
        return None
    return present[0] if len(present) == 1 else f"coalesce({', '.join(present)})"


def configurations(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                   with_accuracy: bool) -> list[dict[str, Any]]:
    """One row per configuration of the selection's valid runs and accuracy task and metric
    (one row with neither where it has no accuracy): the accuracy, the highest output
    throughput any of its loads reached and the lowest cost per million output tokens of its
    loads.

    Each figure is the figure of the run it names: the median run (the lower of the middle
    two) of its load's or task's repeats in one session. A median over several sessions, or
    over two tasks' metrics, is no run's figure and no task's score."""
    have = schema.types
    where, params = selection.where(schema)
    server = ("coalesce(runtime_server_key, configuration)" if "runtime_server_key" in have
              else "configuration")
    metrics = [name for name in ACCURACY_COLUMNS if with_accuracy and name in have]

    def column(name: str) -> str:
        return quote(name) if name in have else "NULL"

    cursor = connection.execute(
        f"SELECT {server} AS server, engine, device, server_model AS model, configuration, "
        + "".join(f"{column(axis)} AS {quote(axis)}, " for axis in PRECISION_AXES)
        + "session_id, timestamp, workload, "
        + "".join(f"{column(c)} AS {quote(c)}, " for c in _LOAD_COLUMNS)
        + f"{column('output_throughput')} AS output_throughput, {column(COST_COLUMN)} AS cost, "
        f"{column(PRICE_COLUMN)} AS price, {column('accuracy_task')} AS task, run_id"
        + "".join(f", {quote(m)} AS {quote(m)}" for m in metrics)
        + f" FROM [{MEASURED_RUNS}] WHERE {where}", params)
    names = [d[0] for d in cursor.description]
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for found in cursor:
        row = dict(zip(names, found, strict=True))
        runs[(row["server"], row["engine"], row["device"])].append(row)
    rows = []
    for members in runs.values():
        first = max(members, key=lambda m: str(m["timestamp"] or ""))
        loads: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for member in members:
            loads[(member["session_id"], member["workload"],
                   *(member[c] for c in _LOAD_COLUMNS))].append(member)
        fastest = max(filter(None, (_median_run(load, "output_throughput")
                                    for load in loads.values())),
                      key=lambda m: m["output_throughput"], default=None)
        cheapest = min(filter(None, (_median_run(load, "cost") for load in loads.values())),
                       key=lambda m: m["cost"], default=None)
        base = {
            "model": str(first["model"] or "-"), "device": first["device"],
            "engine": first["engine"], "id": str(first["configuration"] or ""),
            **{axis: first[axis] for axis in PRECISION_AXES},
            "task": None, "metric": None, "accuracy": None, "accuracy_run_id": None,
            "output_throughput": (round(fastest["output_throughput"], 1) if fastest
                                  else None),
            "throughput_run_id": fastest["run_id"] if fastest else None,
            "usd_per_million_output_tokens": round(cheapest["cost"], 4) if cheapest else None,
            "gpu_hour_price_usd": cheapest["price"] if cheapest else None,
            "cost_run_id": cheapest["run_id"] if cheapest else None,
            "frontier": "",
        }
        scores = _accuracies(members, metrics)
        rows += [{**base, **score} for score in scores] or [base]
    return rows


def _median_run(runs: Sequence[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The run whose `metric` is the median of the runs' (the lower of the middle two)."""
    measured = sorted((r for r in runs if r[metric] is not None), key=lambda r: r[metric])
    return measured[(len(measured) - 1) // 2] if measured else None


def _accuracies(runs: Sequence[dict[str, Any]], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """One score per accuracy task and metric of a configuration's runs: the median run of
    its newest session's repeats (a run is read by the first of `metrics` it has, as
    `accuracy_of` does)."""
    by_score: dict[tuple[Any, str], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for run in runs:
        metric = next((m for m in metrics if run[m] is not None), None)
        if metric is not None:
            by_score[(run["task"], metric)][run["session_id"]].append(
                {**run, "accuracy": run[metric]})
    scores = []
    for (task, metric), sessions in sorted(by_score.items(), key=lambda item: str(item[0])):
        newest = max(sessions.values(), key=lambda s: max(str(r["timestamp"] or "") for r in s))
        median = _median_run(newest, "accuracy")
        if median is not None:
            scores.append({"task": task, "metric": metric, "accuracy": median["accuracy"],
                           "accuracy_run_id": median["run_id"]})
    return scores


def _name(row: Mapping[str, Any], axes: Sequence[str]) -> str:
    parts = [f"{axis.removeprefix('server_')}={_shown(row[axis])}" for axis in axes]
    return " · ".join(parts) or row["id"].rsplit("::", 1)[-1]


def _shown(value: Any) -> str:
    return "default" if value is None else str(value)


def precision_dashboard(connection: sqlite3.Connection, schema: Schema, selection: Selection,
                        args: Mapping[str, str]) -> View:
    """Accuracy against output throughput and against cost per million output tokens, per
    configuration, a chart per model with its frontier; and every configuration in a table."""
    view = View()
    missing = accuracy_missing(connection, schema, selection)
    with_accuracy = missing is None
    if missing is not None:
        view.notes.append(missing)
    rows = configurations(connection, schema, selection, with_accuracy)
    facets: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        facets[(row["model"], str(row["device"]), str(row["engine"]))].append(row)
    devices = {device for _, device, _ in facets}
    engines = {engine for _, _, engine in facets}
    scores = {(r["task"], r["metric"]) for r in rows if r["metric"] is not None}
    for (model, device, engine), members in sorted(facets.items()):
        # Named by the precision settings that differ within the model, else all of them
        # (the same in each of its task's charts).
        differing = [a for a in PRECISION_AXES
                     if len({_shown(m[a]) for m in members}) > 1] or list(PRECISION_AXES)
        named = _distinct([(m, _name(m, differing)) for m in members])
        where = model if len(devices) == 1 else f"{model} on {device}"
        slug = where if len(engines) == 1 else f"{where} {engine}"
        if len(engines) > 1:
            where += f" ({engine})"
        # A chart per accuracy task and metric: one task's acc and another's exact_match
        # on one axis are no one score (their median was drawn as one "accuracy").
        for task, metric in sorted(scores, key=str) if with_accuracy else ():
            of_score = [m for m in named if (m["task"], m["metric"]) == (task, metric)]
            if not of_score:
                continue
            title, name = (where, slug) if len(scores) == 1 else (
                f"{where}, {_shown(task)} {metric}", f"{slug} {_shown(task)} {metric}")
            _charts(view, title, re.sub(r"[^A-Za-z0-9]+", "_", name), of_score,
                    simulated=engine == "sim", metric=str(metric))
    if with_accuracy and rows and not view.charts:
        view.notes.append("No configuration in this selection has both an accuracy and a "
                          "throughput measurement: nothing to draw.")
    if with_accuracy and rows and not any(r["usd_per_million_output_tokens"] for r in rows):
        view.notes.append("No cost per million output tokens in this selection: run the "
                          "suites with --profllm-gpu-hour-price to draw accuracy against cost.")
    for row in rows:
        row.pop("id", None)
    rows.sort(key=lambda r: (r["model"], _shown(r["task"]), str(r["metric"]),
                             -(r["accuracy"] or 0), -(r["output_throughput"] or 0)))
    view.tables.append(Table(
        "Configurations: accuracy, peak output throughput and lowest cost per million output "
        "tokens", _COLUMNS, [{c: r.get(c) for c in _COLUMNS} for r in rows],
        empty="No valid measurement in this selection."))
    return view


def _distinct(named: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    """The rows with their `configuration` name, made distinct where the settings drawn do
    not tell two apart (the suite's own configuration name is added)."""
    # A configuration has a row per accuracy task: its rows are one configuration.
    counts: dict[str, set[str]] = defaultdict(set)
    for row, name in named:
        counts[name].add(row["id"])
    out = []
    for row, name in named:
        if len(counts[name]) > 1:
            name = f"{name} ({row['id'].rsplit('::', 1)[-1]})"
        row["configuration"] = name
        out.append(row)
    return out


def _accuracy_scale(values: list[float]) -> dict[str, Any]:
    """The accuracy axis: zoomed on the values, at least 0.1 wide (equal accuracies, as the
    simulated engine's, made a zero-wide axis whose one tick read "0"), within [0, 1] where
    they are fractions."""
    if not values:
        return {"zero": False}
    low, high = min(values), max(values)
    pad = max(0.05, (high - low) * 0.1)
    low, high = low - pad, high + pad
    if max(values) <= 1:
        low, high = max(0.0, low), min(1.0, high)
    return {"domain": [round(low, 4), round(high, 4)], "zero": False}


def _charts(view: View, where: str, slug: str, members: list[dict[str, Any]],
            simulated: bool, metric: str) -> None:
    """Accuracy against throughput, and against cost where there is one, for one model."""
    drawn = [m for m in members if m["accuracy"] is not None]
    y = charts.field("accuracy", "quantitative", f"{metric} (higher is better)",
                     scale=_accuracy_scale([m["accuracy"] for m in drawn]),
                     axis={"format": ".3~f"})
    for x_field, x_title, higher, chart in (
        ("output_throughput", "peak output tok/s", True, "throughput"),
        ("usd_per_million_output_tokens", "USD per million output tokens", False, "cost"),
    ):
        points = [m for m in drawn if m[x_field] is not None]
        if not points:
            continue
        line = frontier(points, x_field, "accuracy", x_higher_is_better=higher)
        for point in points:
            if any(point is f for f in line):
                point["frontier"] = " + ".join(filter(None, (point["frontier"], chart)))
        x = charts.field(x_field, "quantitative", x_title, scale={"zero": False})
        count = len({p["configuration"] for p in points})
        layers: list[dict[str, Any]] = [
            {"data": {"values": charts.rows_as_values(
                [{x_field: f[x_field], "accuracy": f["accuracy"]} for f in line])},
             "mark": {"type": "line", "strokeDash": [6, 4], "color": "#444"},
             "encoding": {"x": x, "y": y}},
            {"mark": {"type": "point", "filled": True, "size": 110, "tooltip": True},
             "encoding": {"x": x, "y": y,
                          "color": {**charts.series_colour(count),
                                    "field": "configuration"},
                          "tooltip": charts.tooltips(
                              "configuration", "task", "metric", "accuracy",
                              "output_throughput", "usd_per_million_output_tokens",
                              "gpu_hour_price_usd", "accuracy_run_id", "throughput_run_id",
                              "cost_run_id")}},
        ]
        values = [{k: v for k, v in p.items() if k != "id"} for p in points]
        better = "Up and right" if higher else "Up and left"
        # The title names the model only: the axes say the rest, and a longer title is cut
        # in a half-width chart. The legend goes under the chart, where long names fit.
        spec = charts.spec(values, title=where, layers=layers)
        spec["config"]["legend"] = {**spec["config"]["legend"], "orient": "bottom",
                                    "columns": 1}
        view.add(f"precision-{chart}-{slug}", spec,
                 f"{where}{SIMULATED if simulated else ''}: accuracy against "
                 f"{x_title}, each point one configuration; the dashed line is the frontier "
                 f"(no other configuration is better on both axes). {better} is better."
                 + ("" if higher else " Each cost is at the GPU-hour price its run was "
                                      "priced with (in the tooltip)."))
        crowded = charts.too_many_series(count, f"{where}, {chart}",
                                         "filter on a precision setting or a suite")
        if crowded:
            view.notes.append(crowded)
