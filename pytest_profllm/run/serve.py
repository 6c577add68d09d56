"""Running one case: server, prompts, load, metrics, verdicts; and the record that says so.

The runner never prints and never raises for a missed threshold: it returns the outcome, and
the pytest item decides how to fail. The record is finished after the item's teardown, when
it is known whether its server stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from pytest_profllm.engine.choice import EngineChoice, redact
from pytest_profllm.engine.registry import registry_for
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.devices import client_off, cpu_model, device_kind, leased_cores
from pytest_profllm.load import metrics
from pytest_profllm.load.bench import load_settings, measure
from pytest_profllm.load.client import LoadResult, run_load
from pytest_profllm.load.dataset import Codec, ServerCodec, TokenizerCodec, make_prompts
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results.record import BenchmarkRecord, RegressionVerdict, Status, Verdict
from pytest_profllm.run.profiling import (
    PROFILE_PROMPTS,
    ProfilingFailed,
    profile_prefix,
    run_profiled,
)
from pytest_profllm.run.telemetry import Sampler
from pytest_profllm.server.process import ServerProcess, WorkerServers, describe_runtime
from pytest_profllm.sim.model_files import MODEL_DIR


class CaseFailed(Exception):
    """The case ran but must not pass: every request failed, a request got a non-200 status,
    or no output came back."""


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
    verdicts: list[Verdict] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    server: ServerProcess | None = None
    error: str | None = None
    telemetry: dict[str, float | int | None] = field(default_factory=dict)
    profiling: dict[str, Any] | None = None
    # Set when the client, not the server, set the pace: the figures do not measure the server.
    invalid_reason: str | None = None
    # The regression gate's verdicts (gates/worker.py), set after the case's call.
    regression: list[RegressionVerdict] = field(default_factory=list)
    sim_device: str | None = None  # the simulator's device profile (None: its default)

    @property
    def run_id(self) -> str:
        digest = hashlib.sha256(self.nodeid.encode()).hexdigest()[:10]
        return f"{self.session_id}-{digest}"

    @property
    def missed(self) -> list[Verdict]:
        return [verdict for verdict in self.verdicts if not verdict.passed]

    def record(self, status: Status, message: str | None) -> dict[str, Any]:
        case = self.case
        record = BenchmarkRecord(
            run_id=self.run_id,
            session_id=self.session_id,
            suite=case.suite,
            source=case.source,
            case_id=f"{case.source.split('/')[-1]}::{case.name}",
            nodeid=self.nodeid,
            repeat_index=case.repeat_index,
            timestamp=datetime.fromtimestamp(self.started_at, UTC).isoformat(),
            duration=(self.finished_at or time.time()) - self.started_at,
            status=status,
            message=message,
            engine=self._engine(),
            config=_config(case, self.engine),
            results={k: v for k, v in self.results.items() if not _bad_float(v)},
            system={**system_info(self.engine, self.server), **self.telemetry},
            runtime=describe_runtime(self.server, self.worker, case),
            profiling=self.profiling,
            thresholds={name: t.model_dump() for name, t in case.thresholds.items()},
            verdicts=self.verdicts,
            regression=self.regression,
        )
        return record.model_dump(mode="json")


    def _engine(self) -> dict[str, Any]:
        engine: dict[str, Any] = dict(self.engine.as_record())
        if self.engine.name == "sim":
            from pytest_profllm.sim.config import describe_server

            # Which device profile and model facts produced the simulator's figures.
            engine["sim"] = describe_server(self.case.server, self.sim_device)
        return engine


def _config(case: Case, engine: EngineChoice) -> dict[str, Any]:
    # Every engine argument, defaults included, so the database can filter on any of them;
    # the server key stays a hash of the suite's own values (Case.server).
    registry = registry_for(engine.name, engine.vllm)
    return {
        "server": redact(registry.complete(case.server)),
        "benchmark": case.benchmark.model_dump(mode="json"),
        "engine_args": registry.describe(),
    }


def _bad_float(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def run_case(
    case: Case,
    servers: WorkerServers,
    outcome: CaseOutcome,
    max_schedule_lag_ms: float | None = None,
) -> CaseOutcome:
    """Start or reuse the server, send the workload, compute metrics and verdicts."""
    bench = case.benchmark
    assert isinstance(bench, BenchmarkConfig), "offline kinds run in offline.runner"
    server = servers.server_for(case)
    outcome.server = server
    tokenizer = _tokenizer_for(case, servers.engine)
    codec: Codec = (
        TokenizerCodec.load(tokenizer)
        if tokenizer is not None
        else ServerCodec(server.base_url, _served_name(case.server), _api_key(case.server))
    )
    prompts = make_prompts(bench, codec)
    settings = load_settings(
        bench, server.base_url, _served_name(case.server), api_key=_api_key(case.server)
    )
    gpu_ids = server.lease.gpus if server.device == "gpu" else ()
    with (
        client_off(leased_cores(server.device, server.lease)),
        Sampler(server.pid, gpu_ids, f"{server.base_url}/metrics") as sampler,
    ):
        load = asyncio.run(_load_while_alive(server, run_load(settings, prompts)))
    if load is None or not server.alive():
        # The requests after its death failed at once: nothing here measures the server.
        raise servers.lost(server, server.lost_problem() or "died during the case")
    outcome.telemetry = sampler.summary()
    outcome.requests = [
        request_row(index, o, load.clock_start) for index, o in enumerate(load.outcomes)
    ]
    # A case passes only on a server that lived through it, on its own port: else no figure.
    if (problem := server.lost_problem()) is not None:
        raise servers.lost(server, problem)
    outcome.results, health = measure(load, bench, codec)
    outcome.results.update(health)
    outcome.verdicts = evaluate(case, outcome.results)
    check_served(load.outcomes, outcome.results)
    outcome.invalid_reason = metrics.client_fell_behind(health, max_schedule_lag_ms)
    if case.profile and server.profile_dir is not None:
        short = prompts[:PROFILE_PROMPTS]
        profiled = dataclasses.replace(settings, num_warmups=0)
        try:
            outcome.profiling = run_profiled(
                server.base_url,
                server.profile_dir,
                profile_prefix(outcome.run_id),
                len(short),
                lambda: asyncio.run(run_load(profiled, short)),
            )
        except ProfilingFailed as error:
            raise CaseFailed(f"profiling: {error}") from None
    outcome.finished_at = time.time()
    return outcome


_ALIVE_POLL_S = 0.5


async def _load_while_alive(
    server: ServerProcess, load: Coroutine[Any, Any, LoadResult]
) -> LoadResult | None:
    """The load's result, or None when the server exited first: the rest of the schedule is
    not sent (each request would fail at once, spaced by the arrival schedule)."""
    task = asyncio.ensure_future(load)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_ALIVE_POLL_S)
        if done:
            return task.result()
        if not server.alive():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def check_served(outcomes: list[metrics.RequestOutcome], results: dict[str, Any]) -> None:
    if (problem := metrics.served_problem(outcomes, results)) is not None:
        raise CaseFailed(problem)


def evaluate(case: Case, results: dict[str, float | int | None]) -> list[Verdict]:
    verdicts = []
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
            verdicts.append(
                Verdict(
                    metric=name,
                    bound=bound,
                    limit=limit,
                    value=None if value is None else float(value),
                    passed=passed,
                )
            )
    return verdicts


def describe_missed(missed: list[Verdict]) -> str:
    """The metric, its value and the bound first: pytest's short summary (-rA) keeps the
    first line of a failure only, cut to the terminal's width."""
    parts = []
    for verdict in missed:
        relation = "< min" if verdict.bound == "min" else "> max"
        value = "missing" if verdict.value is None else f"{verdict.value:.4g}"
        parts.append(f"{verdict.metric} = {value} {relation} {verdict.limit:g}")
    noun = "threshold" if len(parts) == 1 else "thresholds"
    return "; ".join(parts) + f" ({noun} missed)"


