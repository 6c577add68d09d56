"""`profllm check`: whether a results database is whole, and whether it holds what its JSON
records say. SQLite's integrity check, the schema version, every table a load and a session
write (with the columns this plugin gives them), every run in each of the tables that hold one
row per run, and, given the records, every row against its record file (present, the same
status, validity, fingerprint and figures, its request samples) and every record file
against its row.

The database is opened read-only: a check changes nothing, and runs beside a session.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_profllm.results import gate_tables, schema_version
from pytest_profllm.results.facet_counts import FACET_COUNTS
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.ingest import read_record, record_files
from pytest_profllm.results.landing import AXES_TABLE, LANDING
from pytest_profllm.results.record import expected_requests, read_requests
from pytest_profllm.results.rows import record_row
from pytest_profllm.results.summaries import SUMMARIES
from pytest_profllm.results.table import TABLE, column_types

# The tables that hold one row per run, each beside `benchmark_runs`.
_PER_RUN = (LANDING, gate_tables.RUNS)
_GATE_TABLES = (
    gate_tables.RUNS,
    gate_tables.FINGERPRINTS,
    gate_tables.SAMPLES,
    gate_tables.VERDICTS,
    gate_tables.SERIES,
    gate_tables.CHANGE_POINTS,
)
# Every table a load or a session writes.
TABLES = (TABLE, LANDING, AXES_TABLE, FACET_COUNTS, *SUMMARIES, *_GATE_TABLES)
# What a run's row says of its outcome, compared with its record's.
_VERDICTS = ("status", "validity")
# Problems listed before the summary; the rest are counted.
_SHOWN = 50


class CheckError(Exception):
    """The database cannot be checked at all (missing, not a database, newer)."""


@dataclass
class CheckReport:
    """What a check found: problems, each naming its run where it has one."""

    db_path: Path
    version: int = 0
    tables: int = 0
    runs: int = 0
    records: int | None = None  # record files read, where a folder was given
    problems: list[tuple[str | None, str]] = field(default_factory=list)

    def problem(self, text: str, run_id: str | None = None) -> None:
        self.problems.append((run_id, text))

    @property
    def bad_runs(self) -> list[str]:
        """The runs named by a problem, each once, sorted."""
        return sorted({run_id for run_id, _ in self.problems if run_id is not None})

    def lines(self) -> list[str]:
        """The problems (the first 50), then one summary line."""
        shown = [text for _, text in self.problems[:_SHOWN]]
        if len(self.problems) > _SHOWN:
            shown.append(f"... and {len(self.problems) - _SHOWN} more problem(s)")
        what = (
            f"{self.db_path}: schema version {self.version}, {self.tables} table(s), "
            f"{self.runs} run(s)"
        )
        if self.records is not None:
            what += f", {self.records} record file(s)"
        if not self.problems:
            return [*shown, what + ": ok"]
        runs = self.bad_runs
        named = f" in {len(runs)} run(s): {', '.join(runs)}" if runs else ""
        return [*shown, f"{what}: {len(self.problems)} problem(s){named}"]


def check(db_path: Path, records: Path | None = None) -> CheckReport:
    """Checks the database at `db_path` (against the record files in `records`, if given)."""
    report = CheckReport(db_path)
    with _reading(db_path) as db:
        report.version = schema_version.refuse_newer(db, db_path)
        try:
            integrity = [row[0] for row in db.execute("PRAGMA integrity_check(20)")]
        except sqlite3.DatabaseError as error:  # a page so broken the check cannot go on
            integrity = [str(error)]
        if integrity != ["ok"]:
            for line in integrity:
                report.problem(f"integrity: {line}")
            return report  # what else it says cannot be trusted
        if report.version != schema_version.SCHEMA_VERSION:
            report.problem(
                f"schema version {report.version}, not this plugin's "
                f"{schema_version.SCHEMA_VERSION}: the next load (a session, "
                "profllm ingest) migrates it"
            )
        try:
            present = _tables(db, report)
            if TABLE not in present:
                return report
            stored = _per_run(db, present, report)
            if records is not None:
                _against_records(db, present, stored, records, report)
        except sqlite3.DatabaseError as error:  # what the integrity check did not see
            report.problem(f"cannot read: {error}")
    return report


@contextmanager
def _reading(db_path: Path) -> Iterator[sqlite3.Connection]:
    if not db_path.is_file():
        raise CheckError(f"{db_path}: no such database")
    try:
        connection = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as error:
        raise CheckError(f"{db_path}: cannot open: {error}") from None
    with closing(connection):
        try:
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.DatabaseError as error:
            raise CheckError(f"{db_path}: {error}") from None
        yield connection


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info([{table}])")}


def _tables(db: sqlite3.Connection, report: CheckReport) -> set[str]:
    """The plugin's tables present; a missing one, or a missing column, is a problem."""
    present = {
        name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    } & set(TABLES)
    report.tables = len(present)
    for name in TABLES:
        if name not in present:
            report.problem(f"table {name} is missing")
    # What this plugin's code makes of each table, against what the database has.
    with closing(sqlite3.connect(":memory:")) as fresh:
        gate_tables.create(fresh)
        wanted = {name: _columns(fresh, name) for name in _GATE_TABLES}
    wanted[TABLE] = set(column_types())
    for name, columns in wanted.items():
        if name in present and (missing := sorted(columns - _columns(db, name))):
            report.problem(
                f"table {name} lacks column(s) {', '.join(missing[:10])}"
                + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            )
    return present


