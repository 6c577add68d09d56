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
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm import gpus
from pytest_profllm.cluster.wire import NodeError, NodeLost
from pytest_profllm.engine import EngineChoice
from pytest_profllm.gpus import GpuBusy
from pytest_profllm.options import Settings
from pytest_profllm.plan import Case
from pytest_profllm.pool import (
    HostPool,
    LeaseTimeout,
    SessionTurns,
    default_pool_dir,
    make_pool,
)
from pytest_profllm.record import Status, write_record, write_requests
from pytest_profllm.runner import CaseFailed, CaseOutcome, run_case
from pytest_profllm.server import ServerStartError, WorkerServers

RECORD_PROPERTY = "profllm_record"
REQUESTS_PROPERTY = "profllm_requests"
# The outcome of the case an item ran; its record leaves with the item's teardown report.
OUTCOME_KEY = pytest.StashKey[CaseOutcome]()
# Errors that fail a case with their own one-line message, not a traceback.
CASE_ERRORS = (ServerStartError, LeaseTimeout, GpuBusy, CaseFailed, NodeLost, NodeError)


def new_session_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunIdentity:
    """Decided once by the controller and handed to every worker."""

    session_id: str
    engine: EngineChoice

    def to_workerinput(self) -> dict[str, Any]:
        return {"session_id": self.session_id, **self.engine.as_record()}

    @classmethod
    def from_workerinput(cls, data: dict[str, Any]) -> RunIdentity:
        return cls(data["session_id"], EngineChoice(data["name"], data["reason"], data["version"]))


def host_pool(settings: Settings) -> HostPool:
    real = [(str(gpu.index), gpu.uuid) for gpu in gpus.discover().gpus]
    return make_pool(default_pool_dir(), settings.gpus, settings.ports, real)


@functools.cache
def _gpu_capacity(settings: Settings) -> int:
    return len(host_pool(settings).gpu_ids)


def session_turns(pool: HostPool, identity: RunIdentity) -> SessionTurns:
    return SessionTurns(pool.directory / "turns" / identity.session_id)


def skip_reason(case: Case, settings: Settings) -> str | None:
    """Why a case cannot run in this pool at all, known before anything starts."""
    if settings.ray is not None:
        return None  # the Ray cluster's nodes hold the GPUs: checked when the groups go out
    capacity = _gpu_capacity(settings)
    if case.gpus_needed > capacity:
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
        return host_pool(self.settings)

    @functools.cached_property
    def servers(self) -> WorkerServers:
        out = self.settings.out_dir
        log_dir = out / "logs" if out else Path(tempfile.mkdtemp(prefix="profllm-logs-"))
        return WorkerServers(
            engine=self.identity.engine.name,
            pool=self.pool,
            log_dir=log_dir,
            startup_timeout=self.settings.startup_timeout,
            lease_timeout=self.settings.lease_timeout,
            wait_for_busy_gpus=self.settings.wait_for_busy_gpus,
            ranks=self.ranks,
            turns=session_turns(self.pool, self.identity) if self.ranks else None,
            profile_root=out / "profiles" if out else None,
        )

    def run(self, case: Case, nodeid: str, stash: pytest.Stash) -> CaseOutcome:
        outcome = stash[OUTCOME_KEY] = CaseOutcome(
            case=case,
            nodeid=nodeid,
            session_id=self.identity.session_id,
            engine=self.identity.engine,
            worker=self.worker,
            started_at=time.time(),
        )
        try:
            return run_case(case, self.servers, outcome, self.settings.max_schedule_lag_ms)
        except BaseException as error:
            outcome.error = str(error).splitlines()[0] if str(error) else type(error).__name__
            outcome.finished_at = time.time()
            raise

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


@dataclass
class ControllerSession:
    """The writing side: each record on arrival, then all of them into SQLite."""

    settings: Settings
    identity: RunIdentity
    records: list[dict[str, Any]] = field(default_factory=list)
    loaded_rows: int | None = None
    # Records of servers still running, by server lifetime: their stop time comes later.
    _running: dict[tuple[Any, ...], list[dict[str, Any]]] = field(default_factory=dict)

    def receive(self, record: dict[str, Any], requests: list[dict[str, Any]] | None) -> None:
        self.records.append(record)
        out = self.settings.out_dir
        for earlier in self._stop_time_known(record):
            if out is not None:
                write_record(out, earlier)
        if out is None:
            return
        write_record(out, record)
        if requests is not None:
            write_requests(out, record["run_id"], requests)

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
        shutil.rmtree(session_turns(host_pool(self.settings), self.identity).directory, True)

    def finish(self) -> None:
        from pytest_profllm.store import load_records

        if self.settings.db_path is not None and self.records:
            self.loaded_rows = load_records(self.settings.db_path, self.records)


def worker_name() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


SETTINGS_KEY = pytest.StashKey[Settings]()
IDENTITY_KEY = pytest.StashKey[RunIdentity]()
WORKER_KEY = pytest.StashKey[WorkerSession]()


def worker_session(config: pytest.Config) -> WorkerSession:
    """This process's case runner, made on the first case it runs."""
    if WORKER_KEY not in config.stash:
        from pytest_profllm.scheduler import RANKS_KEY

        config.stash[WORKER_KEY] = WorkerSession(
            config.stash[SETTINGS_KEY],
            config.stash[IDENTITY_KEY],
            worker_name(),
            ranks=config.stash.get(RANKS_KEY, {}),
        )
    return config.stash[WORKER_KEY]
