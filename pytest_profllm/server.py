"""A server process (vLLM or the simulator): start in its own process group, wait for
`/health`, stop with SIGTERM then SIGKILL of the whole group, then check that nothing of it
survives and (with NVML) that its GPU memory is free before the lease goes back.

`WorkerServers` keeps the one server this worker is using and swaps it when the server key
changes, so all cases of one server key share one start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pytest_profllm import gpus
from pytest_profllm.engine import EngineName, redact_argv, serve_command, serve_env
from pytest_profllm.engine_args import Registry, registry_for
from pytest_profllm.plan import Case
from pytest_profllm.pool import HostPool, Lease, SessionTurns
from pytest_profllm.profiling import profiled_server
from pytest_profllm.telemetry import process_tree

HOST = "127.0.0.1"
# How long a server waits for the one before it in the scheduler's order to reach the lease
# queue: seconds at most, since that one may still be finishing a case on a busy worker.
TURN_WAIT_CAP_S = 5.0
LOG_TAIL_LINES = 50
# How long the driver may take to free a stopped server's GPU memory before we say so.
GPU_RELEASE_TIMEOUT_S = 30.0
# SIGKILL reaches the members of a group asynchronously: a moment before calling one a survivor.
_SURVIVOR_GRACE_S = 2.0
_HEALTH_PROBE_TIMEOUT_S = 2.0
_LIKELY_CAUSES = (
    (
        re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I),
        "out of GPU memory",
    ),
    (re.compile(r"address already in use|Errno 98", re.I), "port already in use"),
    (
        re.compile(r"unrecognized arguments|invalid choice|error: argument", re.I),
        "bad engine argument",
    ),
    (
        re.compile(r"No such file or directory|does not exist|not a valid model", re.I),
        "model not found",
    ),
)


class ServerStartError(Exception):
    """The server died or never became ready; the message carries the log's tail."""


class ServerStopWarning(UserWarning):
    """A stopped server left something behind: a process, or GPU memory."""


