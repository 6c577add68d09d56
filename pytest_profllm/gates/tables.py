"""The gate's own tables in the results database, beside `benchmark_runs`:

- `gate_runs`: one row per run: its fingerprint (digest with and without the engine version,
  and the parts as JSON), its case, session, time, status and results (JSON);
- `request_samples`: one row per request of a run (TTFT, TPOT, E2EL, ITL list, in ms), the
  per-request samples a later run's latency verdicts resample;
- `regression_verdicts`: one row per gated metric of a run: verdict, baseline and new value,
  change and its confidence interval;
- `change_points`: what `profllm history` found.

Loading is an upsert keyed by run_id, in one `BEGIN IMMEDIATE` transaction, as the store does.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pytest_profllm.gates.fingerprint import digests, fingerprint

RUNS = "gate_runs"
SAMPLES = "request_samples"
VERDICTS = "regression_verdicts"
CHANGE_POINTS = "change_points"
_BUSY_TIMEOUT_MS = 30_000

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS [{RUNS}] (
    run_id TEXT PRIMARY KEY, fingerprint TEXT, fingerprint_any_version TEXT,
    fingerprint_parts TEXT, suite TEXT, case_id TEXT, session_id TEXT, timestamp TEXT,
    repeat_index INTEGER, status TEXT, gate TEXT, results TEXT
);
CREATE INDEX IF NOT EXISTS [{RUNS}_fingerprint] ON [{RUNS}] (fingerprint);
CREATE INDEX IF NOT EXISTS [{RUNS}_fingerprint_any_version] ON [{RUNS}] (fingerprint_any_version);
CREATE TABLE IF NOT EXISTS [{SAMPLES}] (
    run_id TEXT, request_index INTEGER, success INTEGER, output_tokens INTEGER,
    ttft_ms REAL, tpot_ms REAL, e2el_ms REAL, itl_ms TEXT,
    PRIMARY KEY (run_id, request_index)
);
CREATE TABLE IF NOT EXISTS [{VERDICTS}] (
    run_id TEXT, case_id TEXT, metric TEXT, verdict TEXT, tolerance REAL,
    higher_is_better INTEGER, baseline REAL, value REAL, change REAL, ci_low REAL, ci_high REAL,
    confidence REAL, samples INTEGER, baseline_samples INTEGER, baseline_session TEXT,
    PRIMARY KEY (run_id, metric)
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
            # One statement at a time: executescript would commit the open transaction.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(statement)
            yield connection
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
    finally:
        connection.close()


def gate_of(record: dict[str, Any]) -> str | None:
    """The run's overall verdict: the worst of its metrics', None where nothing was gated."""
    verdicts = {v["verdict"] for v in record.get("regression") or []}
    for verdict in ("regressed", "improved", "unchanged", "no-baseline"):
        if verdict in verdicts:
            return verdict
    return None


def sample_rows(run_id: str, requests: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    rows = []
    for row in requests:
        first, latency, tokens = row.get("ttft_s"), row.get("latency_s"), row.get("output_tokens")
        ttft = e2el = tpot = None
        if row.get("success") and first is not None and latency is not None:
            ttft, e2el = first * 1000, latency * 1000
            if tokens and tokens > 1:
                tpot = (latency - first) / (tokens - 1) * 1000
        rows.append(
            (
                run_id,
                row.get("index"),
                int(bool(row.get("success"))),
                tokens,
                ttft,
                tpot,
                e2el,
                json.dumps([gap * 1000 for gap in row.get("itl_s") or []]),
            )
        )
    return rows


def load_runs(
    db_path: Path, runs: Iterable[tuple[dict[str, Any], list[dict[str, Any]] | None]]
) -> int:
    """Upsert records (with their per-request rows, where known) into the gate's tables."""
    runs = list(runs)
    if not runs:
        return 0
    with writing(db_path) as db:
        for record, requests in runs:
            with_version, any_version = digests(record)
            db.execute(
                f"INSERT OR REPLACE INTO [{RUNS}] VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    record["run_id"],
                    with_version,
                    any_version,
                    json.dumps(fingerprint(record), sort_keys=True),
                    record.get("suite"),
                    record.get("case_id"),
                    record.get("session_id"),
                    record.get("timestamp"),
                    record.get("repeat_index"),
                    record.get("status"),
                    gate_of(record),
                    json.dumps(record.get("results") or {}, sort_keys=True),
                ),
            )
            if requests is not None:
                db.execute(f"DELETE FROM [{SAMPLES}] WHERE run_id = ?", (record["run_id"],))
                db.executemany(
                    f"INSERT INTO [{SAMPLES}] VALUES (?,?,?,?,?,?,?,?)",
                    sample_rows(record["run_id"], requests),
                )
            db.execute(f"DELETE FROM [{VERDICTS}] WHERE run_id = ?", (record["run_id"],))
            db.executemany(
                f"INSERT INTO [{VERDICTS}] VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        record["run_id"],
                        record.get("case_id"),
                        v["metric"],
                        v["verdict"],
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
                ],
            )
    return len(runs)
