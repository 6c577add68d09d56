"""The canned queries of the Datasette plugin, as SQL over `benchmark_runs` (the charts are
the dashboards', browse/dashboards.py).

Queries that aggregate combine repeats and history with a median (`median()`, which the
plugin registers on every connection), never a sum, over valid measurements only. They read
the columns of one covering index (`table.SUMMARY_COLUMNS`), never the 400-column rows, so
they answer in milliseconds at 100,000 runs.
"""

from __future__ import annotations

from typing import Any

from pytest_profllm.results.landing import HEADLINE_METRICS
from pytest_profllm.results.table import MEASURED_RUNS, TABLE

# Points, comparisons and bests come from valid measurements only: the store's view of them
# (results/table.py), which the covering index serves.
# A series: one configuration on one engine and device, at one input/output length.
SERIES = (
    "configuration || ' [' || engine || ', ' || device || ', in ' || "
    "coalesce(bench_random_input_len, '-') || ' / out ' || coalesce(bench_random_output_len, '-')"
    " || ']'"
)
# The covering index's column order (table.SUMMARY_COLUMNS): grouping needs no sort.
SERIES_KEY = "configuration, engine, device, bench_random_input_len, bench_random_output_len"
LATEST_SESSION = f"(SELECT session_id FROM {TABLE} ORDER BY timestamp DESC LIMIT 1)"


def _number(param: str, default: str = "1e308") -> str:
    # A canned query's parameters arrive as text, empty when the form was not filled in.
    return f"CAST(coalesce(nullif(:{param}, ''), '{default}') AS REAL)"


# The headline metrics the comparisons take medians of (results/landing.py's, with their
# rounding here): output throughput first, the others in the landing table's order.
_HEADLINE = sorted(
    (metric for metric in HEADLINE_METRICS if metric.compared_digits is not None),
    key=lambda metric: metric.column != "output_throughput",
)
# Side by side in the session comparison.
_SIDE_BY_SIDE = [metric for metric in _HEADLINE
                 if metric.column in ("output_throughput", "p99_ttft_ms", "p99_tpot_ms")]


def _per_session(alias: str, param: str, default: str) -> str:
    figures = ", ".join(f"median({metric.column}) AS {metric.name}" for metric in _HEADLINE)
    return (
        f"{alias} AS (SELECT configuration, workload, engine, device, {figures}, "
        f"count(*) AS runs FROM {MEASURED_RUNS} WHERE session_id = coalesce(nullif(:{param}, ''), "
        f"{default}) GROUP BY configuration, workload, engine, device)"
    )


