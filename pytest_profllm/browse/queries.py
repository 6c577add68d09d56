"""The canned queries of the Datasette plugin, as SQL over `benchmark_runs` (the charts are
the dashboards', browse/dashboards/).

Queries that aggregate combine repeats and history with a median (`median()`, which the
plugin registers on every connection), never a sum, over valid measurements only. They read
the columns of one covering index (`table.SUMMARY_COLUMNS`), never the 400-column rows; the
three that group every run read the summaries each load takes (results/summaries.py).
"""

from __future__ import annotations

from typing import Any

from pytest_profllm.browse.latest import LATEST_SESSION_SQL
from pytest_profllm.results import summaries
from pytest_profllm.results.gate_tables import SAMPLES, SPAN_COLUMNS, VERDICTS
from pytest_profllm.results.landing import HEADLINE_METRICS, LANDING
from pytest_profllm.results.table import MEASURED_RUNS, TABLE

# Points, comparisons and bests come from valid measurements only: the store's view of them
# (results/table.py), which the covering index serves.
# A series: one configuration on one engine and device, at one input/output length.
SERIES = (
    "configuration || ' [' || engine || ', ' || device || ', in ' || "
    "coalesce(bench_random_input_len, '-') || ' / out ' || coalesce(bench_random_output_len, '-')"
    " || ']'"
)
SERIES_KEY = summaries.SERIES_KEY
# The latest session: browse/latest.py defines it for every page.
LATEST_SESSION = LATEST_SESSION_SQL


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


def _per_session(alias: str, session: str) -> str:
    figures = ", ".join(f"median({metric.column}) AS {metric.name}" for metric in _HEADLINE)
    return (
        f"{alias} AS (SELECT configuration, workload, engine, device, {figures}, "
        f"count(*) AS runs FROM {MEASURED_RUNS} WHERE session_id = {session} "
        "GROUP BY configuration, workload, engine, device)"
    )


_SESSION_B = f"coalesce(nullif(:session_b, ''), {LATEST_SESSION})"
_CASE = "configuration, workload, engine, device"
# Session A by default: the newest session before B that measured a case B measured too (the
# newest one alone may share none: another suite's, or a single case run by hand).
# Runs are read newest first down the timestamp index until one shares a case with B (a join
# of every run with B's took 0.3-0.8 s at 100,000 runs, and Datasette's time limit stopped it).
_EARLIER_SHARING = (
    f"(SELECT m.session_id FROM {MEASURED_RUNS} m "
    f"WHERE m.timestamp < (SELECT min(timestamp) FROM {TABLE} WHERE session_id = "
    "(SELECT id FROM b_id)) AND m.session_id <> (SELECT id FROM b_id) "
    f"AND EXISTS (SELECT 1 FROM {MEASURED_RUNS} n WHERE n.session_id = (SELECT id FROM b_id) "
    + " ".join(f"AND n.{column} = m.{column}" for column in _CASE.split(", "))
    + ") ORDER BY m.timestamp DESC LIMIT 1)"
)
_SESSION_COLUMNS = [
    name for metric in _SIDE_BY_SIDE for name in (f"a_{metric.name}", f"b_{metric.name}")
] + ["output_tok_per_s_change_pct", "b_over_a_throughput", "a_runs", "b_runs"]
_COMPARE_SESSIONS = (
    # A first: the query's form asks for the parameters in the order they appear.
    f"WITH a_id AS (SELECT coalesce(nullif(:session_a, ''), {_EARLIER_SHARING}) AS id), "
    f"b_id AS (SELECT {_SESSION_B} AS id), "
    + _per_session("a", "(SELECT id FROM a_id)")
    + ", "
    + _per_session("b", "(SELECT id FROM b_id)")
    # Only the cases both sessions measured: a case of one session alone compares nothing.
    + ", shared AS (SELECT (SELECT id FROM a_id) AS session_a, (SELECT id FROM b_id) AS "
    f"session_b, {_CASE}, "
    + ", ".join(
        f"round(a.{metric.name}, {metric.compared_digits}) AS a_{metric.name}, "
        f"round(b.{metric.name}, {metric.compared_digits}) AS b_{metric.name}"
        for metric in _SIDE_BY_SIDE
    )
    + ", round(100.0 * (b.output_tok_per_s / nullif(a.output_tok_per_s, 0) - 1), 1) "
    "AS output_tok_per_s_change_pct, "
    "round(b.output_tok_per_s / nullif(a.output_tok_per_s, 0), 3) AS b_over_a_throughput, "
    f"a.runs AS a_runs, b.runs AS b_runs FROM a JOIN b USING ({_CASE})) "
    "SELECT * FROM shared UNION ALL "
    # None shared: one row that says so, rather than an empty page or a page of blanks.
    "SELECT (SELECT id FROM a_id), (SELECT id FROM b_id), "
    "CASE WHEN (SELECT id FROM b_id) IS NULL THEN 'no session in the database' "
    "WHEN (SELECT id FROM a_id) IS NULL THEN 'no session before ' || (SELECT id FROM b_id) || "
    "' measured a case that it measured' "
    "ELSE 'sessions ' || (SELECT id FROM a_id) || ' and ' || (SELECT id FROM b_id) || "
    "' measured no case in common' END, "
    + ", ".join(["NULL"] * (3 + len(_SESSION_COLUMNS)))
    + " WHERE NOT EXISTS (SELECT 1 FROM shared) "
    "ORDER BY configuration, workload"
)

