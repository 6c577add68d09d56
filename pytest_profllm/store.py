"""The SQLite store: one row per record in `benchmark_runs`, one column per server argument,
workload parameter, metric and system figure.

Columns are prefixed by where they come from (`server_`, `bench_`, `system_`, `runtime_`);
metrics keep vLLM's names unprefixed. Loading is an upsert on `run_id` in one `BEGIN IMMEDIATE`
transaction, so re-loading a record changes nothing and concurrent writers wait their turn.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pytest_profllm import metrics
from pytest_profllm.record import normalize

TABLE = "benchmark_runs"
# Metric columns every table has, so that queries over them work whatever a suite measured.
STANDARD_METRICS = metrics.result_names(metrics.LATENCY_METRICS, (50.0, 90.0, 95.0, 99.0)) + list(
    metrics.CLIENT_HEALTH_KEYS
)
_BUSY_TIMEOUT_S = 30.0


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record flattened to one table row."""
    row: dict[str, Any] = {
        key: record.get(key)
        for key in (
            "run_id",
            "session_id",
            "suite",
            "source",
            "case_id",
            "nodeid",
            "repeat_index",
            "timestamp",
            "status",
            "message",
        )
    }
    # `duration` is the metric (vLLM's: the benchmark's requests); the whole case is apart.
    row["case_duration"] = record.get("duration")
    engine = record.get("engine") or {}
    row["engine"] = engine.get("name")
    row["engine_version"] = engine.get("version")
    row["engine_reason"] = engine.get("reason")
    config = record.get("config") or {}
    engine_args = config.get("engine_args") or {}
    row["engine_args_version"] = engine_args.get("vllm_version")
    row["engine_args_source"] = engine_args.get("source")
    for prefix, block in (("server_", config.get("server")), ("bench_", config.get("benchmark"))):
        for key, value in (block or {}).items():
            row[prefix + key] = _cell(value)
    row.update(record.get("results") or {})
    for prefix, block in (("system_", record.get("system")), ("runtime_", record.get("runtime"))):
        for key, value in (block or {}).items():
            row[prefix + key] = _cell(value)
    for key in ("thresholds", "verdicts", "profiling", "regression"):
        row[key] = _cell(record.get(key))
    row["failed_verdicts"] = (
        ",".join(
            verdict["metric"] for verdict in record.get("verdicts") or [] if not verdict["passed"]
        )
        or None
    )
    return row


def _cell(value: Any) -> Any:
    # SQLite has no lists or mappings: store them as JSON text, which Datasette renders.
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value


def load_records(
    db_path: Path, records: Iterable[dict[str, Any]], busy_timeout_s: float = _BUSY_TIMEOUT_S
) -> int:
    """Upsert records into `benchmark_runs` in one transaction (all or nothing: a full disk
    or an error leaves the database as it was); returns how many rows were written. Waits up
    to `busy_timeout_s` for another writer's lock (sqlite3.OperationalError: locked)."""
    import sqlite_utils

    rows = [record_row(record) for record in records]
    if not rows:
        return 0
    db_path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(sqlite3.connect(db_path, timeout=busy_timeout_s))
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        db.enable_wal()
        db.conn.execute("BEGIN IMMEDIATE")
        try:
            table = db.table(TABLE)
            _upsert(db, table, rows)
            existing = set(table.columns_dict)
            for name in STANDARD_METRICS:
                if name not in existing:
                    table.add_column(name, float)
            if "bench_kind" not in existing:  # a default facet: every table has it
                table.add_column("bench_kind", str)
            for column in ("suite", "case_id", "timestamp", "status", "engine"):
                table.create_index([column], if_not_exists=True)
            db.conn.execute("COMMIT")
        except BaseException:
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            raise
    finally:
        db.close()
    return len(rows)


def _upsert(db: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    # sqlite-utils' insert_all binds at most 999 values a statement: with a column per engine
    # argument (~420 columns) that is two rows a statement, 8x slower. The schema comes from
    # sqlite-utils (types, new columns); the rows go in one executemany.
    from sqlite_utils.utils import suggest_column_types

    if table.exists():
        table.add_missing_columns(rows)
    else:
        table.create(suggest_column_types(rows), pk="run_id")
    columns = list(dict.fromkeys(name for row in rows for name in row))
    names = ", ".join(f"[{name}]" for name in columns)
    marks = ", ".join("?" for _ in columns)
    db.conn.executemany(
        f"INSERT OR REPLACE INTO [{TABLE}] ({names}) VALUES ({marks})",
        [tuple(row.get(name) for name in columns) for row in rows],
    )


def read_record_files(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Record files from anywhere (other hosts, CI artifacts), checked against the schema."""
    records = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            records.append(normalize(data).model_dump(mode="json"))
        except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: not a profllm record: {error}") from None
    return records


def record_files(paths: Iterable[Path]) -> list[Path]:
    """The record files named, or found in the folders named (per-request files left out)."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += sorted(p for p in path.glob("*.json") if not p.name.startswith("."))
        else:
            found.append(path)
    return found
