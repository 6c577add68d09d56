"""The controller's side of a session (the only process that writes): each record written as it
arrives, records for cases that never ended, and at the end all of them loaded into SQLite.
Without xdist the one process is both worker and controller."""

from __future__ import annotations

import copy
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.gates.controller import GATE_CONTROLLER_KEY
from pytest_profllm.options import Settings
from pytest_profllm.results.record import upgrade_keys
from pytest_profllm.results.record_files import write_record, write_requests
from pytest_profllm.results.store import load_records
from pytest_profllm.session.identity import RunIdentity, host_pool, session_turns
from pytest_profllm.session.resume import REJUDGED_PROPERTY, RESUMED_PROPERTY, ResumeIndex
from pytest_profllm.session.worker import (
    GATE_ASKED_PROPERTY,
    RECORD_PROPERTY,
    REQUESTS_PROPERTY,
    STARTED_PROPERTY,
)

# How long the load at the end waits for another process's lock on the database.
DB_LOCK_WAIT_S = 30.0
_DB_FIRST_TRY_S = 1.0


def check_writable(settings: Settings) -> str | None:
    """Why the records or the database could not be written, known before anything starts."""
    for option, folder in (
        ("--profllm-out", settings.out_dir),
        ("--profllm-db", settings.db_path.parent if settings.db_path else None),
    ):
        if folder is None:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            return f"{option}: cannot write to {folder}: {error.strerror or error}"
    return None