# The units of compare_runs' figures (a headline metric's column name says its unit).
_UNITS = {"request_throughput": "req/s", "output_throughput": "tok/s", "completed": "requests",
          "failed": "requests"}
_DIGITS = {metric.column: metric.digits if metric.digits is not None else 0
           for metric in HEADLINE_METRICS}
_RUN_TEXT = ("status", "case_id", "timestamp", "engine", "device", "server_model")
_RUN_FIGURES = (*(metric.column for metric in _HEADLINE), "median_itl_ms", "p99_e2el_ms",
                "completed", "failed")


def _figure(value: str, digits: int, unit: str, sign: str = "") -> str:
    # printf() makes NULL a zero: a missing figure stays empty.
    return (f"CASE WHEN {value} IS NULL THEN NULL ELSE "
            f"printf('%{sign}.{digits}f {unit}', {value}) END")


def _run_row(column: str, gate: bool) -> str:
    if column not in _RUN_FIGURES:
        figures = (f"ra.{column} AS a, rb.{column} AS b, "
                   f"CASE WHEN ra.{column} IS rb.{column} THEN 'same' ELSE 'differs' END")
    else:
        unit = _UNITS.get(column, "ms")
        digits = 0 if column in ("completed", "failed") else _DIGITS.get(column, 2)
        a, b = f"ra.{column}", f"rb.{column}"
        change = _figure(f"{b} - {a}", digits, unit, "+")
        percent = f"printf(' (%+.1f%%)', 100.0 * ({b} / {a} - 1))"
        figures = (f"{_figure(a, digits, unit)} AS a, {_figure(b, digits, unit)} AS b, "
                   f"{change} || CASE WHEN {a} = 0 OR {a} IS NULL THEN '' ELSE {percent} END")
    # The regression gate's verdict on each run for the metric, against its own baseline.
    verdicts = ", ".join(
        f"(SELECT verdict || printf(' %+.1f%%', 100.0 * change) || CASE WHEN ci_low IS NULL "
        "OR ci_high IS NULL THEN '' ELSE printf(' [%+.1f%%, %+.1f%%] at %d%%', 100.0 * ci_low, "
        "100.0 * ci_high, round(100.0 * coalesce(confidence, 0))) END || "
        "coalesce(' vs ' || baseline_session, '') "
        f"FROM {VERDICTS} v WHERE v.run_id = {run}.run_id AND v.metric = '{column}')"
        + f" AS gate_{run[1]}" for run in ("ra", "rb")
    ) if gate else "NULL AS gate_a, NULL AS gate_b"
    return (f"SELECT '{column}' AS metric, {figures} AS change, {verdicts} "
            "FROM ra, rb")


def _compare_runs(gate: bool) -> str:
    """Two runs' figures with units, B's change from A (and in %), and the gate's verdict on
    each with its interval where the database has the gate's table."""
    wanted = ", ".join(("run_id", *_RUN_TEXT, *_RUN_FIGURES, "failed_verdicts"))
    rows = " UNION ALL ".join(_run_row(column, gate)
                              for column in (*_RUN_TEXT, *_RUN_FIGURES, "failed_verdicts"))
    # One row per metric even where a run id is unknown (its side empty).
    return (
        f"WITH ra AS (SELECT {wanted} FROM (SELECT 1) LEFT JOIN {TABLE} ON run_id = :run_a), "
        f"rb AS (SELECT {wanted} FROM (SELECT 1) LEFT JOIN {TABLE} ON run_id = :run_b) "
        + rows
    )


def _best_under_bound(points: str) -> str:
    # SQLite's bare columns: configuration and workload come from the row with max(tp).
    return (
        "SELECT server_model, engine, device, round(max(tp), 2) AS output_tok_per_s, "
        "configuration, workload, round(ttft, 2) AS p99_ttft_ms, round(tpot, 3) AS p99_tpot_ms, "
        f"runs FROM {points} WHERE ttft <= {_number('max_p99_ttft_ms')} "
        f"AND tpot <= {_number('max_p99_tpot_ms')} "
        "GROUP BY server_model, engine, device ORDER BY server_model, engine, device"
    )


