"""The scaling dashboard: throughput per GPU, and efficiency against the smallest
tensor-parallel size of the same model, workload, load and other arguments."""

from __future__ import annotations

import json
import re
import sqlite3
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.browse.dashboard_view import View
from pytest_profllm.browse.dashboards.common import (
    Point,
    _column,
    load_points,
    series_names,
)
from pytest_profllm.browse.filters import Schema, Selection

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
