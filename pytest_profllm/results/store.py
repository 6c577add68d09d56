"""Loading records into the store (results/table.py's `benchmark_runs`, with results/landing.py's
landing table): an upsert on `run_id` in one `BEGIN IMMEDIATE` transaction with a busy timeout,
in WAL mode. Re-loading a record changes nothing (its `record_digest`, of its file's bytes, is
the same), concurrent writers wait their turn, readers (Datasette) read while a run writes, and
a failed load leaves the database as it was. `load_records` loads records in one go; `Load` is
the transaction itself, into which `profllm ingest` copies rows staged by other processes
(results/staging.py).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_profllm.results import gate_tables, schema_version
from pytest_profllm.results.facet_counts import (
    FACET_COUNTS,
    correct_statistics,
    refresh_facet_counts,
)
from pytest_profllm.results.gate_tables import GateRows, gate_rows
from pytest_profllm.results.landing import SweptAxes, refresh_landing
from pytest_profllm.results.rows import RowBuilder
from pytest_profllm.results.staging import STAGE, StagedRows, column_list, stage
from pytest_profllm.results.summaries import SUMMARIES, refresh_summaries
from pytest_profllm.results.table import PAGE_SIZE, TABLE, prepare_table, refresh_indexes

BUSY_TIMEOUT_MS = 30_000
# Pages kept in memory by a load (a bound, not a need: index pages of a million runs fit).
CACHE_KIB = 262_144


@dataclass
class LoadReport:
    """What a load did, by record: new rows, changed rows, rows already there as they are."""

    new: int = 0
    updated: int = 0
    unchanged: int = 0
    swept_axes: list[str] = field(default_factory=list)

    @property
    def stored(self) -> int:
        return self.new + self.updated + self.unchanged


def connect(
    db_path: Path, busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000, wal: bool = True
) -> Any:
    """A sqlite-utils Database in WAL mode (`wal`; else as the file is) that waits up to
    `busy_timeout_s` for other writers (then sqlite3.OperationalError: database is locked)."""
    # Deferred: sqlite-utils takes about 0.25 s to import; only a load needs it.
    import sqlite_utils

    db_path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(sqlite3.connect(db_path, timeout=busy_timeout_s))
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    # Pages that hold a 5-10 KB row (results/table.py). The page size of a new database only
    # (WAL mode fixes it).
    db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
    if wal:
        db.enable_wal()
    # In WAL mode NORMAL still never corrupts the database; a power cut may lose the last
    # transaction, whose records are safe on disk as JSON.
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    return db


def load_records(
    db_path: Path,
    records: Iterable[dict[str, Any]],
    busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000,
    requests: Mapping[str, list[dict[str, Any]] | None] | None = None,
) -> int:
    """Upsert records into `benchmark_runs` in one transaction (all or nothing: a full disk or
    an error leaves the database as it was); returns how many of them the table now holds
    (new, changed or already there). Waits up to `busy_timeout_s` for another writer.
    `requests`: given, each record's rows of the gate's tables go in the same transaction,
    with its per-request rows by run id (None or absent: not known; stored ones stay), so
    that no moment (a backup, a kill) sees a run in one table and not the other."""
    records = list(records)
    rows = RowBuilder()
    for record in records:
        rows.add(record)
    staged = stage(rows.batches())
    if staged is None:
        return 0
    with Load(db_path, busy_timeout_s) as load:
        load.add(staged)
        if requests is not None:
            load.add_gates([gate_rows(record, requests.get(record["run_id"]))
                            for record in records])
    return load.report.stored


def migrate(db_path: Path, busy_timeout_s: float | None = None) -> tuple[int, int]:
    """An existing database brought to this plugin's schema (an empty load, in one
    transaction); returns its schema version before and after."""
    if not db_path.is_file():
        raise FileNotFoundError(f"{db_path}: no such database")
    with Load(db_path, busy_timeout_s) as load:
        pass
    return load.schema_before, schema_version.SCHEMA_VERSION


class Load:
    """One loading transaction (`BEGIN IMMEDIATE`, so the digests read at its start stay
    true): staged rows go in batch by batch; leaving it without an error refreshes the swept
    axes, the indexes and the landing table and commits, an error rolls all of it back."""

    def __init__(self, db_path: Path, busy_timeout_s: float | None = None) -> None:
        self.db_path = db_path
        self.busy_timeout_s = BUSY_TIMEOUT_MS / 1000 if busy_timeout_s is None else busy_timeout_s
        self.report = LoadReport()
        self._fresh: list[str] = []
        self.schema_before = 0

    def __enter__(self) -> Load:
        # A new database is written with a rollback journal, then set to WAL mode: in WAL
        # mode each page is written twice (to the log, then into the file when the log is
        # checkpointed at the commit), which made the commit of 100,000 runs take 3.4 s of
        # the ingest's 26. A rollback journal keeps no copy of pages a new file never had.
        self._new = not self.db_path.exists() or self.db_path.stat().st_size == 0
        self.db = connect(self.db_path, self.busy_timeout_s, wal=not self._new)
        try:
            # Attached before the transaction: SQLite attaches nothing inside one.
            self.db.conn.execute(f"ATTACH ':memory:' AS {STAGE}")
            self.db.conn.execute("BEGIN IMMEDIATE")
            # Before any migration step: a newer database is left as it is.
            self.schema_before = schema_version.refuse_newer(self.db.conn, self.db_path)
            prepare_table(self.db)
            # Every table a load or a session writes, so that the version set at the commit
            # says what the database holds (gate_tables.create also migrates older ones).
            gate_tables.create(self.db.conn)
            if self.schema_before < schema_version.SCHEMA_VERSION and not self._new:
                gate_tables.rederive_fingerprints(self.db.conn)
            if not self._new:
                # A new database gets its indexes after its rows: built once, sorted, they
                # cost a fraction of keeping them up to date row by row.
                refresh_indexes(self.db)
            self.digests: dict[str, str] = dict(
                self.db.conn.execute(f"SELECT run_id, record_digest FROM [{TABLE}]")
            )
            self.axes = SweptAxes.read(self.db)
            self._columns = set(self.db.table(TABLE).columns_dict)
        except BaseException:
            self._close(commit=False)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._close(commit=kind is None)

    def stored_digests(self) -> dict[str, str]:
        """The run id of each stored record's digest."""
        return {digest: run_id for run_id, digest in self.digests.items() if digest}

    def add(self, staged: StagedRows, positions: Iterable[int] | None = None) -> None:
        """Writes the staged rows (those at `positions`, else all) that are new or changed."""
        report, digests = self.report, self.digests
        keep = []
        for at in range(len(staged.run_ids)) if positions is None else positions:
            run_id, digest = staged.run_ids[at], staged.digests[at]
            before = digests.get(run_id)
            if before == digest:
                report.unchanged += 1
                continue
            if before is None:
                report.new += 1
            else:
                report.updated += 1
            digests[run_id] = digest
            keep.append(at)
        if not keep:
            return
        connection = self.db.conn
        connection.deserialize(staged.image, name=STAGE)
        # Row ids of the staged rows count them from 1, in stage order.
        where = ("" if len(keep) == len(staged.run_ids)
                 else f"rowid IN ({', '.join(str(at + 1) for at in keep)})")
        self._add_columns(staged, where)
        connection.execute(f"INSERT OR REPLACE INTO main.[{TABLE}] ({column_list(staged.columns)}) "
                           + staged.select(staged.columns, where))
        watched = self.axes.watched(staged.columns)
        if watched:
            # Per suite, with the suite's declared axes (records before `axes` have none).
            lead = ["suite", "axes"] if "axes" in staged.columns else ["suite"]
            rows = connection.execute(
                staged.select([*lead, *watched], where, distinct=True)).fetchall()
            self.axes.see(watched, rows if len(lead) == 2 else [(r[0], None, *r[1:])
                                                                for r in rows])
        self._fresh += [staged.run_ids[at] for at in keep]

    def add_gates(self, runs: list[GateRows]) -> None:
        """The runs' rows of the gate's tables, in the same transaction as theirs."""
        if runs:
            gate_tables.write(self.db.conn, runs)

    def add_unchanged(self, count: int) -> None:
        """Records known by their digest to be stored as they are."""
        self.report.unchanged += count

    def _add_columns(self, staged: StagedRows, where: str) -> None:
        # Columns the schema does not know (an engine argument of a newer vLLM): typed by
        # their values, as sqlite-utils suggests.
        # SQLite's column names ignore case: `server_Xy` is the column `server_xy` too.
        known = {name.lower() for name in self._columns}
        extra = list({name.lower(): name for name in staged.columns
                      if name.lower() not in known}.values())
        if not extra:
            return
        # Deferred: sqlite-utils takes about 0.25 s to import; only a load needs it.
        from sqlite_utils.utils import suggest_column_types

        rows = self.db.conn.execute(staged.select(extra, where)).fetchall()
        suggested = suggest_column_types([dict(zip(extra, row, strict=True)) for row in rows])
        table = self.db.table(TABLE)
        for name in sorted(extra):
            table.add_column(name, suggested[name])
            self._columns.add(name)

    def _close(self, commit: bool) -> None:
        db = self.db
        try:
            if commit:
                if self._new:
                    refresh_indexes(db)
                changed = self.axes.write(db)
                self.report.swept_axes = self.axes.swept()
                refresh_landing(db, self.report.swept_axes, self._fresh, rebuild=changed)
                # What is taken from the rows again where a row changed (or it is missing).
                rows_changed = changed or bool(self._fresh)
                if rows_changed or not db[FACET_COUNTS].exists():
                    refresh_facet_counts(db.conn, self.report.swept_axes)
                if rows_changed or not all(db[name].exists() for name in SUMMARIES):
                    refresh_summaries(db.conn)
                correct_statistics(db.conn)  # after the ANALYZE refresh_landing ran
                schema_version.stamp(db.conn)
                db.conn.execute("COMMIT")
                if self._new:
                    # Where another writer has it open already, the next load sets WAL mode.
                    with contextlib.suppress(sqlite3.OperationalError):
                        db.enable_wal()
        finally:
            try:
                if db.conn.in_transaction:
                    db.conn.execute("ROLLBACK")
            finally:
                db.close()
