"""The table `benchmark_runs`: one row per record, one column per server argument, workload
parameter, metric and system figure, prefixed by where it comes from (`server_`, `bench_`,
`system_`, `runtime_`, `cost_`; metrics keep vLLM's names unprefixed). Column types come from the
record's schema and the engine-argument registry, never from the first value seen: a numeric
parameter is REAL or INTEGER, and an infinite request rate is stored as SQLite's REAL Infinity,
so numeric filters and sorts work. This module names the columns and their types, and creates
the table and its indexes (retyping the columns of an older table).
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Literal

from pytest_profllm.engine.registry import bundled
from pytest_profllm.load.server_view import OVERHEAD_KEYS
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite import (
    AccuracyConfig,
    BenchmarkConfig,
    LatencyConfig,
    ThroughputConfig,
)
from pytest_profllm.results.record import CostInfo, RuntimeInfo, SystemInfo

TABLE = "benchmark_runs"
# Metric columns every table has, so that queries over them work whatever a suite measured.
STANDARD_METRICS = metric_names.result_names(
    metric_names.LATENCY_METRICS, (50.0, 90.0, 95.0, 99.0)
) + list(metric_names.CLIENT_HEALTH_KEYS) + list(metric_names.CAPACITY_RESULTS) + list(
    metric_names.MULTIMODAL_RESULTS
) + list(metric_names.ACCURACY_RESULTS) + list(OVERHEAD_KEYS) + list(
    metric_names.STEADY_RESULTS
) + list(metric_names.CLIENT_QUEUE_RESULTS)
# A row is 5-10 KB (400+ columns, JSON of config classes): with SQLite's 4 KB pages each row
# spills into overflow pages, which made loading twice as slow.
PAGE_SIZE = 32_768

# The runs whose results are a valid measurement (record.py's `validity`): a view.
MEASURED_RUNS = "measured_runs"

# Columns of the record's top level and of derived values: (name, SQLite type).
FIXED_COLUMNS: dict[str, str] = {
    "run_id": "TEXT",
    "session_id": "TEXT",
    "suite": "TEXT",
    "source": "TEXT",
    "case_id": "TEXT",
    "nodeid": "TEXT",
    "repeat_index": "INTEGER",
    "timestamp": "TEXT",
    "status": "TEXT",
    "message": "TEXT",
    "validity": "TEXT",  # valid or invalid: whether `results` measure the server (record.py)
    "validity_reasons": "TEXT",
    "case_duration": "REAL",
    "engine": "TEXT",
    "engine_version": "TEXT",
    "engine_reason": "TEXT",
    "engine_distribution": "TEXT",
    "engine_args_version": "TEXT",
    "engine_args_source": "TEXT",
    # real, or virtual: a prediction of the simulator's virtual clock (run/virtual.py).
    "engine_clock": "TEXT",
    # The profile file that priced a simulated run (--profllm-sim-profile): "NAME (sha256's
    # first 12)", so runs of one calibration are found and told from another's.
    "engine_sim_profile": "TEXT",
    # Derived, for grouping: the case without its workload, the workload without its repeat
    # number, and the devices it ran on.
    "configuration": "TEXT",
    "workload": "TEXT",
    "device": "TEXT",
    "thresholds": "TEXT",
    "verdicts": "TEXT",
    "profiling": "TEXT",
    "regression": "TEXT",
    "failed_verdicts": "TEXT",
    # The suite's declared axes, as column names (JSON): the landing table shows them first.
    "axes": "TEXT",
    # A capacity case's search (record `capacity`): the SLO that limits it, and all of it.
    "capacity_limit": "TEXT",
    "capacity_search": "TEXT",
    # Every run of the case's load, where the host made one invalid (record `attempts`).
    "attempts": "TEXT",
    # The server's own latency histograms over the load (record `server_view`): why some or
    # all are missing, and all of it (quantiles with the bucket bounds they lie between).
    # Named `engine_`, as what the engine said: a `server_` column is an engine argument.
    "engine_view_problem": "TEXT",
    "engine_view": "TEXT",
    # An accuracy case's evaluation (record `accuracy`): lm-eval's task, whether the figure
    # is only a plumbing check (the simulated engine answered), lm-eval's version, the
    # task's hash, and all of it. Its metrics are result columns (acc, acc_stderr, ...).
    "accuracy_task": "TEXT",
    "accuracy_plumbing_check": "INTEGER",
    "accuracy_lm_eval_version": "TEXT",
    "accuracy_task_hash": "TEXT",
    "accuracy": "TEXT",
    # A LoRA adapter mix's figures per model (record `by_adapter`), as JSON: the run page's
    # per-adapter table.
    "by_adapter": "TEXT",
    # A load sent in rounds until its statistic was known well enough (record `until`):
    # what ended it (interval or cap), and all of it (the interval, rounds and requests).
    "until_stopped_by": "TEXT",
    "until": "TEXT",
    # A digest of the record's file: loading the same file again is recognised as unchanged
    # (without reading it: ingest digests the bytes and skips a file whose digest is stored).
    "record_digest": "TEXT",
}
_INTEGER_METRICS = {
    "completed", "failed", "total_input_tokens", "total_output_tokens",
    metric_names.ACCURACY_SAMPLES,
}
# Single-column indexes: the default facets and the filters people use most.
_INDEXED = (
    "suite",
    "case_id",
    "session_id",
    "timestamp",
    "status",
    "engine",
    "device",
    "configuration",
    "server_model",
    "capacity",  # NULL but for capacity cases: the capacity dashboard asks whether any exists
)
# The columns the full table's page facets on, where the table has them (browse/plugin.py;
# the Ray node where records name one). Each is indexed: a facet of an unindexed column reads
# every 7 KB row (0.23 s at 100,000 runs), and a load counts them (results/facet_counts.py).
TABLE_FACETS = ("server_model", "engine", "device", "bench_kind", "suite", "status",
                "runtime_node_id")
# One covering index for the aggregating queries (charts, canned queries): they read these
# columns from the index, never the 400-column rows.
SUMMARY_COLUMNS = (
    # In the GROUP BY order of the queries, so they group as they scan, without sorting.
    "configuration",
    "engine",
    "device",
    "bench_random_input_len",
    "bench_random_output_len",
    "workload",
    "bench_request_rate",
    "bench_max_concurrency",
    "server_model",
    "suite",
    "case_id",
    "session_id",
    "timestamp",
    "status",
    "validity",
    "run_id",
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


@functools.cache
def column_types() -> dict[str, str]:
    """The SQLite type of every column the record schema and the registry define."""

    types_ = dict(FIXED_COLUMNS)
    for name, option in bundled().options.items():
        types_["server_" + name] = _OPTION_TYPES.get(option.kind, "TEXT")
    for prefix, model in (("bench_", BenchmarkConfig), ("bench_", ThroughputConfig),
                          ("bench_", LatencyConfig), ("bench_", AccuracyConfig),
                          ("system_", SystemInfo),
                          ("runtime_", RuntimeInfo), ("cost_", CostInfo)):
        for name, info in model.model_fields.items():
            # A name two workload kinds share (num_prompts) keeps the serving kind's type.
            types_.setdefault(prefix + name, _annotation_type(info.annotation))
    for name in (*metric_names.COUNT_METRICS, *STANDARD_METRICS):
        types_[name] = "INTEGER" if name in _INTEGER_METRICS else "REAL"
    return types_


_OPTION_TYPES = {"int": "INTEGER", "float": "REAL", "bool": "INTEGER", "flag": "INTEGER"}


def _annotation_type(annotation: Any) -> str:
    # `float | None` is REAL; a list, a mapping or a Literal is TEXT (JSON or a word).
    if typing.get_origin(annotation) is typing.Annotated:  # FiniteFloat: a float
        return _annotation_type(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        # A number or a word (`client_processes: 2 | auto`): the number's column, which
        # SQLite lets hold the word too.
        numbers = [arg for arg in args if typing.get_origin(arg) is not Literal]
        if len(numbers) < len(args) and numbers:
            args = numbers
        kinds = {_annotation_type(arg) for arg in args}
        return kinds.pop() if len(kinds) == 1 else "TEXT"
    if annotation is bool or annotation is int:
        return "INTEGER"
    if annotation is float:
        return "REAL"
    return "TEXT"


def prepare_table(db: Any) -> None:
    """The table with the schema's columns, an older table's mistyped columns retyped (`db`:
    a sqlite-utils Database)."""
    table = db.table(TABLE)
    typed = column_types()
    if not table.exists():
        table.create({name: _python_type(kind) for name, kind in typed.items()}, pk="run_id")
        return
    existing = table.columns_dict
    missing = {name: _python_type(kind) for name, kind in typed.items() if name not in existing}
    for name, kind in missing.items():
        table.add_column(name, kind)
    if "validity" in missing:
        # Rows loaded before records said it: record.measurement_validity's rule, in SQL.
        db.conn.execute(
            f"UPDATE [{TABLE}] SET validity = CASE WHEN status IN ('passed', 'failed') "
            "AND coalesce(failed, 0) = 0 AND (completed IS NULL OR completed > 0) "
            "THEN 'valid' ELSE 'invalid' END"
        )
    # Tables written before columns were typed by the schema: `bench_request_rate` was TEXT
    # because its first value was "inf". Retype them; "inf" becomes REAL Infinity.
    declared = {row[1]: row[2].upper() for row in db.conn.execute(f"PRAGMA table_info([{TABLE}])")}
    wrong = {name: _python_type(typed[name]) for name, kind in declared.items()
             if name in typed and typed[name] in ("REAL", "INTEGER") and kind == "TEXT"}
    if wrong:
        table.transform(types=wrong)
        for name in wrong:
            db.conn.execute(
                f"UPDATE [{TABLE}] SET {quote(name)} = 9e999 WHERE {quote(name)} IN "
                "('inf', 'Infinity')"
            )
            db.conn.execute(
                f"UPDATE [{TABLE}] SET {quote(name)} = -9e999 WHERE {quote(name)} IN "
                "('-inf', '-Infinity')"
            )


def quote(name: str) -> str:
    """A column or index name quoted for SQL, whatever characters it holds (a suite's engine
    argument may hold `]`, which SQLite's [brackets] cannot quote)."""
    return '"' + name.replace('"', '""') + '"'


def _python_type(kind: str) -> type:
    return {"INTEGER": int, "REAL": float}.get(kind, str)


def refresh_indexes(db: Any) -> None:
    """The table's indexes: one per common filter, and the covering one of `SUMMARY_COLUMNS`."""
    present = {row[1] for row in db.conn.execute(f"PRAGMA table_info([{TABLE}])")}
    for column in dict.fromkeys((*_INDEXED, *(c for c in TABLE_FACETS if c in present))):
        db.conn.execute(
            f"CREATE INDEX IF NOT EXISTS [idx_{TABLE}_{column}] ON [{TABLE}] ([{column}])"
        )
    for older in ("summary", "groups"):  # the covering index of an older column list
        db.conn.execute(f"DROP INDEX IF EXISTS [idx_{TABLE}_{older}]")
    db.conn.execute(
        f"CREATE INDEX IF NOT EXISTS [idx_{TABLE}_measured] ON [{TABLE}] "
        f"({', '.join(f'[{c}]' for c in SUMMARY_COLUMNS)})"
    )
    # Every load reads each run's digest (store.py): from this index, not the 7 KB rows (6.2 s
    # of a one-record load at a million runs).
    db.conn.execute(f"CREATE INDEX IF NOT EXISTS [idx_{TABLE}_digest] ON [{TABLE}] "
                    "(run_id, record_digest)")
    # The one definition of a data point: every chart, comparison and canned query reads it.
    db.conn.execute(
        f"CREATE VIEW IF NOT EXISTS [{MEASURED_RUNS}] AS "
        f"SELECT * FROM [{TABLE}] WHERE validity = 'valid'"
    )
