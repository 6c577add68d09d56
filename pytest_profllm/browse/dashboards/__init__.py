"""The dashboards: prepared charts and tables over valid measurements, each answering one
question people open the results with. Every dashboard is a function that takes a sqlite3
connection and a selection (browse/filters.py) and returns what the page shows, so the data
path is tested without a browser; browse/plugin.py serves them at
`/{database}/-/dashboards/{name}`. One module each (`load`, `pareto`, `latest`, `history`,
`scaling`, `capacity`, `precision`); what they share, the points and their series, is
`common`'s.

Rules every chart keeps:
- points are valid measurements (the `measured_runs` view) of the selected sessions: the
  latest of each suite by default; repeats are combined with a median, and sessions are never
  blended unless asked (`blend=1`): each selected session is its own series;
- a series is named by the axes that differ between the series drawn, never by a cut case id;
- load is the axis the suite sweeps (request rate or concurrency), an infinite rate shown as
  `inf` at the end of an ordinal axis rather than left out.
"""

from __future__ import annotations

# Re-exported: pages and tests name them as this package's (`dashboards.View`).
from pytest_profllm.browse.dashboard_view import Dashboard, Table, View
from pytest_profllm.browse.dashboards.capacity import capacity_dashboard
from pytest_profllm.browse.dashboards.common import (
    CAPACITY_METRIC,
    CASE_FAILED,
    INF_LABEL,
    MAX_POINTS,
    MAX_SESSIONS,
    POINT_METRICS,
    Point,
    load_axis,
    load_points,
    series_names,
    server_axes,
    workload_columns,
)
from pytest_profllm.browse.dashboards.history import HISTORY_METRICS, history_dashboard
from pytest_profllm.browse.dashboards.latest import MAX_CHANGE_BARS, latest_dashboard
from pytest_profllm.browse.dashboards.load import MAX_SUITES, load_dashboard
from pytest_profllm.browse.dashboards.pareto import pareto_dashboard, pareto_frontier
from pytest_profllm.browse.dashboards.precision import precision_dashboard
from pytest_profllm.browse.dashboards.scaling import scaling_dashboard

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

__all__ = [
    "BY_NAME",
    "CAPACITY_METRIC",
    "CASE_FAILED",
    "DASHBOARDS",
    "HISTORY_METRICS",
    "INF_LABEL",
    "MAX_CHANGE_BARS",
    "MAX_POINTS",
    "MAX_SESSIONS",
    "MAX_SUITES",
    "POINT_METRICS",
    "Dashboard",
    "Point",
    "Table",
    "View",
    "capacity_dashboard",
    "history_dashboard",
    "latest_dashboard",
    "load_axis",
    "load_dashboard",
    "load_points",
    "pareto_dashboard",
    "pareto_frontier",
    "precision_dashboard",
    "scaling_dashboard",
    "series_names",
    "server_axes",
    "workload_columns",
]
