"""The regression gate's tables in the results database, beside `benchmark_runs` (a session
and `profllm ingest` both fill them, so any results database is a baseline and a history):

- `gate_runs`: one row per run: its fingerprint (digest with and without the engine version),
  its case, session, time, status, results (JSON) and validity (`fingerprint_parts` is
  filled only by older versions: the parts are in `gate_fingerprints`, once per fingerprint);
- `gate_fingerprints`: what each fingerprint is made of, as JSON;
- `request_samples`: one row per request of a run (TTFT, TPOT, E2EL, ITL list, in ms), the
  per-request samples a later run's regression gate resamples; for a conversation workload
  also its conversation, turn and the prompt tokens found in the prefix cache (else null);
  its prompt length and send time (ms from the load's start); with --profllm-trace-requests,
  the server's span of it (queue, prefill, decode, inference, TTFT, E2E, in ms) and what the
  client added to its TTFT and E2E (load/trace_join.py; null where no span was joined);
  for an offline latency run, one row per measured iteration, its latency as the E2EL;
- `regression_verdicts`: one row per gated metric of a run: the regression gate's decision
  (column `verdict`, the store's first name for it, kept: docs/reference/record.md), baseline
  and new value, change and its confidence interval;
- `change_points`: what `profllm history` found.

Loading is an upsert keyed by run_id, in one `BEGIN IMMEDIATE` transaction, as the store does.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pytest_profllm.results.fingerprint import described, rederived
from pytest_profllm.results.record import is_valid, request_succeeded
from pytest_profllm.results.schema_version import refuse_newer

RUNS = "gate_runs"
SAMPLES = "request_samples"
VERDICTS = "regression_verdicts"
CHANGE_POINTS = "change_points"
FINGERPRINTS = "gate_fingerprints"
# Not the gate's, but kept the same way (every run's rows, by session and by ingest alike):
# the run over time, from its record's `series`, for the run page.
SERIES = "run_series"
SERIES_COLUMNS = (
    "t_s", "request_throughput", "output_throughput", "running", "waiting", "kv_cache_usage",
    "gpu_utilization", "gpu_memory_mib", "gpu_power_w", "server_cpu_percent",
    "server_rss_mib", "client_cpu_percent",
)
_BUSY_TIMEOUT_MS = 30_000

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS [{RUNS}] (
    run_id TEXT PRIMARY KEY, fingerprint TEXT, fingerprint_any_version TEXT,
    fingerprint_parts TEXT, suite TEXT, case_id TEXT, session_id TEXT, timestamp TEXT,
    repeat_index INTEGER, status TEXT, gate TEXT, results TEXT, validity TEXT
);
CREATE INDEX IF NOT EXISTS [{RUNS}_fingerprint] ON [{RUNS}] (fingerprint);
CREATE INDEX IF NOT EXISTS [{RUNS}_fingerprint_any_version] ON [{RUNS}] (fingerprint_any_version);
CREATE TABLE IF NOT EXISTS [{FINGERPRINTS}] (fingerprint TEXT PRIMARY KEY, parts TEXT);
CREATE TABLE IF NOT EXISTS [{SAMPLES}] (
    run_id TEXT, request_index INTEGER, success INTEGER, output_tokens INTEGER,
    ttft_ms REAL, tpot_ms REAL, e2el_ms REAL, itl_ms TEXT,
    conversation INTEGER, turn INTEGER, cached_tokens INTEGER,
    PRIMARY KEY (run_id, request_index)
);
CREATE TABLE IF NOT EXISTS [{VERDICTS}] (
    run_id TEXT, case_id TEXT, metric TEXT, verdict TEXT, tolerance REAL,
    higher_is_better INTEGER, baseline REAL, value REAL, change REAL, ci_low REAL, ci_high REAL,
    confidence REAL, samples INTEGER, baseline_samples INTEGER, baseline_session TEXT,
    PRIMARY KEY (run_id, metric)
);
CREATE TABLE IF NOT EXISTS [{SERIES}] (
    run_id TEXT, point INTEGER, {", ".join(f"{name} REAL" for name in SERIES_COLUMNS)},
    PRIMARY KEY (run_id, point)
);
CREATE TABLE IF NOT EXISTS [{CHANGE_POINTS}] (
    fingerprint TEXT, case_id TEXT, metric TEXT, run_id TEXT, session_id TEXT, timestamp TEXT,
    before REAL, after REAL, change REAL, found_at TEXT,
    PRIMARY KEY (fingerprint, metric, run_id)
);
"""


@contextmanager
def writing(db_path: Path) -> Iterator[sqlite3.Connection]:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(db_path, isolation_level=None)
    try:
        connection.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("BEGIN IMMEDIATE")
        try:
            # Only a load sets the version (it migrates every table); this refuses a newer one.
            refuse_newer(connection, db_path)
            create(connection)
            yield connection
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
    finally:
        connection.close()


# A run loaded before records said whether they were valid: record.measurement_validity's
# rule over its status and results.
_DERIVED_VALIDITY = (
    "CASE WHEN status IN ('passed', 'failed') "
    "AND coalesce(json_extract(results, '$.failed'), 0) = 0 "
    "AND coalesce(json_extract(results, '$.completed'), 1) > 0 THEN 'valid' ELSE 'invalid' END"
)


