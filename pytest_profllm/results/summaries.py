"""Summaries of every run that three canned queries show (browse/queries.py), taken again whole
by each load that changed a row, in its transaction.

Each groups every run: at a million runs that took 0.5 to 2.7 s (the medians per load point
of 660,000 valid runs), past Datasette's 1 s limit for a query. A load pays it once (about 4 s
at a million runs, 0.4 s at 100,000); the pages read a table of one row per case. The SQL
here is the queries' own: a database no load summarised yet runs it as it is.
"""

from __future__ import annotations

import sqlite3
import statistics
from typing import Any

from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import MEASURED_RUNS, TABLE

# A series: one configuration on one engine and device, at one input/output length, in the
# covering index's column order (table.SUMMARY_COLUMNS), so grouping needs no sort.
SERIES_KEY = "configuration, engine, device, bench_random_input_len, bench_random_output_len"

# Each configuration and load point: medians over its valid runs (repeats and history).
BEST_POINTS_SQL = (
    "SELECT server_model, configuration, workload, engine, device, "
    "median(output_throughput) AS tp, median(p99_ttft_ms) AS ttft, median(p99_tpot_ms) AS tpot, "
    f"count(*) AS runs FROM {MEASURED_RUNS} WHERE output_throughput IS NOT NULL "
    f"GROUP BY {SERIES_KEY}, workload, bench_request_rate, bench_max_concurrency, server_model"
)
# SQLite's bare columns: the run id and figures come from the row with max(timestamp).
LATEST_PER_CONFIGURATION_SQL = (
    "SELECT configuration, workload, engine, device, max(timestamp) AS timestamp, run_id, "
    "status, round(output_throughput, 2) AS output_tok_per_s, "
    "round(p99_ttft_ms, 2) AS p99_ttft_ms, round(p99_tpot_ms, 3) AS p99_tpot_ms "
    f"FROM {MEASURED_RUNS} GROUP BY {SERIES_KEY}, workload"
)
# Grouped over the narrow landing table, the message of each case's latest run then read by
# its run id: grouping the wide rows took 0.5 s at 100,000 runs (a third of them not passed).
NOT_PASSED_SQL = (
    "WITH latest AS (SELECT configuration, workload, engine, device, max(timestamp) AS "
    "timestamp, run_id, status, failed_verdicts, count(*) AS runs_not_passed "
    f"FROM {LANDING} WHERE status IN ('failed', 'error', 'invalid') "
    "GROUP BY configuration, workload, engine, device) "
    "SELECT l.configuration, l.workload, l.engine, l.device, l.timestamp, l.run_id, l.status, "
    f"l.failed_verdicts, b.message, l.runs_not_passed FROM latest AS l JOIN {TABLE} AS b "
    "ON b.run_id = l.run_id"
)

BEST_POINTS = "summary_best_points"
LATEST_PER_CONFIGURATION = "summary_latest_per_configuration"
NOT_PASSED = "summary_not_passed"
SUMMARIES = {
    BEST_POINTS: BEST_POINTS_SQL,
    LATEST_PER_CONFIGURATION: LATEST_PER_CONFIGURATION_SQL,
    NOT_PASSED: NOT_PASSED_SQL,
}


class Median:
    """SQLite aggregate `median(x)`: repeats are combined with it, never with a sum."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def step(self, value: Any) -> None:
        if isinstance(value, int | float):
            self.values.append(value)

    def finalize(self) -> float | None:
        return statistics.median(self.values) if self.values else None


def register_median(connection: sqlite3.Connection) -> None:
    connection.create_aggregate("median", 1, Median)  # type: ignore[arg-type]


def refresh_summaries(connection: sqlite3.Connection) -> None:
    """Each summary made again from the rows as they are (in the caller's transaction)."""
    if not connection.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                              (LANDING,)).fetchone():
        return  # no landing table yet: nothing is summarised
    register_median(connection)
    for name, sql in SUMMARIES.items():
        connection.execute(f"DROP TABLE IF EXISTS [{name}]")
        connection.execute(f"CREATE TABLE [{name}] AS {sql}")