def _tokenizer_for(case: Case, engine: str) -> str | None:
    """A local tokenizer folder or file, or None to ask the server (no model download)."""
    tokenizer = getattr(case.benchmark, "tokenizer", None)
    if tokenizer:
        return str(tokenizer)
    model = str(case.server["model"])
    if engine == "sim":
        # The simulator serves its bundled tokenizer unless the model folder has one.
        return model if os.path.isfile(os.path.join(model, "tokenizer.json")) else str(MODEL_DIR)
    local = str(case.server.get("tokenizer") or model)
    return local if os.path.isfile(os.path.join(local, "tokenizer.json")) else None


def _api_key(server: dict[str, Any]) -> str | None:
    # vLLM takes one key or several (any of them is accepted): the client sends the first.
    key = server.get("api_key")
    if isinstance(key, list):
        key = key[0] if key else None
    return None if key is None else str(key)


def _served_name(server: dict[str, Any]) -> str:
    names = server.get("served_model_name")
    if isinstance(names, list) and names:
        return str(names[0])
    return str(names or server["model"])


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
        "ttft_s": outcome.ttft,
        "itl_s": outcome.itl,
        "latency_s": outcome.latency,
        "message_s": [t - clock_start for t in outcome.message_times],
        "end_s": outcome.end_time - clock_start if outcome.end_time else None,
        "error": outcome.error or None,
    }


def system_info(engine: EngineChoice, server: ServerProcess | None) -> dict[str, Any]:
    host = nvml.discover()
    kind = device_kind(engine)
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
