"""Session state: what a test-running process needs (engine, pool, its server) and what the
controller does with records (write each as it arrives, load them all into SQLite at the end).

Without xdist one process plays both roles; with xdist the workers run cases and hand their
records to the controller through test reports, and only the controller writes files.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.cluster.wire import NodeError, NodeLost
from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.hosts.devices import cpu_pool, device_kind, real_gpus
from pytest_profllm.hosts.nvml import GpuBusy
from pytest_profllm.hosts.pool import (
    HostPool,
    LeaseTimeout,
    SessionTurns,
    default_pool_dir,
    make_pool,
)
from pytest_profllm.options import Settings
from pytest_profllm.plan.case import Case
from pytest_profllm.results.record import Status, write_record, write_requests
from pytest_profllm.run.serve import CaseFailed, CaseOutcome, run_case
from pytest_profllm.server.process import ServerLost, ServerStartError, WorkerServers

RECORD_PROPERTY = "profllm_record"
REQUESTS_PROPERTY = "profllm_requests"
# The record a case gets if its worker dies (or the session is interrupted) before it ends;
# it leaves with the setup report, so the controller has it before the case runs.
STARTED_PROPERTY = "profllm_started"
# How long the load at the end waits for another process's lock on the database.
DB_LOCK_WAIT_S = 30.0
_DB_FIRST_TRY_S = 1.0
# The outcome of the case an item ran; its record leaves with the item's teardown report.
OUTCOME_KEY = pytest.StashKey[CaseOutcome]()
# Errors that fail a case with their own one-line message, not a traceback.
CASE_ERRORS = (ServerStartError, ServerLost, LeaseTimeout, GpuBusy, CaseFailed, NodeLost, NodeError)


def new_session_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunIdentity:
    """Decided once by the controller and handed to every worker."""

    session_id: str
    engine: EngineChoice

    def to_workerinput(self) -> dict[str, Any]:
        engine = self.engine
        vllm = engine.vllm.as_record() if engine.vllm is not None else None
        return {
            "session_id": self.session_id,
            "name": engine.name,
            "reason": engine.reason,
            "version": engine.version,
            "vllm": vllm,
        }

    @classmethod
    def from_workerinput(cls, data: dict[str, Any]) -> RunIdentity:
        vllm = VllmInstall.from_record(data["vllm"]) if data.get("vllm") else None
        engine = EngineChoice(data["name"], data["reason"], data["version"], vllm)
        return cls(data["session_id"], engine)


def host_pool(settings: Settings, engine: EngineChoice) -> HostPool:
    """NVML's GPUs for vLLM, CPU core sets where vLLM runs on CPU, virtual GPUs for the
    simulator (`real_gpus`); ValueError for devices the host lacks."""
    kind = device_kind(engine)
    if kind == "cpu":
        return cpu_pool(default_pool_dir(), settings.cpus, settings.ports)
    return make_pool(default_pool_dir(), settings.gpus, settings.ports, real_gpus(kind))


@functools.cache
def _device_capacity(settings: Settings, engine: EngineChoice) -> int:
    return len(host_pool(settings, engine).gpu_ids)


def session_turns(pool: HostPool, identity: RunIdentity) -> SessionTurns:
    return SessionTurns(pool.directory / "turns" / identity.session_id)


def skip_reason(case: Case, settings: Settings, engine: EngineChoice) -> str | None:
    """Why a case cannot run in this pool at all, known before anything starts."""
    if settings.ray is not None:
        return None  # the Ray cluster's nodes hold the GPUs: checked when the groups go out
    capacity = _device_capacity(settings, engine)
    if case.gpus_needed > capacity:
        if device_kind(engine) == "cpu":
            return (
                f"needs {case.gpus_needed} CPU core sets (tensor x pipeline x data parallel "
                f"size) but the pool has {capacity} (--profllm-cpus)"
            )
        return (
            f"needs {case.gpus_needed} GPUs (tensor x pipeline x data parallel size) "
            f"but the pool has {capacity} (--profllm-gpus)"
        )
    return None


@dataclass
class WorkerSession:
    """The case-running side: leases, one server at a time, and the outcome of each case."""

    settings: Settings
    identity: RunIdentity
    worker: str
    ranks: dict[str, int] = field(default_factory=dict)  # under xdist: the scheduler's order

    @functools.cached_property
    def pool(self) -> HostPool:
        return host_pool(self.settings, self.identity.engine)

    @functools.cached_property
    def servers(self) -> WorkerServers:
        out = self.settings.out_dir
        log_dir = out / "logs" if out else Path(tempfile.mkdtemp(prefix="profllm-logs-"))
        return WorkerServers(
            engine=self.identity.engine.name,
            vllm=self.identity.engine.vllm,
            device=device_kind(self.identity.engine),
            pool=self.pool,
            log_dir=log_dir,
            startup_timeout=self.settings.startup_timeout,
            lease_timeout=self.settings.lease_timeout,
            wait_for_busy_gpus=self.settings.wait_for_busy_gpus,
            ranks=self.ranks,
            turns=session_turns(self.pool, self.identity) if self.ranks else None,
            profile_root=out / "profiles" if out else None,
            sim_device=self.settings.sim_device,
        )

    def _outcome(self, case: Case, nodeid: str) -> CaseOutcome:
        return CaseOutcome(
            case=case,
            nodeid=nodeid,
            session_id=self.identity.session_id,
            engine=self.identity.engine,
            worker=self.worker,
            started_at=time.time(),
            sim_device=self.settings.sim_device,
        )

    def run(self, case: Case, nodeid: str, stash: pytest.Stash) -> CaseOutcome:
        outcome = stash[OUTCOME_KEY] = self._outcome(case, nodeid)
        try:
            if case.kind != "serve":
                from pytest_profllm.offline.runner import run_offline

                return run_offline(case, self.servers, outcome)
            return run_case(case, self.servers, outcome, self.settings.max_schedule_lag_ms)
        except BaseException as error:
            outcome.error = str(error).splitlines()[0] if str(error) else type(error).__name__
            outcome.finished_at = time.time()
            raise

    def started_record(self, case: Case, nodeid: str) -> dict[str, Any]:
        """The record of this case if it never finishes: `error`, its reason filled in later."""
        return self._outcome(case, nodeid).record("error", "started, never finished")

    def after_case(self, next_case: Case | None) -> None:
        if "servers" in self.__dict__:
            self.servers.after_case(next_case)

    def close(self) -> None:
        if "servers" in self.__dict__:
            self.servers.release()


def status_of(reports: dict[str, Any], outcome: CaseOutcome) -> tuple[Status, str | None]:
    """The record's status: `error` when the case produced no measurement (its server did not
    start, a fixture failed), `invalid` when the client fell behind (the figures measure it,
    not the server), `failed` when it was measured and missed a threshold or an assert.
    """
    for when in ("setup", "call"):
        report = reports.get(when)
        if report is not None and report.failed:
            if outcome.invalid_reason and outcome.results:
                return "invalid", outcome.invalid_reason
            measured = bool(outcome.results)
            return ("failed" if measured else "error"), _short(report)
    return "passed", None


def _short(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.splitlines()[0] if text else "failed"


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
        self.receive(record, None)

    def receive(self, record: dict[str, Any], requests: list[dict[str, Any]] | None) -> str | None:
        """Keep a record and write it; returns why it could not be written, or None. A failed
        write (a full disk) fails this case, never the session: the next cases run."""
        self.records.append(record)
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
        from pytest_profllm.results.store import load_records

        try:
            return load_records(db, self.records, busy_timeout_s=_DB_FIRST_TRY_S)
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise
        say(
            f"profllm: {db} is locked by another process; waiting up to {DB_LOCK_WAIT_S:.0f} s "
            f"to load {len(self.records)} record(s)"
        )
        return load_records(db, self.records, busy_timeout_s=DB_LOCK_WAIT_S)

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
        return f"{db}: {what}: nothing loaded; {kept}: load them with: profllm ingest {db} {out}"


def _started_at(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"]).timestamp()


def worker_name() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


SETTINGS_KEY = pytest.StashKey[Settings]()
IDENTITY_KEY = pytest.StashKey[RunIdentity]()
WORKER_KEY = pytest.StashKey[WorkerSession]()


def worker_session(config: pytest.Config) -> WorkerSession:
    """This process's case runner, made on the first case it runs."""
    if WORKER_KEY not in config.stash:
        from pytest_profllm.session.xdist_scheduling import RANKS_KEY

        config.stash[WORKER_KEY] = WorkerSession(
            config.stash[SETTINGS_KEY],
            config.stash[IDENTITY_KEY],
            worker_name(),
            ranks=config.stash.get(RANKS_KEY, {}),
        )
    return config.stash[WORKER_KEY]
