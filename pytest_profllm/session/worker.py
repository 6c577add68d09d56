"""The worker's side of a session (the process that runs cases): its lease pool and its one
server, each case's outcome and status, and the record it hands to the controller through the
test reports. Without xdist the one process is both worker and controller."""

from __future__ import annotations

import functools
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.gates.config import GATE_CONFIG_KEY
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.cores import LoadCores
from pytest_profllm.hosts.descriptors import raise_open_file_limit
from pytest_profllm.hosts.nvml import GpuBusy
from pytest_profllm.hosts.pool import HostPool, LeaseTimeout
from pytest_profllm.load import prometheus_counters, stages
from pytest_profllm.load.accuracy import lm_eval_missing
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.validity import Rules
from pytest_profllm.offline.runner import run_offline
from pytest_profllm.options import Settings
from pytest_profllm.plan.case import Case
from pytest_profllm.results.record import Status
from pytest_profllm.run.accuracy import run_accuracy
from pytest_profllm.run.capacity import run_capacity
from pytest_profllm.run.outcome import CaseFailed, CaseOutcome
from pytest_profllm.run.serve import run_case
from pytest_profllm.run.virtual import run_virtual_capacity, run_virtual_case
from pytest_profllm.run.virtual import skip_reason as virtual_skip_reason
from pytest_profllm.server.process import ServerLost, ServerStartError
from pytest_profllm.server.tracing import Tracing, wanting_spans
from pytest_profllm.server.workers import WorkerServers
from pytest_profllm.session.identity import (
    IDENTITY_KEY,
    SETTINGS_KEY,
    RunIdentity,
    host_pool,
    session_turns,
    worker_name,
)
from pytest_profllm.session.resume import (
    RESUME_INDEX_KEY,
    RESUMED_FAILURE_KEY,
    Earlier,
    skip_resumed,
)
from pytest_profllm.session.saturation import SaturationStop, request_rate
from pytest_profllm.session.xdist_scheduling import RANKS_KEY

RECORD_PROPERTY = "profllm_record"
REQUESTS_PROPERTY = "profllm_requests"
# Set on the record of a case the gate was asked to judge (its last repeat, measured), whether
# or not it measured a metric its `regression:` names: a baseline that compares none of them
# compared nothing.
GATE_ASKED_PROPERTY = "profllm_gate_asked"
# The record a case gets if its worker dies (or the session is interrupted) before it ends;
# it leaves with the setup report, so the controller has it before the case runs.
STARTED_PROPERTY = "profllm_started"
# The outcome of the case an item ran; its record leaves with the item's teardown report.
OUTCOME_KEY = pytest.StashKey[CaseOutcome]()
# Errors that fail a case with their own one-line message, not a traceback.
# (A Ray node's loss is a CaseFailed too: cluster/wire.py.)
CASE_ERRORS = (ServerStartError, ServerLost, LeaseTimeout, GpuBusy, CaseFailed)


@functools.cache
def _device_capacity(settings: Settings, engine: EngineChoice) -> int:
    return len(host_pool(settings, engine).gpu_ids)


def skip_reason(case: Case, settings: Settings, engine: EngineChoice) -> str | None:
    """Why a case cannot run in this pool at all, known before anything starts."""
    if settings.ray is not None:
        return None  # the Ray cluster's nodes hold the GPUs: checked when the groups go out
    capacity = _device_capacity(settings, engine)
    if case.gpus_needed > capacity:
        if engine.device_kind == "cpu":
            return (
                f"needs {case.gpus_needed} CPU core sets (tensor x pipeline x data parallel "
                f"size) but the pool has {capacity} (--profllm-cpus)"
            )
        return (
            f"needs {case.gpus_needed} GPUs (tensor x pipeline x data parallel size) "
            f"but the pool has {capacity} (--profllm-gpus)"
        )
    return None


def planned_record(
    case: Case, nodeid: str, settings: Settings, identity: RunIdentity
) -> dict[str, Any]:
    """The record a case would get before it runs (what resume compares with earlier ones),
    with as many devices as its server will lease (CPU core sets are not counted as GPUs)."""
    record = _outcome(case, nodeid, settings, identity, worker_name()).record("error", "planned")
    if identity.engine.device_kind != "cpu":
        record["runtime"]["gpus"] = ["?"] * case.gpus_needed
    return record


def host_gpu_names(settings: Settings, engine: EngineChoice) -> set[str] | None:
    """The device models this pool's GPUs are: an earlier record that ran on another cannot
    stand for a case here. Virtual and CPU devices have none; None: any (a Ray cluster's
    nodes hold the GPUs, unknown from here)."""
    if settings.ray is not None:
        return None
    if engine.device_kind != "gpu":
        return set()
    leased = set(host_pool(settings, engine).gpu_ids)
    return {gpu.name for gpu in nvml.discover().gpus if str(gpu.index) in leased}