@dataclass
class ServerProcess:
    key: str
    label: str
    engine: EngineName
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    lease: Lease
    started_at: float = 0.0  # Unix seconds, as the record's runtime block wants
    ready_at: float | None = None
    stopped_at: float | None = None
    profile_dir: Path | None = None  # where the engine writes profiler traces, when it profiles
    stop_problems: list[str] = field(default_factory=list)
    gpu_release_timeout: float = GPU_RELEASE_TIMEOUT_S
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.lease.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid, which is also its process group's id (it leads its own group)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"# profllm: {' '.join(redact_argv(self.argv))}\n".encode())
            log.flush()
            self.started_at = time.time()
            self._process = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stop() reaches every child
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def wait_ready(self, timeout: float) -> None:
        import requests

        assert self._process is not None, "start() first"
        deadline = time.monotonic() + timeout
        with requests.Session() as session:
            while time.monotonic() < deadline:
                code = self._process.poll()
                if code is not None:
                    raise self._start_error(f"exited with code {code} during start-up")
                try:
                    response = session.get(
                        f"{self.base_url}/health", timeout=_HEALTH_PROBE_TIMEOUT_S
                    )
                    if response.status_code == 200:
                        self.ready_at = time.time()
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.1)
        raise self._start_error(f"was not ready on /health within {timeout:.0f} s")

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group, SIGKILL to what is left after `grace` seconds; then the checks
        that nothing survives and that the GPUs' memory is free (`stop_problems`)."""
        process = self._process
        if process is None or self.stopped_at is not None:
            return
        # Known before the kill: a descendant that left the group (setsid) is still ours.
        watched = {p.pid: p for p in [*process_tree(process.pid), *group_members(process.pid)]}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
        # Children (vLLM's EngineCore and workers) may outlive the API process: kill the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.stopped_at = time.time()
        self._check_survivors(process.pid, watched)
        self._check_gpu_memory(set(watched))
        for problem in self.stop_problems:
            self._log(f"# profllm: {problem}")
            warnings.warn(f"{self.describe()}: {problem}", ServerStopWarning, stacklevel=2)

    def _check_survivors(self, pgid: int, watched: dict[int, psutil.Process]) -> None:
        deadline = time.monotonic() + _SURVIVOR_GRACE_S
        while True:
            survivors = {p.pid: p for p in group_members(pgid)}
            survivors.update({pid: p for pid, p in watched.items() if _alive(p)})
            if not survivors or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not survivors:
            return
        shown = []
        for survivor in survivors.values():
            with contextlib.suppress(psutil.Error):
                shown.append(f"pid {survivor.pid} ({' '.join(survivor.cmdline())[:80]})")
                survivor.kill()
        self.stop_problems.append(
            f"{len(survivors)} process(es) outlived the server's process group and were killed: "
            + "; ".join(shown)
        )

    def _check_gpu_memory(self, pids: set[int]) -> None:
        from pytest_profllm.telemetry import NvmlGpus, wait_gpu_memory_released

        gpus = NvmlGpus.open(self.lease.gpus)
        if gpus is None:
            return  # no NVML (a CPU host, virtual GPUs): nothing to check
        try:
            problem = wait_gpu_memory_released(gpus, pids, self.gpu_release_timeout)
        finally:
            gpus.close()
        if problem:
            self.stop_problems.append(problem)

    def _log(self, line: str) -> None:
        with contextlib.suppress(OSError), self.log_path.open("a") as log:
            log.write(line + "\n")

    def describe(self) -> str:
        gpus = ",".join(self.lease.gpus)
        return f"server {self.label} ({self.engine}, port {self.lease.port}, GPUs {gpus})"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with self.log_path.open(errors="replace") as log:
                return "".join(deque(log, maxlen=lines))
        except OSError:
            return ""

    def _start_error(self, what: str) -> ServerStartError:
        tail = self.log_tail()
        cause = next((name for pattern, name in _LIKELY_CAUSES if pattern.search(tail)), None)
        likely = f" (likely cause: {cause})" if cause else ""
        self.stop(grace=5.0)
        return ServerStartError(
            f"{self.describe()} {what}{likely}; log: {self.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{tail}"
        )


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of a process group."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and _alive(process):
                members.append(process)
        except (OSError, psutil.Error):
            continue
    return members


