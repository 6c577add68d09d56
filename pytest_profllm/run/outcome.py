"""What one case produced, and the JSON record that says so: its results, threshold results,
validity and telemetry, the configuration it ran with (every engine argument), the system it
ran on, and the runtime of its server and lease. Serve and offline cases alike end here."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.engine.registry import registry_for
from pytest_profllm.engine.secrets import redact
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.cores import CoreLease
from pytest_profllm.hosts.devices import cpu_model
from pytest_profllm.load import loops, metrics
from pytest_profllm.load.prompt import DatasetError
from pytest_profllm.plan.case import Case, gpus_needed
from pytest_profllm.results.record import BenchmarkRecord, RegressionResult, Status, ThresholdResult
from pytest_profllm.run.cost import case_cost, energy_per_output_token, priced_gpus
from pytest_profllm.server.process import ServerProcess
from pytest_profllm.sim.config import describe_server
from pytest_profllm.sim.profile_file import ProfileSnapshot


class CaseFailed(Exception):
    """The case must not pass, for a reason its message states in full: every request failed,
    a request got a non-200 status, no output came back (or its Ray node was lost)."""


@contextlib.contextmanager
def dataset_refusals(case: Case) -> Iterator[None]:
    """A dataset file the loader refuses (an image that is not one, a line that is not JSON)
    fails the case in one line: the suite, then the loader's own file, line and key."""
    try:
        yield
    except DatasetError as error:
        raise CaseFailed(f"{case.source}: benchmark.dataset_path: {error}") from None