_PREVIOUS_SESSION = (
    f"(SELECT session_id FROM {TABLE} WHERE timestamp < (SELECT min(timestamp) FROM {TABLE} "
    f"WHERE session_id = {LATEST_SESSION}) ORDER BY timestamp DESC LIMIT 1)"
)
_COMPARE_SESSIONS = (
    "WITH "
    + _per_session("a", "session_a", _PREVIOUS_SESSION)
    + ", "
    + _per_session("b", "session_b", LATEST_SESSION)
    + ", cases AS (SELECT configuration, workload, engine, device FROM a UNION "
    "SELECT configuration, workload, engine, device FROM b) "
    "SELECT cases.configuration, cases.workload, cases.engine, cases.device, "
    + ", ".join(
        f"round(a.{metric.name}, {metric.compared_digits}) AS a_{metric.name}, "
        f"round(b.{metric.name}, {metric.compared_digits}) AS b_{metric.name}"
        for metric in _SIDE_BY_SIDE
    )
    + ", round(b.output_tok_per_s / a.output_tok_per_s, 3) AS b_over_a_throughput, "
    "a.runs AS a_runs, b.runs AS b_runs FROM cases "
    "LEFT JOIN a USING (configuration, workload, engine, device) "
    "LEFT JOIN b USING (configuration, workload, engine, device) "
    "ORDER BY cases.configuration, cases.workload"
)
_COMPARE_RUNS = " UNION ALL ".join(
    f"SELECT '{column}' AS metric, (SELECT {column} FROM {TABLE} WHERE run_id = :run_a) AS a, "
    f"(SELECT {column} FROM {TABLE} WHERE run_id = :run_b) AS b"
    for column in ("status", "case_id", "timestamp", "engine", "device", "server_model",
                   *(metric.column for metric in _HEADLINE), "median_itl_ms", "p99_e2el_ms",
                   "completed", "failed", "failed_verdicts")
)
_BEST_UNDER_BOUND = (
    "WITH points AS (SELECT server_model, configuration, workload, engine, device, "
    "median(output_throughput) AS tp, median(p99_ttft_ms) AS ttft, median(p99_tpot_ms) AS tpot, "
    f"count(*) AS runs FROM {MEASURED_RUNS} WHERE output_throughput IS NOT NULL "
    f"GROUP BY {SERIES_KEY}, workload, bench_request_rate, bench_max_concurrency, server_model) "
    # SQLite's bare columns: configuration and workload come from the row with max(tp).
    "SELECT server_model, engine, device, round(max(tp), 2) AS output_tok_per_s, "
    "configuration, workload, round(ttft, 2) AS p99_ttft_ms, round(tpot, 3) AS p99_tpot_ms, runs "
    f"FROM points WHERE ttft <= {_number('max_p99_ttft_ms')} "
    f"AND tpot <= {_number('max_p99_tpot_ms')} "
    "GROUP BY server_model, engine, device ORDER BY server_model, engine, device"
)
_LATEST_PER_CONFIGURATION = (
    "SELECT configuration, workload, engine, device, max(timestamp) AS timestamp, run_id, "
    "status, round(output_throughput, 2) AS output_tok_per_s, "
    "round(p99_ttft_ms, 2) AS p99_ttft_ms, round(p99_tpot_ms, 3) AS p99_tpot_ms "
    f"FROM {MEASURED_RUNS} GROUP BY {SERIES_KEY}, workload "
    "ORDER BY configuration, workload, engine, device"
)
_NOT_PASSED = (
    "SELECT configuration, workload, engine, device, max(timestamp) AS timestamp, run_id, "
    "status, failed_verdicts, message, count(*) AS runs_not_passed "
    f"FROM {TABLE} WHERE status IN ('failed', 'error', 'invalid') "
    "GROUP BY configuration, workload, engine, device ORDER BY timestamp DESC"
)


def _latency_columns() -> str:
    return ", ".join(f"round(median_{m}_ms, 2) AS median_{m}_ms, round(p99_{m}_ms, 2) AS "
                     f"p99_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el"))


CANNED_QUERIES: dict[str, dict[str, Any]] = {
    "compare_sessions": {
        "title": "Compare two sessions side by side",
        "description": "Each case's medians in session A and session B (default: the two most "
        "recent sessions), and B's throughput as a fraction of A's.",
        "sql": _COMPARE_SESSIONS,
    },
    "compare_runs": {
        "title": "Compare two runs side by side",
        "description": "The headline figures of two run_ids, one metric a row.",
        "sql": _COMPARE_RUNS,
    },
    "best_configuration": {
        "title": "Best configuration per model under a TTFT or TPOT bound",
        "description": "For each model, engine and device: the configuration and load with the "
        "highest median output throughput (tokens/s) whose median p99 TTFT and p99 TPOT (ms) "
        "stay within the bounds (empty: no bound).",
        "sql": _BEST_UNDER_BOUND,
    },
    "latest_per_configuration": {
        "title": "Latest run of every configuration",
        "description": "For each configuration and workload, its most recent run.",
        "sql": _LATEST_PER_CONFIGURATION,
    },
    "not_passed": {
        "title": "Cases that did not pass",
        "description": "Each case with a failed, errored or invalid run: its latest such run, "
        "with the missed thresholds and message, and how many runs did not pass.",
        "sql": _NOT_PASSED,
    },
    "latest_session": {
        "title": "Latest session",
        "description": "Every case of the most recent pytest session.",
        "sql": "SELECT case_id, status, engine, device, completed, failed, "
        "round(request_throughput, 3) AS req_per_s, "
        f"round(output_throughput, 2) AS output_tok_per_s, {_latency_columns()} FROM {TABLE} "
        f"WHERE session_id = {LATEST_SESSION} ORDER BY case_id",
    },
    "case_history": {
        "title": "History of one case",
        "description": "A case's figures over time, newest first: regressions show here.",
        "sql": "SELECT timestamp, session_id, run_id, engine, status, "
        "round(request_throughput, 3) AS req_per_s, "
        f"round(output_throughput, 2) AS output_tok_per_s, {_latency_columns()} FROM {TABLE} "
        "WHERE case_id = :case_id ORDER BY timestamp DESC",
    },
}