def valid_runs(db: sqlite3.Connection) -> str:
    """The SQL condition for a valid measurement in `gate_runs`, as this database has it."""
    columns = {row[1] for row in db.execute(f"PRAGMA table_info([{RUNS}])")}
    if "validity" in columns:
        return f"coalesce(validity, {_DERIVED_VALIDITY}) = 'valid'"
    return f"{_DERIVED_VALIDITY} = 'valid'"


def _add_validity(db: sqlite3.Connection) -> None:
    """`gate_runs` of an older database gets its validity column, filled in."""
    columns = {row[1] for row in db.execute(f"PRAGMA table_info([{RUNS}])")}
    if "validity" not in columns:
        db.execute(f"ALTER TABLE [{RUNS}] ADD COLUMN validity TEXT")
        db.execute(f"UPDATE [{RUNS}] SET validity = {_DERIVED_VALIDITY}")


# A request's server span and what the client added (load/trace_join.py ROW_KEYS), in ms.
SPAN_COLUMNS = (
    "server_queue_ms", "server_prefill_ms", "server_decode_ms", "server_inference_ms",
    "server_ttft_ms", "server_e2el_ms", "client_overhead_ttft_ms", "client_overhead_e2el_ms",
)
# Columns `request_samples` gained after its first version, with their types: an older
# database gets them (null in the rows it has).
_LATER_SAMPLE_COLUMNS = (
    ("conversation", "INTEGER"), ("turn", "INTEGER"), ("cached_tokens", "INTEGER"),
    ("prompt_len", "INTEGER"), ("start_ms", "REAL"), *((name, "REAL") for name in SPAN_COLUMNS),
)
_SAMPLE_COLUMNS = (
    "run_id", "request_index", "success", "output_tokens", "ttft_ms", "tpot_ms", "e2el_ms",
    "itl_ms", *(name for name, _ in _LATER_SAMPLE_COLUMNS),
)


def _add_sample_columns(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute(f"PRAGMA table_info([{SAMPLES}])")}
    for name, kind in _LATER_SAMPLE_COLUMNS:
        if name not in columns:
            db.execute(f"ALTER TABLE [{SAMPLES}] ADD COLUMN {name} {kind}")


def rederive_fingerprints(db: sqlite3.Connection) -> int:
    """Each stored run's fingerprints by today's rules, from its stored parts, in the open
    transaction (a migration's step): runs stored while a rule differed would otherwise
    never match today's runs of the same case. Returns how many changed."""
    changed, parts = [], {}
    for run_id, stored, kept in db.execute(
        f"SELECT g.run_id, g.fingerprint, coalesce(f.parts, g.fingerprint_parts) "
        f"FROM [{RUNS}] g LEFT JOIN [{FINGERPRINTS}] f ON f.fingerprint = g.fingerprint"
    ).fetchall():
        try:
            old = json.loads(kept)
        except (TypeError, ValueError):
            continue  # no parts kept: it stays as it was stored
        if not isinstance(old, dict):
            continue
        with_version, any_version, canonical = rederived(old)
        if with_version != stored:
            changed.append((with_version, any_version, run_id))
            parts[with_version] = canonical
    db.executemany(f"INSERT OR IGNORE INTO [{FINGERPRINTS}] VALUES (?, ?)", parts.items())
    db.executemany(f"UPDATE [{RUNS}] SET fingerprint = ?, fingerprint_any_version = ? "
                   "WHERE run_id = ?", changed)
    return len(changed)


def decision_of(item: dict[str, Any]) -> str | None:
    """A regression item's decision, as a record wrote it (before `decision`: `verdict`)."""
    decision = item.get("decision", item.get("verdict"))
    return decision if isinstance(decision, str) else None


def gate_of(record: dict[str, Any]) -> str | None:
    """The run's overall regression decision: the worst of its metrics', None where nothing
    was gated. A metric not judged comes before any judged: an unchanged beside it must not
    hide it."""
    decisions = {decision_of(v) for v in record.get("regression") or []}
    for decision in ("regressed", "not-judged", "improved", "unchanged", "no-baseline"):
        if decision in decisions:
            return decision
    return None