@dataclass
class CaseOutcome:
    """What one case produced; `record()` turns it into the JSON record."""

    case: Case
    nodeid: str
    session_id: str
    engine: EngineChoice
    worker: str
    started_at: float
    finished_at: float = 0.0
    results: dict[str, float | int | None] = field(default_factory=dict)
    threshold_results: list[ThresholdResult] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    server: ServerProcess | None = None
    error: str | None = None
    telemetry: dict[str, Any] = field(default_factory=dict)
    series: list[dict[str, float | None]] = field(default_factory=list)
    profiling: dict[str, Any] | None = None
    # Set when the figures do not measure the server: token counts that cannot be believed,
    # or a client that set the pace.
    invalid_reason: str | None = None
    # Set when requests failed (also when the suite allows them): the figures leave them out.
    request_failures: str | None = None
    # The regression gate's decisions (gates/worker.py), set after the case's call.
    regression: list[RegressionResult] = field(default_factory=list)
    sim_device: str | None = None  # the simulator's device profile (None: its default)
    # A profile file in its place (--profllm-sim-profile), as the session read it.
    sim_profile: ProfileSnapshot | None = None
    # A capacity case's search: the capacity, its bracket, the limiting SLO and every probe.
    capacity: dict[str, Any] | None = None
    # Set when the case was not run: why (its record is `skipped`, with this message).
    skip_reason: str | None = None
    # A conversation workload's figures per turn (load/conversation.py `by_turn`).
    by_turn: list[dict[str, Any]] | None = None
    # A LoRA mix's figures per model (load/lora_mix.py `by_adapter`).
    by_adapter: list[dict[str, Any]] | None = None
    # The host cores the load held while it was measured, and how long it waited for them.
    load_cores: CoreLease | None = None
    # The server's /metrics just before and just after the measured load (None: no answer).
    server_window: tuple[dict[str, float] | None, dict[str, float] | None] = (None, None)
    # The server's own latency histograms over the measured load (load/server_view.py), and
    # why there are none; None where no serve load ran.
    server_view: dict[str, Any] | None = None
    # What the prefix cache held when the measured load began (load/server_state.py).
    prefix_cache: str | None = None
    # Every run of the load (load/attempts.py); empty for kinds that do not re-measure.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # Where the client's open-file limit capped its connections, the line that says so.
    client_limit: str | None = None
    # The GPU-hour price its cost is computed at (--profllm-gpu-hour-price); None: no cost.
    gpu_hour_price: float | None = None
    # An accuracy case's evaluation (results/record.py `AccuracyResult`, as JSON).
    accuracy: dict[str, Any] | None = None
    # A load in rounds (`until:`): why it stopped, the interval reached, what it took
    # (load/until.py `Stop`, as JSON).
    until: dict[str, Any] | None = None

    @property
    def run_id(self) -> str:
        digest = hashlib.sha256(self.nodeid.encode()).hexdigest()[:10]
        return f"{self.session_id}-{digest}"

    @property
    def missed(self) -> list[ThresholdResult]:
        return [result for result in self.threshold_results if not result.passed]

    def record(self, status: Status, message: str | None) -> dict[str, Any]:
        case = self.case
        record = BenchmarkRecord(
            run_id=self.run_id,
            session_id=self.session_id,
            suite=case.suite,
            source=case.source,
            case_id=case.case_id,
            nodeid=self.nodeid,
            repeat_index=case.repeat_index,
            timestamp=datetime.fromtimestamp(self.started_at, UTC).isoformat(),
            duration=(self.finished_at or time.time()) - self.started_at,
            status=status,
            message=message,
            engine=self._engine(),
            config=_config(case, self.engine),
            results={k: v for k, v in self.results.items() if not _bad_float(v)},
            system={
                **system_info(self.engine, self.server),
                **self.telemetry,
                # The event loop the load client runs on (load/loops.py): asyncio or uvloop.
                "client_loop": loops.name(),
                "gpu_energy_j_per_output_token": energy_per_output_token(
                    self.telemetry.get("gpu_energy_j"), self.results, case.kind
                ),
            },
            runtime={
                **describe_runtime(self.server, self.worker, case, self.load_cores),
                **self._measured_how(),
            },
            cost=case_cost(
                self.gpu_hour_price,
                self.results,
                *priced_gpus(self.engine.device_kind, self._leased_devices()),
            ),
            profiling=self.profiling,
            thresholds={name: t.model_dump() for name, t in case.thresholds.items()},
            threshold_results=self.threshold_results,
            regression=self.regression,
            validity="invalid" if (reasons := self._invalid_because(message)) else "valid",
            validity_reasons=reasons,
            series=self.series,
            capacity=self.capacity,
            by_turn=self.by_turn,
            by_adapter=self.by_adapter,
            server_view=self.server_view,
            attempts=self.attempts,
            accuracy=self.accuracy,
            until=self.until,
        )
        return record.model_dump(mode="json")

    def _leased_devices(self) -> int:
        """How many GPUs (or virtual ones) the case's server leased: none before it had one. On
        the virtual clock no server leases anything, but the engine model serves on as many
        simulated GPUs as the real-time simulator would lease (vLLM's count), and is priced so:
        the same suite costs the same on either clock."""
        if self.server is not None:
            return len(self.server.lease.gpus)
        if self.engine.clock == "virtual" and self.results:
            return gpus_needed(self.case.server)
        return 0

    def _measured_how(self) -> dict[str, Any]:
        """The runtime facts of how the load was measured: its prompts' seed, the prefix cache
        it began with, and how many attempts it took."""
        bench = self.case.benchmark
        seed = getattr(bench, "seed", None)
        return {
            "prompt_seed": seed if isinstance(seed, int) else None,
            "prompt_seed_derived": self.case.seed_derived if isinstance(seed, int) else None,
            "prefix_cache": self.prefix_cache,
            "attempts": len(self.attempts) or None,
            "client_limit": self.client_limit,
        }

    def _invalid_because(self, message: str | None) -> list[str]:
        """Why this case's results are not a valid measurement (none: they are)."""
        results = self.results
        if not results or ("completed" in results and not results["completed"]):
            return [message or self.error or "nothing was measured"]
        # The requests the server failed first: they are the cause a reader looks for.
        reasons = [self.request_failures, self.invalid_reason]
        return [reason for reason in reasons if reason]

    def _engine(self) -> dict[str, Any]:
        engine: dict[str, Any] = dict(self.engine.as_record())
        if self.engine.name == "sim":
            # Which device profile and model facts produced the simulator's figures.
            if self.sim_profile is None:
                engine["sim"] = describe_server(self.case.server, self.sim_device)
            else:  # and which file priced them, by the digest of its bytes
                engine["sim"] = describe_server(self.case.server, self.sim_profile.profile)
                engine["sim_profile"] = self.sim_profile.identity()
        return engine


def _config(case: Case, engine: EngineChoice) -> dict[str, Any]:
    # Every engine argument, defaults included, so the database can filter on any of them;
    # the server key stays a hash of the suite's own values (Case.server).
    registry = registry_for(engine.name, engine.vllm)
    return {
        "server": redact(registry.complete(case.server)),
        "benchmark": case.benchmark.model_dump(mode="json"),
        "engine_args": registry.describe(),
        "axes": [key for key, _ in case.axis_values],
    }


