"""Baselines: from a previous `results.db` (the gate's tables) or a folder of records (with
their `.requests.jsonl.gz`), the runs with the same fingerprint as a case. Where several
sessions match, the latest one is the baseline, all its repeats together. Only valid
measurements are a baseline (record.py's `validity`): never a run that measured nothing, whose
requests failed, or whose figures measure the client or counts the server made up.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_profllm.gates.samples import RunSamples, samples_of
from pytest_profllm.hosts.files import read_only_uri
from pytest_profllm.limits import load_json
from pytest_profllm.results import gate_tables as tables
from pytest_profllm.results.fingerprint import digests, upgraded
from pytest_profllm.results.ingest import read_record, record_files
from pytest_profllm.results.record import is_valid, read_requests
from pytest_profllm.results.table import TABLE


def is_database(path: Path) -> bool:
    return path.is_file() or path.suffix in (".db", ".sqlite", ".sqlite3")


@dataclass
class _Found:
    run_id: str
    session_id: str
    timestamp: str
    case_id: str = ""


@dataclass
class Baseline:
    """Read once per process, on the first case that asks."""

    path: Path
    with_version: bool = True
    _index: dict[str, list[_Found]] | None = None
    _records: dict[str, dict[str, Any]] = field(default_factory=dict)  # folder: run_id -> record

    def describe(self) -> str:
        runs = sum(len(found) for found in self._load().values())
        version = "" if self.with_version else ", any engine version"
        return f"baseline {self.path} ({runs} run(s){version})"

    def runs_for(self, record: dict[str, Any], sessions: int = 1) -> list[RunSamples]:
        """The runs of `record`'s fingerprint in the latest `sessions` other sessions (the
        gate's baseline is the latest one)."""
        chosen = set(self._earlier(record)[:sessions])
        if not chosen:
            return []  # nothing to read (the database may not exist yet)
        found = self._load().get(self._key(record), [])
        return self._samples([f.run_id for f in found if f.session_id in chosen])

    def latest(self) -> dict[str, tuple[str, list[RunSamples]]]:
        """Every fingerprint's case id and the runs of its latest session, all its repeats (as
        the gate takes a baseline): what `profllm compare` compares."""
        latest = {}
        for key, found in self._load().items():
            newest = max(found, key=lambda f: (f.timestamp, f.session_id))
            runs = [f for f in found if f.session_id == newest.session_id]
            latest[key] = (newest.case_id, self._samples([f.run_id for f in runs]))
        return latest

    def earlier_sessions(self, record: dict[str, Any]) -> int:
        """How many other sessions measured `record`'s fingerprint validly."""
        return len(self._earlier(record))

    def _key(self, record: dict[str, Any]) -> str:
        with_version, any_version = digests(record)
        return with_version if self.with_version else any_version

    def _earlier(self, record: dict[str, Any]) -> list[str]:
        """The other sessions of `record`'s fingerprint, latest first."""
        latest: dict[str, str] = {}
        session = record.get("session_id")
        for found in self._load().get(self._key(record), []):
            if found.session_id != session:
                latest[found.session_id] = max(latest.get(found.session_id, ""), found.timestamp)
        return sorted(latest, key=lambda s: (latest[s], s), reverse=True)

    def _load(self) -> dict[str, list[_Found]]:
        if self._index is None:
            self._index = self._read_database() if is_database(self.path) else self._read_folder()
        return self._index

    def _read_database(self) -> dict[str, list[_Found]]:
        index: dict[str, list[_Found]] = {}
        if not self.path.exists():
            return index
        column = "fingerprint" if self.with_version else "fingerprint_any_version"
        with _reading(self.path) as db:
            if not _has_table(db, tables.RUNS):
                return index
            found: dict[str, _Found] = {}
            for digest, run_id, session, timestamp, case_id in db.execute(
                f"SELECT {column}, run_id, session_id, timestamp, case_id FROM [{tables.RUNS}] "
                f"WHERE {tables.valid_runs(db)}"
            ):
                found[run_id] = _Found(run_id, session or "", timestamp or "", case_id or "")
                index.setdefault(digest, []).append(found[run_id])
            for run_id, keys in _accuracy_runs_stored_before_their_task(db).items():
                if run_id in found:
                    index.setdefault(keys[0 if self.with_version else 1], []).append(
                        found[run_id]
                    )
        return index

    def _read_folder(self) -> dict[str, list[_Found]]:
        index: dict[str, list[_Found]] = {}
        if not self.path.is_dir():
            return index
        for path in record_files([self.path]):
            try:
                record = read_record(path)
            except ValueError as error:
                raise ValueError(f"{path}: {error}") from None
            if not is_valid(record):
                continue
            with_version, any_version = digests(record)
            key = with_version if self.with_version else any_version
            self._records[record["run_id"]] = record
            index.setdefault(key, []).append(
                _Found(record["run_id"], record.get("session_id") or "", record["timestamp"],
                       record.get("case_id") or "")
            )
        return index

    def _samples(self, run_ids: list[str]) -> list[RunSamples]:
        if not is_database(self.path):
            return [
                samples_of(self._records[run_id], read_requests(self.path, run_id))
                for run_id in run_ids
            ]
        runs = []
        with _reading(self.path) as db:
            for run_id in run_ids:
                session, timestamp, results = db.execute(
                    f"SELECT session_id, timestamp, results FROM [{tables.RUNS}] WHERE run_id = ?",
                    (run_id,),
                ).fetchone()
                rows = db.execute(
                    f"SELECT ttft_ms, tpot_ms, e2el_ms, itl_ms FROM [{tables.SAMPLES}] "
                    "WHERE run_id = ? AND success ORDER BY request_index",
                    (run_id,),
                ).fetchall()
                runs.append(
                    RunSamples(
                        run_id=run_id,
                        session_id=session or "",
                        timestamp=timestamp or "",
                        results=json.loads(results or "{}"),
                        latencies=_latencies_from_rows(rows),
                    )
                )
        return runs


