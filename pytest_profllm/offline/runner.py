"""An offline case: lease its devices, run its benchmark command in its own process group
(as a server runs: log file, timeout, the log's tail on failure, the group killed and checked
afterwards), read the JSON it wrote, and judge the thresholds.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pytest_profllm.engine.command import sim_args
from pytest_profllm.engine.registry import registry_for
from pytest_profllm.offline.commands import offline_command, offline_env
from pytest_profllm.offline.results import OfflineResultError, read_results
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import LatencyConfig, ThroughputConfig
from pytest_profllm.run.outcome import CaseFailed, CaseOutcome, check_thresholds
from pytest_profllm.run.telemetry import Sampler
from pytest_profllm.server.launch import safe_name, server_env, server_name
from pytest_profllm.server.process import LOG_TAIL_LINES, ServerProcess
from pytest_profllm.server.workers import WorkerServers


class OfflineBenchFailed(CaseFailed):
    """The benchmark command failed, timed out or wrote no result; the message carries the
    log's tail."""


@dataclass
class BenchProcess(ServerProcess):
    """A benchmark command: started and stopped as a server is, but it ends by itself."""

    kind: str = "throughput"

    def wait_done(self, timeout: float) -> int | None:
        """Its exit code, or None when it is still running after `timeout` seconds."""
        assert self._process is not None, "start() first"
        try:
            code = self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self.ready_at = time.time()  # the record's server_ready_at: when the command finished
        return code

    def describe(self) -> str:
        return f"vllm bench {self.kind} {self.label} ({self.engine}, {self.devices()})"

    def failure(self, what: str) -> OfflineBenchFailed:
        return OfflineBenchFailed(
            f"{self.describe()} {what}; log: {self.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{self.log_tail()}"
        )


def run_offline(
    case: Case,
    servers: WorkerServers,
    outcome: CaseOutcome,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> CaseOutcome:
    """Run the case's `vllm bench throughput|latency` (or the simulator's) on leased devices.

    `python` imports vLLM (default: this one); `env` is added to the command's environment.
    """
    bench = case.benchmark
    assert isinstance(bench, ThroughputConfig | LatencyConfig), "an offline case"
    lease = servers.lease_devices(case)
    name = f"{server_name(case)}-{safe_name(case.workload_label)}"
    output_json = servers.log_dir / f"{name}.{bench.kind}.json"
    if python is None and servers.vllm is not None:
        python = servers.vllm.python  # the chosen vLLM's environment, as its servers use
    argv = offline_command(
        servers.engine,
        bench,
        case.server,
        output_json,
        registry_for(servers.engine, servers.vllm),
        python,
    )
    if servers.engine == "sim":
        argv += sim_args(servers.sim_device, servers.sim_profile)
    process = BenchProcess(
        key=case.server_key,
        label=case.server_label,
        engine=servers.engine,
        argv=argv,
        env={**server_env(lease, servers.device), **offline_env(case.server), **(env or {})},
        log_path=servers.log_path(name),
        lease=lease,
        kind=bench.kind,
        device=servers.device,
    )
    outcome.server = process
    try:
        output_json.unlink(missing_ok=True)  # a file from an earlier run is not this run's
        process.start()
        gpu_ids = lease.gpus if servers.device == "gpu" else ()
        with Sampler(process.pid, gpu_ids, None) as sampler:
            code = process.wait_done(bench.timeout_s)
        outcome.telemetry = sampler.record()
        if code is None:
            raise process.failure(f"did not finish within {bench.timeout_s:g} s (timeout_s)")
        if code != 0:
            raise process.failure(f"exited with code {code}")
        try:
            outcome.results, outcome.requests = read_results(bench.kind, Path(output_json))
        except OfflineResultError as error:
            raise process.failure(str(error)) from None
    finally:
        # Whatever is left of its process group (vLLM's EngineCore, workers) goes too.
        process.stop(grace=5.0)
        lease.release()
    outcome.threshold_results = check_thresholds(case, outcome.results)
    outcome.finished_at = time.time()
    return outcome