@dataclass
class ControllerSession:
    """The writing side: each record on arrival, then all of them into SQLite."""

    settings: Settings
    identity: RunIdentity
    records: list[dict[str, Any]] = field(default_factory=list)
    # Each received record's per-request rows (None: not known), by run id: loaded with the
    # records, into the gate's tables, in the same transaction.
    requests: dict[str, list[dict[str, Any]] | None] = field(default_factory=dict)
    loaded_rows: int | None = None
    unwritten: int = 0  # records that could not be written (a full disk)
    # Set when the database load at the end failed: what happened and how to load later.
    load_problem: str | None = None
    # Set when the session was stopped by a signal: the records of cases it cut short say so.
    interrupted_by: str | None = None
    # Records of servers still running, by server lifetime: their stop time comes later.
    _running: dict[tuple[Any, ...], list[dict[str, Any]]] = field(default_factory=dict)
    # Cases started and not yet ended, by node id: the record each gets if it never ends.
    _started: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The records of started cases whose worker crashed (built at their setup, before their
    # server, if they started one, was up): the summary says what it could not count.
    lost_records: list[dict[str, Any]] = field(default_factory=list)
    # With --profllm-resume: the earlier records, and how many stand for cases of this session.
    resume: ResumeIndex | None = None
    resumed: int = 0

    def started(self, nodeid: str, record: dict[str, Any]) -> None:
        self._started[nodeid] = record

    def ended(self, nodeid: str) -> None:
        self._started.pop(nodeid, None)

    def lost(self, nodeid: str, reason: str) -> None:
        """A started case that will never report (its worker crashed): an `error` record."""
        record = self._started.pop(nodeid, None)
        if record is None:
            return  # never started: nothing was measured, nothing to say
        record["message"] = reason
        record["duration"] = max(0.0, time.time() - _started_at(record))
        self.lost_records.append(record)
        self.receive(record, None)

    def add_resumed(
        self, run_id: str, rejudged: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """An earlier session's record that stands for a case resumed here: it joins this
        session's records (and database load) as it is, its file already written; or, where
        the current thresholds fail it (`rejudged`), as they judge it, its file rewritten."""
        record = self.resume.records.get(run_id) if self.resume is not None else None
        if record is None:
            return None
        if rejudged:
            # An older record's keys under their current names: its `verdicts` would
            # otherwise stand beside the new `threshold_results`.
            record = {**upgrade_keys(copy.deepcopy(record)), **rejudged}
            out = self.settings.out_dir
            if out is not None:
                try:
                    write_record(out, record)
                except OSError as error:
                    record["message"] += f" (not written to {out}: {error.strerror or error})"
        self.records.append(record)
        self.resumed += 1
        return record

    def receive(self, record: dict[str, Any], requests: list[dict[str, Any]] | None) -> str | None:
        """Keep a record and write it; returns why it could not be written, or None. A failed
        write (a full disk) fails this case, never the session: the next cases run."""
        self.records.append(record)
        self.requests[record["run_id"]] = requests
        out = self.settings.out_dir
        if out is None:
            return None
        try:
            for earlier in self._stop_time_known(record):
                write_record(out, earlier)
            write_record(out, record)
            if requests is not None:
                write_requests(out, record["run_id"], requests)
        except OSError as error:
            problem = f"record not written to {out}: {error.strerror or error}"
            record["status"], record["message"] = "error", problem
            self.unwritten += 1
            return problem
        return None

    def _stop_time_known(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """A server's stop time is known only at its last case: give it to its earlier cases'
        records too, so every record shows the server's whole lifetime. Returns those records."""
        runtime = record.get("runtime") or {}
        if runtime.get("server_started_at") is None:
            return []
        lifetime = (runtime.get("worker"), runtime.get("server_key"), runtime["server_started_at"])
        stopped = runtime.get("server_stopped_at")
        if stopped is None:
            self._running.setdefault(lifetime, []).append(record)
            return []
        earlier = self._running.pop(lifetime, [])
        for other in earlier:
            other["runtime"]["server_stopped_at"] = stopped
        return earlier

    def forget_turns(self) -> None:
        pool = host_pool(self.settings, self.identity.engine)
        shutil.rmtree(session_turns(pool, self.identity).directory, True)

    def finish(self, say: Callable[[str], None]) -> None:
        """Records for cases that never ended, then every record into the database. A locked
        or full database costs the load, never the records: `load_problem` says how to load
        them later."""
        reason = (
            f"interrupted by {self.interrupted_by} before the case finished"
            if self.interrupted_by
            else "the session stopped before the case finished"
        )
        for nodeid in list(self._started):
            self.lost(nodeid, reason)
        db = self.settings.db_path
        if db is None or not self.records:
            return
        try:
            self.loaded_rows = self._load(db, say)
        except (sqlite3.Error, OSError) as error:
            self.load_problem = self._load_failed(db, error)

    def _load(self, db: Path, say: Callable[[str], None]) -> int:
        try:
            return load_records(db, self.records, busy_timeout_s=_DB_FIRST_TRY_S,
                                requests=self.requests)
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise
        say(
            f"profllm: {db} is locked by another process; waiting up to {DB_LOCK_WAIT_S:.0f} s "
            f"to load {len(self.records)} record(s)"
        )
        return load_records(db, self.records, busy_timeout_s=DB_LOCK_WAIT_S,
                            requests=self.requests)

    def _load_failed(self, db: Path, error: BaseException) -> str:
        what = (
            f"still locked by another process after {DB_LOCK_WAIT_S:.0f} s"
            if "locked" in str(error)
            else str(getattr(error, "strerror", None) or error)
        )
        out = self.settings.out_dir
        if out is None:
            return f"{db}: {what}: nothing loaded (no --profllm-out: the records are lost)"
        written = len(self.records) - self.unwritten
        kept = (
            f"the {written} JSON record(s) in {out} are complete"
            if not self.unwritten
            else f"{written} JSON record(s) are in {out} ({self.unwritten} more could not be "
            "written: see their cases)"
        )
        # A locked or full database takes them later; one that cannot be read or written
        # (not a database, damaged, read-only) never will: then another file.
        broken = ("not a database", "malformed", "readonly", "unable to open", "I/O error")
        bad = any(word in str(error) for word in broken)
        target = db.with_name(f"{db.stem}-recovered{db.suffix}") if bad else db
        return (
            f"{db}: {what}: nothing loaded; {kept}: load them with: profllm ingest {target} {out}"
        )


def _started_at(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"]).timestamp()


CONTROLLER_KEY = pytest.StashKey[ControllerSession]()


class ControllerReports:
    """pytest hooks that see reports where they are processed (the controller, or the only
    process): the records leave the reports here, are written, and go to the gate."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.bad_suites = 0

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed and report.nodeid.endswith((".yaml", ".yml")):
            self.bad_suites += 1

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        # A bad suite file fails its own collection and the other suites still run, as they do
        # under xdist. An error in a Python test module still stops the run, as pytest does.
        if self.bad_suites and self.bad_suites == session.testsfailed:
            session.config.option.continue_on_collection_errors = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Take the records out of the report, so they are written once (here) and not copied
        # into JUnit XML by the plugins that read user_properties after us.
        ours = (
            RECORD_PROPERTY, REQUESTS_PROPERTY, STARTED_PROPERTY, RESUMED_PROPERTY,
            REJUDGED_PROPERTY, GATE_ASKED_PROPERTY,
        )
        properties = dict(report.user_properties)
        if not any(name in properties for name in ours):
            if report.when == "teardown":
                self._controller().ended(report.nodeid)
            return
        report.user_properties = [
            (name, value) for name, value in report.user_properties if name not in ours
        ]
        controller = self._controller()
        started = properties.get(STARTED_PROPERTY)
        if started is not None:
            controller.started(report.nodeid, started)  # type: ignore[arg-type]
        record = properties.get(RECORD_PROPERTY)
        if report.when != "teardown":
            return
        controller.ended(report.nodeid)
        resumed = properties.get(RESUMED_PROPERTY)
        if resumed is not None:
            rejudged = properties.get(REJUDGED_PROPERTY)
            earlier = controller.add_resumed(str(resumed), rejudged)  # type: ignore[arg-type]
            if earlier is not None:
                self.config.stash[GATE_CONTROLLER_KEY].receive(earlier, None)
        if record is None:
            return
        requests = properties.get(REQUESTS_PROPERTY)
        problem = controller.receive(record, requests)  # type: ignore[arg-type]
        asked = bool(properties.get(GATE_ASKED_PROPERTY))
        self.config.stash[GATE_CONTROLLER_KEY].receive(
            record, requests, asked  # type: ignore[arg-type]
        )
        if problem is not None:
            # The case fails, clearly; the session goes on with the next one.
            report.outcome = "failed"
            report.longrepr = f"{report.nodeid}: {problem}"

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: Any, sched: Any) -> None:
        # xdist lost the worker running this case: it gets an `error` record with the reason.
        controller = self._controller()
        reason = str(report.longrepr)
        if controller.interrupted_by:
            reason = f"interrupted by {controller.interrupted_by} before the case finished"
        controller.lost(crashitem, reason)

    def _controller(self) -> ControllerSession:
        return self.config.stash[CONTROLLER_KEY]