def sample_rows(run_id: str, requests: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    rows = []
    for row in requests:
        first, latency, tokens = row.get("ttft_s"), row.get("latency_s"), row.get("output_tokens")
        ttft = e2el = tpot = None
        # A pooling request has an E2EL and no first token (its ttft_s is null).
        if request_succeeded(row) and latency is not None:
            e2el = latency * 1000
            if first is not None:
                ttft = first * 1000
                if tokens and tokens > 1:
                    tpot = (latency - first) / (tokens - 1) * 1000
        rows.append(
            (
                run_id,
                row.get("index"),
                int(request_succeeded(row)),
                tokens,
                ttft,
                tpot,
                e2el,
                json.dumps([gap * 1000 for gap in row.get("itl_s") or []]),
                row.get("conversation"),
                row.get("turn"),
                row.get("cached_tokens"),
                row.get("prompt_len"),
                _ms(row.get("start_s")),
                *(_finite(row.get(name)) for name in SPAN_COLUMNS),
            )
        )
    return rows


def _ms(seconds: Any) -> float | None:
    value = _finite(seconds)
    return None if value is None else value * 1000


@dataclass
class GateRows:
    """One run's rows of the gate's tables: its `gate_runs` row, its request samples (None
    where its per-request rows are not known: what is stored stays) and its regression
    decisions (`regression_verdicts`)."""

    run_id: str
    run: tuple[Any, ...]
    samples: list[tuple[Any, ...]] | None
    verdicts: list[tuple[Any, ...]]
    parts: tuple[str, str]  # (fingerprint, its parts as canonical JSON)
    series: list[tuple[Any, ...]] = field(default_factory=list)


def gate_rows(
    record: dict[str, Any],
    requests: list[dict[str, Any]] | None,
    cache: dict[Any, str] | None = None,
) -> GateRows:
    """`cache`: the fingerprint's dumps shared by the records of one batch (fingerprint.py)."""
    with_version, any_version, parts = described(record, cache)
    results = orjson.dumps(record.get("results") or {}, option=orjson.OPT_SORT_KEYS).decode()
    run = (
        record["run_id"],
        with_version,
        any_version,
        None,
        record.get("suite"),
        record.get("case_id"),
        record.get("session_id"),
        record.get("timestamp"),
        record.get("repeat_index"),
        record.get("status"),
        gate_of(record),
        results,
        "valid" if is_valid(record) else "invalid",
    )
    verdicts = [
        (
            record["run_id"],
            record.get("case_id"),
            v["metric"],
            decision_of(v),
            v["tolerance"],
            int(v["higher_is_better"]),
            v.get("baseline"),
            v.get("value"),
            v.get("change"),
            v.get("ci_low"),
            v.get("ci_high"),
            v.get("confidence"),
            v.get("samples"),
            v.get("baseline_samples"),
            v.get("baseline_session"),
        )
        for v in record.get("regression") or []
    ]
    samples = None if requests is None else sample_rows(record["run_id"], requests)
    series = [(record["run_id"], point, *(_finite(values.get(name)) for name in SERIES_COLUMNS))
              for point, values in enumerate(record.get("series") or [])
              if isinstance(values, dict)]
    return GateRows(record["run_id"], run, samples, verdicts, (with_version, parts), series)


def _finite(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def create(db: sqlite3.Connection) -> None:
    """The tables, in the connection's open transaction (an older `gate_runs` gets its
    validity column, an older `request_samples` its later columns)."""
    # One statement at a time: executescript would commit the open transaction.
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    _add_validity(db)
    _add_sample_columns(db)


def write(db: sqlite3.Connection, runs: Iterable[GateRows]) -> int:
    """Upserts runs' rows, in the connection's open transaction; returns how many. Each kind
    of row goes in one executemany (an ingest writes 100,000 runs from one process)."""
    runs = list(runs)
    if not runs:
        return 0
    parts = dict(rows.parts for rows in runs)
    db.executemany(f"INSERT OR IGNORE INTO [{FINGERPRINTS}] VALUES (?, ?)", parts.items())
    db.executemany(
        f"INSERT OR REPLACE INTO [{RUNS}] (run_id, fingerprint, fingerprint_any_version, "
        "fingerprint_parts, suite, case_id, session_id, timestamp, repeat_index, status, "
        "gate, results, validity) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [rows.run for rows in runs],
    )
    db.executemany(f"DELETE FROM [{VERDICTS}] WHERE run_id = ?", [(r.run_id,) for r in runs])
    db.executemany(
        f"INSERT INTO [{VERDICTS}] VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [verdict for rows in runs for verdict in rows.verdicts],
    )
    # Request samples only where the run's per-request rows are known: what is stored stays.
    sampled = [rows for rows in runs if rows.samples is not None]
    db.executemany(f"DELETE FROM [{SAMPLES}] WHERE run_id = ?", [(r.run_id,) for r in sampled])
    db.executemany(
        f"INSERT INTO [{SAMPLES}] ({', '.join(_SAMPLE_COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(_SAMPLE_COLUMNS))})",
        [sample for rows in sampled for sample in rows.samples or ()],
    )
    db.executemany(f"DELETE FROM [{SERIES}] WHERE run_id = ?", [(r.run_id,) for r in runs])
    db.executemany(
        f"INSERT INTO [{SERIES}] VALUES ({', '.join('?' * (len(SERIES_COLUMNS) + 2))})",
        [point for rows in runs for point in rows.series],
    )
    return len(runs)


def load_runs(
    db_path: Path, runs: Iterable[tuple[dict[str, Any], list[dict[str, Any]] | None]]
) -> int:
    """Upsert records (with their per-request rows, where known) into the gate's tables."""
    runs = list(runs)
    if not runs:
        return 0
    with writing(db_path) as db:
        return write(db, (gate_rows(record, requests) for record, requests in runs))