def _alive(process: psutil.Process) -> bool:
    try:
        # is_running() also tells a reused pid from the process we knew.
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _die_with_parent() -> None:
    # If the worker is killed outright, the kernel sends the server SIGTERM: no orphans that
    # hold GPUs and ports after a crash.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class WorkerServers:
    """The server this worker is using; at most one at a time, swapped when the key changes."""

    engine: EngineName
    pool: HostPool
    log_dir: Path
    startup_timeout: float
    lease_timeout: float
    wait_for_busy_gpus: bool = True
    # Under xdist: each server's place in the scheduler's order, and the session's turns.
    ranks: dict[str, int] = field(default_factory=dict)
    turns: SessionTurns | None = None
    profile_root: Path | None = None  # trace folders of profiling servers go under it
    current: ServerProcess | None = None
    failed: dict[str, ServerStartError] = field(default_factory=dict)
    starts: int = 0

    def server_for(self, case: Case) -> ServerProcess:
        """The running server for this case's key, started (once) if need be."""
        key = case.server_key
        if key in self.failed:
            # Every case of a server that failed to start fails the same way, without retrying.
            raise ServerStartError(f"{self.failed[key]}".splitlines()[0] + " (see the first case)")
        if self.current is not None and self.current.key == key and self.current.alive():
            return self.current
        lease = self.lease_devices(case)
        name = server_name(case)
        engine_args, profile_dir = engine_args_for(
            case, self.profile_root or self.log_dir / "profiles"
        )
        argv, env = launch(self.engine, engine_args, lease, registry_for(self.engine))
        server = ServerProcess(
            key=key,
            label=case.server_label,
            engine=self.engine,
            argv=argv,
            env=env,
            log_path=self.log_dir / f"{name}.log",
            lease=lease,
            profile_dir=profile_dir,
        )
        try:
            with self.pool.serial_start(timeout=self.lease_timeout + self.startup_timeout):
                server.start()
                self.starts += 1
                server.wait_ready(self.startup_timeout)
        except BaseException as error:
            server.stop(grace=5.0)
            lease.release()
            if isinstance(error, ServerStartError):
                self.failed[key] = error
            raise
        self.current = server
        return server

    def lease_devices(self, case: Case) -> Lease:
        """This case's devices and ports, in the scheduler's order, once they are idle; the
        server this worker holds goes back first. Also for offline cases (no server)."""
        self.release()
        lease = self._lease(case)
        try:
            lease.wait_s += gpus.wait_until_idle(
                lease.gpu_uuids, self.wait_for_busy_gpus, self.lease_timeout
            )
        except gpus.GpuBusy:
            lease.release()
            raise
        return lease

    def _lease(self, case: Case) -> Lease:
        rank = self.ranks.get(case.server_key)
        if self.turns is None or rank is None:
            return self.pool.acquire(case.gpus_needed, timeout=self.lease_timeout)
        turns = self.turns
        waited = turns.wait_for(rank, timeout=TURN_WAIT_CAP_S)
        try:
            lease = self.pool.acquire(
                case.gpus_needed, timeout=self.lease_timeout, queued=lambda: turns.taken(rank)
            )
        finally:
            turns.taken(rank)  # also when no lease came: the next server must not wait on us
        lease.wait_s += waited
        return lease

    def after_case(self, next_case: Case | None) -> None:
        """Stop the server unless the next case on this worker uses it too."""
        if self.current is not None and (
            next_case is None or next_case.server_key != self.current.key
        ):
            self.release()

    def release(self) -> None:
        server, self.current = self.current, None
        if server is not None:
            server.stop()
            server.lease.release()


def launch(
    engine: EngineName, server: dict[str, Any], lease: Lease, registry: Registry | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment (over the inherited one) a server starts with.

    `profllm plan` prints what this returns, so the plan is the command that runs.
    """
    argv = serve_command(engine, server, HOST, lease.port, registry)
    return argv, {**server_env(lease), **serve_env(server)}


def server_name(case: Case) -> str:
    """Names the server's log file and trace folder."""
    return f"{_safe(case.suite)}-{case.server_label}-{case.server_key}"


def engine_args_for(case: Case, profile_root: Path) -> tuple[dict[str, Any], Path | None]:
    """The engine arguments a case's server starts with, and its trace folder when it profiles
    (vLLM's profiler is switched on by an engine argument)."""
    if not case.profile:
        return case.server, None
    trace_dir = profile_root / server_name(case)
    return profiled_server(case.server, trace_dir), trace_dir


def server_env(lease: Lease) -> dict[str, str]:
    # No VLLM_TORCH_PROFILER_DIR for a profiling server: vLLM 0.33.0 takes `--profiler-config`
    # (see profiling.py) and warns about that variable as unknown.
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(lease.gpus),
        # A private base for vLLM's internal ports: without it, servers on one host collide.
        "VLLM_PORT": str(lease.internal_port),
    }


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def describe_runtime(server: ServerProcess | None, worker: str, case: Case) -> dict[str, Any]:
    lease = server.lease if server else None
    return {
        "worker": worker,
        "server_key": case.server_key,
        "gpus": list(lease.gpus) if lease else [],
        "gpu_uuids": list(lease.gpu_uuids) if lease else [],
        "port": lease.port if lease else None,
        "server_started_at": server.started_at if server else None,
        "server_ready_at": server.ready_at if server else None,
        "server_stopped_at": server.stopped_at if server else None,
        "lease_wait_s": lease.wait_s if lease else None,
        "server_stop_problems": list(server.stop_problems) if server else [],
    }