_LATEST_ORDER = " ORDER BY configuration, workload, engine, device"
_NOT_PASSED_ORDER = " ORDER BY timestamp DESC"
# The three that group every run read what the last load summarised (results/summaries.py);
# a database no load summarised yet runs the same SQL on each visit.
_SUMMARISED = {
    "best_configuration": _best_under_bound(f"[{summaries.BEST_POINTS}]"),
    "latest_per_configuration": f"SELECT * FROM [{summaries.LATEST_PER_CONFIGURATION}]"
    + _LATEST_ORDER,
    "not_passed": f"SELECT * FROM [{summaries.NOT_PASSED}]" + _NOT_PASSED_ORDER,
}
_UNSUMMARISED = {
    "best_configuration": f"WITH points AS ({summaries.BEST_POINTS_SQL}) "
    + _best_under_bound("points"),
    "latest_per_configuration": summaries.LATEST_PER_CONFIGURATION_SQL + _LATEST_ORDER,
    "not_passed": f"SELECT * FROM ({summaries.NOT_PASSED_SQL})" + _NOT_PASSED_ORDER,
}


def _latency_columns() -> str:
    return ", ".join(f"round(median_{m}_ms, 2) AS median_{m}_ms, round(p99_{m}_ms, 2) AS "
                     f"p99_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el"))


CANNED_QUERIES: dict[str, dict[str, Any]] = {
    "compare_sessions": {
        "title": "Compare two sessions side by side",
        "description": "The medians of each case both sessions measured, in session A and "
        "session B, B's throughput change in % and as a fraction of A's. Default B: the latest "
        "session; A: the newest session before it that measured a case it measured.",
        "sql": _COMPARE_SESSIONS,
    },
    "compare_runs": {
        "title": "Compare two runs side by side",
        "description": "The headline figures of two run_ids (run_a, run_b), one metric a row, "
        "with units: B's change from A (and in %), and the regression gate's decision on each "
        "run with its change and confidence interval against the gate's baseline.",
        "sql": _compare_runs(gate=True),
    },
    "best_configuration": {
        "title": "Best configuration per model under a TTFT or TPOT bound",
        "description": "For each model, engine and device: the configuration and load with the "
        "highest median output throughput (tokens/s) whose median p99 TTFT and p99 TPOT (ms) "
        "stay within the bounds (empty: no bound).",
        "sql": _SUMMARISED["best_configuration"],
    },
    "latest_per_configuration": {
        "title": "Latest run of every configuration",
        "description": "For each configuration and workload, its most recent run.",
        "sql": _SUMMARISED["latest_per_configuration"],
    },
    "not_passed": {
        "title": "Cases that did not pass",
        "description": "Each case with a failed, errored or invalid run: its latest such run, "
        "with the missed thresholds and message, and how many runs did not pass.",
        "sql": _SUMMARISED["not_passed"],
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


# A run's requests with the server's span of each (load/trace_join.py), for CSV export: only
# for a database whose `request_samples` has the span's columns (a load adds them).
REQUEST_QUERIES: dict[str, dict[str, Any]] = {
    "run_requests": {
        "title": "A run's requests, with the server's view of each",
        "description": "Every request of a run_id in order: success, send time (ms from the "
        "load's start), prompt and output tokens, the client's TTFT, TPOT and E2E, and with "
        "--profllm-trace-requests the server's span (queue, prefill, decode, inference, TTFT, "
        "E2E) and what the client added to TTFT and E2E; all in ms, null where no span was "
        "joined. The page's CSV link exports them all.",
        "sql": "SELECT run_id, request_index, success, start_ms, prompt_len, output_tokens, "
        f"ttft_ms, tpot_ms, e2el_ms, {', '.join(SPAN_COLUMNS)} FROM [{SAMPLES}] "
        "WHERE run_id = :run_id ORDER BY request_index",
    },
}


# The tables whose rows each query shows. Every query shows runs, as `benchmark_runs` and the
# landing table `runs` both do, whatever it reads them from (the tables and views derived from
# `benchmark_runs` follow its permission: browse/plugin.py). A visitor who may not see one of
# these is refused the query, as Datasette's own table pages refuse the table.
_RUNS_SHOWN = (TABLE, LANDING)
TABLES_SHOWN: dict[str, tuple[str, ...]] = {name: _RUNS_SHOWN for name in CANNED_QUERIES} | {
    "compare_runs": (*_RUNS_SHOWN, VERDICTS),
    # A run's requests follow their own table's permission, as `gate_runs` does its own.
    "run_requests": (SAMPLES,),
}


def canned_queries(has_verdicts: bool, has_summaries: bool = True, has_spans: bool = True
                   ) -> dict[str, dict[str, Any]]:
    """The canned queries for a database with or without the gate's verdicts table, the
    loads' summaries and the requests' span columns (SQLite refuses a query that names a
    missing table or column: older databases have none of them)."""
    queries = dict(CANNED_QUERIES)
    if has_spans:
        queries.update(REQUEST_QUERIES)
    if not has_verdicts:
        queries["compare_runs"] = {**queries["compare_runs"], "sql": _compare_runs(gate=False)}
    if not has_summaries:
        for name, sql in _UNSUMMARISED.items():
            queries[name] = {**queries[name], "sql": sql}
    return queries
