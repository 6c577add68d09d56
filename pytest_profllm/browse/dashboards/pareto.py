"""The Pareto dashboard: per-user speed (or p99 TTFT) against throughput per GPU, with the
frontier per model and device, and the best configurations under a p99 TTFT bound."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import Table, View
from pytest_profllm.browse.dashboards.common import (
    Point,
    _cell,
    _column,
    _finite,
    _point_row,
    _series,
    _slug,
    load_axis,
    load_points,
    series_names,
    workload_columns,
)
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.results.table import TABLE, quote


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
