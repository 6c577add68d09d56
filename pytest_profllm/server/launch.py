"""How a case's server is launched: its engine arguments (with the profiler where the case
profiles), the argv and environment it starts with, and the name of its log and trace folder.
`profllm plan` prints what `launch` returns, so the plan is the command that runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pytest_profllm.engine.choice import EngineName
from pytest_profllm.engine.command import serve_command, serve_env
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.engine.registry import Registry
from pytest_profllm.hosts.devices import DeviceKind, device_env
from pytest_profllm.hosts.pool import Lease
from pytest_profllm.plan.case import Case

HOST = "127.0.0.1"
SIM_NICE_ENV = "PROFLLM_SIM_NICE"  # the simulator's niceness increment (sim/cli.py)
# With a traces endpoint: spans in protobuf over HTTP (vLLM's SDK defaults to gRPC), in batches
# every 200 ms rather than the SDK's 5 s, so a case's spans come soon after its load.
TRACE_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
}


def launch(
    engine: EngineName,
    server: dict[str, Any],
    lease: Lease,
    registry: Registry | None = None,
    vllm: VllmInstall | None = None,
    device: DeviceKind = "gpu",
    sim_device: str | None = None,
    sim_profile: Path | None = None,
    traces_endpoint: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment (over the inherited one) a server starts with; with
    `traces_endpoint`, it exports each request's trace span there (load/span_receiver.py).

    `profllm plan` prints what this returns, so the plan is the command that runs.
    """
    argv = serve_command(
        engine, server, HOST, lease.port, registry, vllm, sim_device, sim_profile
    )
    # A key in the user's own environment would be enforced by the server on requests that
    # do not send it: a suite's key is passed on, no other.
    env = {**server_env(lease, device), "VLLM_API_KEY": "", **serve_env(server)}
    if engine == "sim":
        # The simulator lowers its own priority by default, below a load client beside it;
        # the plugin gives it a load core of its own instead (hosts/cores.py), where a lower
        # priority would only make it give way to the host's other work, and lowers it there
        # only where it shares the client's core (server/workers.py).
        env[SIM_NICE_ENV] = "0"
    if traces_endpoint:
        argv += ["--otlp-traces-endpoint", traces_endpoint]
        env.update(TRACE_ENV)
    return argv, env


def server_name(case: Case) -> str:
    """Names the server's log file and trace folder."""
    return f"{safe_name(case.suite)}-{case.server_label}-{case.server_key}"


def engine_args_for(case: Case, profile_root: Path) -> tuple[dict[str, Any], Path | None]:
    """The engine arguments a case's server starts with, and its trace folder when it profiles
    (vLLM's profiler is switched on by an engine argument)."""
    if not case.profile:
        return case.server, None
    trace_dir = profile_root / server_name(case)
    return profiled_server(case.server, trace_dir), trace_dir


def server_env(lease: Lease, device: DeviceKind = "gpu") -> dict[str, str]:
    # No VLLM_TORCH_PROFILER_DIR for a profiling server: vLLM 0.33.0 takes `--profiler-config`
    # (see profiled_server) and warns about that variable as unknown.
    return {
        **device_env(device, lease),
        # A private base for vLLM's internal ports: without it, servers on one host collide.
        "VLLM_PORT": str(lease.internal_port),
        # vLLM serves POST /reset_prefix_cache (and /reset_mm_cache) only in its development
        # mode: each case empties the cache that the cases before it filled
        # (load/server_state.py). The server listens on 127.0.0.1 alone, and its other
        # development routes are never called.
        "VLLM_SERVER_DEV_MODE": "1",
    }


def safe_name(name: str) -> str:
    """A name fit for a file name: runs of other characters become one `-`."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def profiled_server(server: dict[str, Any], trace_dir: Path) -> dict[str, Any]:
    """Engine arguments with the torch profiler on, writing into `trace_dir` (vLLM wants an
    absolute path). A suite's own `profiler_config` keeps its other settings."""
    own = server.get("profiler_config")
    config = dict(own) if isinstance(own, dict) else {}
    config["profiler"] = "torch"
    config["torch_profiler_dir"] = str(trace_dir.resolve())
    return {**server, "profiler_config": config}