def _outcome(
    case: Case, nodeid: str, settings: Settings, identity: RunIdentity, worker: str
) -> CaseOutcome:
    return CaseOutcome(
        case=case,
        nodeid=nodeid,
        session_id=identity.session_id,
        engine=identity.engine,
        worker=worker,
        started_at=time.time(),
        sim_device=settings.sim_device,
        gpu_hour_price=settings.gpu_hour_price,
        sim_profile=settings.sim_profile,
    )


@dataclass
class WorkerSession:
    """The case-running side: leases, one server at a time, and the outcome of each case."""

    settings: Settings
    identity: RunIdentity
    worker: str
    ranks: dict[str, int] = field(default_factory=dict)  # under xdist: the scheduler's order
    # The rate sweeps that saturated on this worker: their higher rates are skipped.
    saturation: SaturationStop = field(default_factory=lambda: SaturationStop(None))
    # This worker's time for measuring again (--profllm-remeasure), shared by its cases.
    remeasuring: RemeasureBudget = field(default_factory=RemeasureBudget)
    # The server keys whose groups `--profllm-trace-requests auto` traces on vLLM: they
    # measure capacity or are gated (server/tracing.py).
    wanting_spans: frozenset[str] = frozenset()

    @functools.cached_property
    def pool(self) -> HostPool:
        return host_pool(self.settings, self.identity.engine)

    @functools.cached_property
    def servers(self) -> WorkerServers:
        # This process runs the load client: its open-file limit is raised before the first
        # server starts, so the servers it starts inherit the raised limit too.
        raise_open_file_limit()
        out = self.settings.out_dir
        log_dir = out / "logs" if out else Path(tempfile.mkdtemp(prefix="profllm-logs-"))
        return WorkerServers(
            engine=self.identity.engine.name,
            vllm=self.identity.engine.vllm,
            device=self.identity.engine.device_kind,
            pool=self.pool,
            log_dir=log_dir,
            startup_timeout=self.settings.startup_timeout,
            lease_timeout=self.settings.lease_timeout,
            wait_for_busy_gpus=self.settings.wait_for_busy_gpus,
            ranks=self.ranks,
            turns=session_turns(self.pool, self.identity) if self.ranks else None,
            profile_root=out / "profiles" if out else None,
            sim_device=self.settings.sim_device,
            # The session's copy beside the logs: a server started late reads the bytes the
            # session checked, whatever became of the user's file since.
            sim_profile=self._profile_copy(log_dir),
            session_id=self.identity.session_id,
            tracing=Tracing(self.settings.trace_requests, self.wanting_spans),
            cores=(
                LoadCores.of(self.pool, self.identity.engine.device_kind)
                if self.settings.load_cores else None
            ),
        )

    def _profile_copy(self, log_dir: Path) -> Path | None:
        profile = self.settings.sim_profile
        if profile is None:
            return None
        try:
            return profile.copy_into(log_dir)
        except OSError as error:  # a full disk, a file where the logs' folder should be
            raise CaseFailed(
                f"cannot write the session's copy of {profile.path.name} in {log_dir}: "
                f"{error.strerror or error}"
            ) from None

    def _outcome(self, case: Case, nodeid: str) -> CaseOutcome:
        return _outcome(case, nodeid, self.settings, self.identity, self.worker)

    def run(self, case: Case, nodeid: str, stash: pytest.Stash) -> CaseOutcome:
        resumed_failure = stash.get(RESUMED_FAILURE_KEY, None)
        if resumed_failure is not None:
            # Measured by an earlier session, failed by the current thresholds: nothing runs,
            # and its record is the earlier one, judged again (session/resume.py).
            pytest.fail(resumed_failure, pytrace=False)
        outcome = stash[OUTCOME_KEY] = self._outcome(case, nodeid)
        virtual = self.identity.engine.clock == "virtual"
        # Known before its server is asked for: a skipped case starts nothing.
        reason = self.saturation.skip_reason(case) or (
            virtual_skip_reason(case) if virtual else None
        )
        if reason is None and case.kind == "accuracy":
            reason = lm_eval_missing()  # an optional extra: how to install it, in one line
        if reason is not None:
            outcome.skip_reason = reason
            outcome.finished_at = time.time()
            pytest.skip(reason)
        labels = prometheus_counters.CaseLabels(case.case_id, case.suite, case.server_label)
        try:
            with stages.running(labels, worker_name(), outcome.run_id):
                return self._run(case, outcome, virtual)
        except BaseException as error:
            outcome.error = str(error).splitlines()[0] if str(error) else type(error).__name__
            outcome.finished_at = time.time()
            raise
        finally:
            # Also a case that failed after its load was measured says whether it saturated.
            self.saturation.note(case, outcome.results, outcome.series)

    def _run(self, case: Case, outcome: CaseOutcome, virtual: bool) -> CaseOutcome:
        """The case run by its kind, in this process or on the virtual clock."""
        if virtual:  # no server: the engine model runs in this process
            run = run_virtual_capacity if case.kind == "capacity" else run_virtual_case
            return run(case, outcome, self.settings.sim_device, self.settings.sim_profile)
        if case.kind == "capacity":
            return run_capacity(
                case, self.servers, outcome, self.rules, self.settings.remeasure,
                self.remeasuring,
            )
        if case.kind == "accuracy":
            return run_accuracy(case, self.servers, outcome)
        if case.kind != "serve":
            return run_offline(case, self.servers, outcome)
        return run_case(
            case, self.servers, outcome, self.rules, self.settings.remeasure, self.remeasuring
        )

    @property
    def rules(self) -> Rules:
        """What counts as a measurement in this session (load/validity.py)."""
        return Rules(
            max_schedule_lag_ms=self.settings.max_schedule_lag_ms,
            max_client_overhead_ms=self.settings.max_client_overhead_ms,
            max_client_overhead_p99_ms=self.settings.max_client_overhead_p99_ms,
            max_foreign_cpu=self.settings.max_foreign_cpu,
            max_client_wait=self.settings.max_client_wait,
        )

    def started_record(self, case: Case, nodeid: str) -> dict[str, Any]:
        """The record of this case if it never finishes: `error`, its reason filled in later."""
        return self._outcome(case, nodeid).record("error", "started, never finished")

    def after_case(self, next_case: Case | None) -> None:
        if "servers" in self.__dict__:
            self.servers.after_case(next_case)

    def close(self) -> None:
        if "servers" in self.__dict__:
            self.servers.release()
            self.servers.close_receiver()