def _latencies_from_rows(rows: list[tuple[Any, ...]]) -> dict[str, Any]:
    def column(index: int) -> Any:
        return np.asarray([row[index] for row in rows if row[index] is not None], dtype=float)

    itl = [gap for row in rows for gap in _gaps(row[3])]
    return {
        "ttft": column(0),
        "tpot": column(1),
        "e2el": column(2),
        "itl": np.asarray(itl, dtype=float),
    }


def _reading(path: Path) -> closing[sqlite3.Connection]:
    """A read-only connection that waits up to 30 s for a writer's transaction."""
    return closing(sqlite3.connect(read_only_uri(path), uri=True, timeout=30))


def _accuracy_runs_stored_before_their_task(
    db: sqlite3.Connection,
) -> dict[str, tuple[str, str]]:
    """The accuracy runs of a database whose stored fingerprint predates the task's part
    (results/fingerprint.py), by run id, with the digests their records have now: an older
    database stays a baseline, for the same task only."""
    if not all(_has_table(db, name) for name in (tables.FINGERPRINTS, TABLE)):
        return {}
    columns = {row[1] for row in db.execute(f"PRAGMA table_info([{TABLE}])")}
    if not {"accuracy_task_hash", "accuracy_lm_eval_version"} <= columns:
        return {}
    keys = {}
    for run_id, stored, task_hash, lm_eval_version in db.execute(
        f"SELECT g.run_id, coalesce(f.parts, g.fingerprint_parts), b.accuracy_task_hash, "
        f"b.accuracy_lm_eval_version FROM [{tables.RUNS}] g "
        f"LEFT JOIN [{tables.FINGERPRINTS}] f ON f.fingerprint = g.fingerprint "
        f"JOIN [{TABLE}] b ON b.run_id = g.run_id WHERE b.accuracy_task_hash IS NOT NULL"
    ):
        try:
            parts = json.loads(stored)
        except (TypeError, ValueError):
            continue  # no parts kept: it matches as it was stored
        if isinstance(parts, dict) and "accuracy_task_hash" not in parts:
            keys[run_id] = upgraded(parts, task_hash, lm_eval_version)
    return keys


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    return db.execute(query, (name,)).fetchone() is not None


def _gaps(cell: Any) -> list[float]:
    """A stored row's inter-token gaps (a JSON list of numbers); a cell that holds anything
    else, in a database the user gave as a baseline, adds none."""
    try:
        gaps = load_json(cell, what="itl_ms") if isinstance(cell, str | bytes) else cell
    except ValueError:  # not JSON, or over limits.py's (InputLimitError is a ValueError)
        return []
    if not isinstance(gaps, list):
        return []
    return [float(gap) for gap in gaps
            if isinstance(gap, int | float) and not isinstance(gap, bool)]