def _per_run(db: sqlite3.Connection, present: set[str], report: CheckReport) -> set[str]:
    """Every run's id, and a problem for each run one of the per-run tables lacks, or holds
    without a row in benchmark_runs. Ids only: from the run id index, not the 7 KB rows."""
    stored = {run_id for (run_id,) in db.execute(f"SELECT run_id FROM [{TABLE}]")}
    report.runs = len(stored)
    for table in _PER_RUN:
        if table not in present:
            continue
        there = {run_id for (run_id,) in db.execute(f"SELECT run_id FROM [{table}]")}
        for run_id in sorted(stored - there):
            report.problem(f"run {run_id}: no row in {table}", run_id)
        for run_id in sorted(there - stored):
            report.problem(f"run {run_id}: a row in {table} but none in {TABLE}", run_id)
    return stored


def _against_records(
    db: sqlite3.Connection,
    present: set[str],
    stored: set[str],
    folder: Path,
    report: CheckReport,
) -> None:
    """Each record file against its rows, a run at a time (by primary key: a million 7 KB
    rows are never held at once), then each stored run against the files."""
    files = record_files([folder])
    report.records = len(files)
    has_gate, has_samples = gate_tables.RUNS in present, gate_tables.SAMPLES in present
    seen: set[str] = set()
    for path in files:
        try:
            record = read_record(path)
        except ValueError as error:
            report.problem(f"{path}: not a record: {error}")
            continue
        run_id = record["run_id"]
        seen.add(run_id)
        cursor = db.execute(f"SELECT * FROM [{TABLE}] WHERE run_id = ?", (run_id,))
        row = cursor.fetchone()
        if row is None:
            report.problem(f"run {run_id}: its record {path.name} has no row in {TABLE}", run_id)
            continue
        names = {d[0]: at for at, d in enumerate(cursor.description)}
        gate = (
            db.execute(
                f"SELECT fingerprint, results FROM [{gate_tables.RUNS}] WHERE run_id = ?", (run_id,)
            ).fetchone()
            if has_gate
            else None
        )
        for problem in _differences(record, row, names, gate):
            report.problem(f"run {run_id}: {problem} (record {path.name})", run_id)
        try:
            requests = read_requests(path.parent, run_id, expected_requests(record))
        except ValueError as error:
            report.problem(f"run {run_id}: its request file: {error}", run_id)
            continue
        if requests is None or not has_samples:
            continue
        (count,) = db.execute(
            f"SELECT count(*) FROM [{gate_tables.SAMPLES}] WHERE run_id = ?", (run_id,)
        ).fetchone()
        if count != len(requests):
            report.problem(
                f"run {run_id}: {count} request sample(s) stored, its request file "
                f"has {len(requests)}",
                run_id,
            )
    for run_id in sorted(stored - seen):
        report.problem(f"run {run_id}: no record file in {folder}", run_id)


def _differences(
    record: dict[str, Any],
    row: tuple[Any, ...],
    names: dict[str, int],
    gate: tuple[str, str] | None,
) -> Iterator[str]:
    """How a run's stored rows differ from its record: its status and validity, figures,
    then fingerprint."""
    built = record_row(record)
    # A record edited from passed to failed, or valid to invalid, keeps every figure.
    for name in _VERDICTS:
        if name in names and built[name] != row[names[name]]:
            yield f"{name} {row[names[name]]!r} stored, {built[name]!r} recorded"
    figures = [name for name in record.get("results") or {} if name in built]
    changed = [
        name
        for name in figures
        if not _same(built[name], row[names[name]] if name in names else None)
    ]
    if changed:
        shown = ", ".join(
            f"{name} {row[names[name]] if name in names else None!r} stored, "
            f"{built[name]!r} recorded"
            for name in changed[:3]
        )
        yield f"figures differ: {shown}" + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
    if gate is None:
        return
    fingerprint, results = gate
    if fingerprint != digests(record)[0]:
        yield "fingerprint differs from its record's"
    if json.loads(results or "{}") != json.loads(json.dumps(record.get("results") or {})):
        yield f"figures in {gate_tables.RUNS} differ from its record's"


def _same(recorded: Any, stored: Any) -> bool:
    if isinstance(recorded, float) and isinstance(stored, int | float):
        return recorded == stored or (math.isnan(recorded) and math.isnan(stored))
    return bool(recorded == stored)