def _bad_float(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def check_thresholds(
    case: Case, results: dict[str, float | int | None]
) -> list[ThresholdResult]:
    checked = []
    for name, threshold in case.thresholds.items():
        value = results.get(name)
        bounds: tuple[tuple[Literal["min", "max"], float | None], ...] = (
            ("min", threshold.min),
            ("max", threshold.max),
        )
        for bound, limit in bounds:
            if limit is None:
                continue
            passed = value is not None and (value >= limit if bound == "min" else value <= limit)
            checked.append(
                ThresholdResult(
                    metric=name,
                    bound=bound,
                    limit=limit,
                    value=None if value is None else float(value),
                    passed=passed,
                )
            )
    return checked


def describe_missed(missed: list[ThresholdResult]) -> str:
    """The metric, its value and the bound first: pytest's short summary (-rA) keeps the
    first line of a failure only, cut to the terminal's width."""
    parts = []
    for result in missed:
        relation = "< min" if result.bound == "min" else "> max"
        value = "missing" if result.value is None else f"{result.value:.4g}"
        parts.append(f"{result.metric} = {value} {relation} {result.limit:g}")
    noun = "threshold" if len(parts) == 1 else "thresholds"
    return "; ".join(parts) + f" ({noun} missed)"


def request_row(index: int, outcome: metrics.RequestOutcome, clock_start: float) -> dict[str, Any]:
    # Times in seconds from the benchmark's start, so every statistic can be recomputed later.
    return {
        "index": index,
        "success": outcome.success,
        "status": outcome.status,
        "prompt_len": outcome.prompt_len,
        "output_tokens": outcome.output_tokens,
        "intended_start_s": outcome.intended_start - clock_start,
        "dispatch_s": outcome.dispatch_time - clock_start,
        "start_s": outcome.start_time - clock_start,
        "schedule_lag_s": outcome.schedule_lag,
        # Its wait for a free slot under max_concurrency, before start_s (TTFT and latency
        # start at the send, as vLLM's).
        "client_queue_s": outcome.client_queue,
        "ttft_s": None if outcome.pooled else outcome.ttft,
        "itl_s": outcome.itl,
        "latency_s": outcome.latency,
        "message_s": [t - clock_start for t in outcome.message_times],
        "end_s": outcome.end_time - clock_start if outcome.end_time else None,
        "error": outcome.error or None,
        "conversation": outcome.conversation,
        "turn": outcome.turn,
        "model": outcome.model,
        "cached_tokens": outcome.cached_tokens,
        "mm_items": outcome.mm_items or None,
        "mm_tokens": outcome.mm_tokens,
    }


def system_info(engine: EngineChoice, server: ServerProcess | None) -> dict[str, Any]:
    host = nvml.discover()
    kind = engine.device_kind
    leased = set(server.lease.gpus) if server and kind == "gpu" else set()
    chosen = [gpu for gpu in host.gpus if str(gpu.index) in leased]
    if kind == "cpu":
        device_name: str | None = cpu_model()
    else:
        device_name = ", ".join(sorted({gpu.name for gpu in chosen})) or None
    return {
        "device_kind": kind,
        "device_name": device_name,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "gpu_names": [gpu.name for gpu in chosen],
        "gpu_uuids": [gpu.uuid for gpu in chosen],
        "driver_version": host.driver_version,
        "vllm_version": engine.version if engine.name == "vllm" else None,
    }


def describe_runtime(
    server: ServerProcess | None, worker: str, case: Case, cores: CoreLease | None = None
) -> dict[str, Any]:
    lease = server.lease if server else None
    on_cpu = server is not None and server.device == "cpu"
    return {
        "worker": worker,
        "server_key": case.server_key,
        "gpus": list(lease.gpus) if lease and not on_cpu else [],
        "cpus": list(lease.gpus) if lease and on_cpu else [],
        "gpu_uuids": list(lease.gpu_uuids) if lease else [],
        "port": lease.port if lease else None,
        "server_pid": server.pid if server else None,
        "server_started_at": server.started_at if server else None,
        "server_ready_at": server.ready_at if server else None,
        "server_stopped_at": server.stopped_at if server else None,
        "lease_wait_s": lease.wait_s if lease else None,
        "server_stop_problems": list(server.stop_problems) if server else [],
        "server_restart_reason": server.restart_reason if server else None,
        "server_log": server.log_path.name if server else None,
        "load_cores": cores.as_record() if cores else None,
        "load_core_wait_s": cores.wait_s if cores else None,
        "client_core_shared": client_core_shared(server, cores),
    }


def client_core_shared(server: ServerProcess | None, cores: CoreLease | None) -> str | None:
    """Why the load client measured without a core of its own, or None (it had one, or the
    case ran no load)."""
    if server is None or cores is None:
        return None
    if not cores.client:
        return "no load cores held (--profllm-no-load-cores): the client ran beside the server"
    shared = set(cores.client) & (set(cores.server) | server.launch_cores())
    if shared:
        return (f"the server also ran on the client's core(s) "
                f"{', '.join(map(str, sorted(shared)))} (a one-core host)")
    return None