def status_of(reports: dict[str, Any], outcome: CaseOutcome) -> tuple[Status, str | None]:
    """The record's status: `error` when the case produced no measurement (its server did not
    start, a fixture failed), `invalid` when the client fell behind (the figures measure it,
    not the server), `failed` when it was measured and missed a threshold or an assert,
    `skipped` when it was not run (a lower rate of its sweep saturated).
    """
    if outcome.skip_reason is not None:
        return "skipped", outcome.skip_reason
    for when in ("setup", "call"):
        report = reports.get(when)
        # With --profllm-invalid skip, an invalid case's call is reported skipped.
        skipped_invalid = (report is not None and report.skipped and when == "call"
                           and bool(outcome.invalid_reason))
        if report is not None and (report.failed or skipped_invalid):
            # A case that raised (requests the server refused, a server lost) failed for
            # that reason first: it leads, whatever the schedule's verdict was.
            if outcome.invalid_reason and outcome.results and outcome.error is None:
                return "invalid", outcome.invalid_reason
            measured = bool(outcome.results)
            return ("failed" if measured else "error"), _short(report)
    return "passed", None


def _short(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.splitlines()[0] if text else "failed"


WORKER_KEY = pytest.StashKey[WorkerSession]()
WANTING_SPANS_KEY = pytest.StashKey[frozenset[str]]()
# The cases this process skips as measured by an earlier session, and their earlier records.
RESUMED_KEY = pytest.StashKey[list[tuple[Case, Earlier]]]()


def resume_cases(config: pytest.Config, items: list[Any], case_of: Any) -> None:
    """With --profllm-resume: skip the collected cases an earlier session measured."""
    index = config.stash.get(RESUME_INDEX_KEY, None)
    if index is None:
        return
    settings, identity = config.stash[SETTINGS_KEY], config.stash[IDENTITY_KEY]
    # The gate compares per-request samples pooled over a case's repeats with its baseline:
    # a gated case runs again where there is a baseline, so the current gate judges it.
    baseline = config.stash[GATE_CONFIG_KEY].baseline
    config.stash[RESUMED_KEY] = skip_resumed(
        items,
        case_of,
        index,
        lambda case, nodeid: planned_record(case, nodeid, settings, identity),
        host_gpu_names(settings, identity.engine),
        runs_again=lambda case: bool(case.regression) and baseline is not None,
    )


def note_wanting_spans(config: pytest.Config, items: list[Any], case_of: Any) -> None:
    """The collected server groups that `--profllm-trace-requests auto` traces on vLLM."""
    cases = (case for item in items if (case := case_of(item)) is not None)
    config.stash[WANTING_SPANS_KEY] = wanting_spans(cases, config.stash[SETTINGS_KEY].gated)


def worker_session(config: pytest.Config) -> WorkerSession:
    """This process's case runner, made on the first case it runs."""
    if WORKER_KEY not in config.stash:
        saturation = SaturationStop(config.stash[SETTINGS_KEY].saturation_margin)
        # A sweep resumed past a saturated rate still stops above it.
        for case, earlier in config.stash.get(RESUMED_KEY, []):
            rate = request_rate(case)
            if earlier.saturated is not None and rate is not None:
                saturation.mark(case, rate, earlier.saturated)
        config.stash[WORKER_KEY] = WorkerSession(
            config.stash[SETTINGS_KEY],
            config.stash[IDENTITY_KEY],
            worker_name(),
            ranks=config.stash.get(RANKS_KEY, {}),
            saturation=saturation,
            wanting_spans=config.stash.get(WANTING_SPANS_KEY, frozenset()),
        )
    return config.stash[WORKER_KEY]
