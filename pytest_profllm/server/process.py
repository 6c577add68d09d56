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
import secrets
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

from pytest_profllm.engine.choice import (
    EngineName,
    RedactedArgv,
    RedactedDict,
    redact_argv,
    serve_command,
    serve_env,
)
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.engine.registry import Registry, registry_for
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.devices import DeviceKind, device_env
from pytest_profllm.hosts.pool import HostPool, Lease, SessionTurns
from pytest_profllm.plan.case import Case
from pytest_profllm.run.profiling import profiled_server
from pytest_profllm.run.telemetry import process_tree

HOST = "127.0.0.1"
# How long a server waits for the one before it in the scheduler's order to reach the lease
# queue: seconds at most, since that one may still be finishing a case on a busy worker.
TURN_WAIT_CAP_S = 5.0
LOG_TAIL_LINES = 50
# Attempts to start a server whose port another process took between lease and bind.
PORT_TAKEN_ATTEMPTS = 3
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


class PortTaken(ServerStartError):
    """Another process held the server's port when it started: it was never ours."""


class ServerLost(Exception):
    """The server died, or its port stopped being its own, during a case: nothing it
    measured counts. The message carries the log's tail."""


# Each server's processes carry this in their environment, so that stop() finds those that
# left the server's process group (setsid). vLLM's EngineCore and workers stay in the group
# (they are found as its members); their environment is unreadable once setproctitle retitles
# them.
SERVER_ID_ENV = "PROFLLM_SERVER_ID"


class ServerStopWarning(UserWarning):
    """A stopped server left something behind: a process, or GPU memory."""


class PortTakenWarning(UserWarning):
    """Another process took a server's port as it started; it starts again on another."""


@dataclass
class ServerProcess:
    key: str
    label: str
    engine: EngineName
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    lease: Lease
    # Why this server is a restart of its key's server (the one before died), or None.
    restart_reason: str | None = None
    started_at: float = 0.0  # Unix seconds, as the record's runtime block wants
    ready_at: float | None = None
    stopped_at: float | None = None
    profile_dir: Path | None = None  # where the engine writes profiler traces, when it profiles
    stop_problems: list[str] = field(default_factory=list)
    gpu_release_timeout: float = GPU_RELEASE_TIMEOUT_S
    device: DeviceKind = "gpu"
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _server_id: str = field(default_factory=lambda: secrets.token_hex(8), repr=False)

    def __post_init__(self) -> None:
        # pytest shows reprs of locals (-l) and in JUnit XML: secrets show as *** there too.
        self.argv = RedactedArgv(self.argv)
        self.env = RedactedDict(self.env)

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
                env={**os.environ, **self.env, SERVER_ID_ENV: self._server_id},
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
                    healthy = response.status_code == 200
                except requests.RequestException:
                    healthy = False
                # Ready only when the answer came from our own process: a server of another
                # session (or any program) on this port must never be measured as ours.
                if healthy and self._process.poll() is None:
                    owners = self.port_owners()
                    foreign = [pid for pid in owners if pid not in self._own_pids()]
                    if foreign:
                        raise self._start_error(
                            f"found port {self.lease.port} held by another process "
                            f"({describe_pids(foreign)}), not by this server",
                            PortTaken,
                        )
                    if owners:
                        self.ready_at = time.time()
                        return
                time.sleep(0.1)
        raise self._start_error(f"was not ready on /health within {timeout:.0f} s")

    def _own_pids(self) -> set[int | None]:
        assert self._process is not None
        tree = process_tree(self._process.pid) + group_members(self._process.pid)
        return {process.pid for process in tree}

    def port_owners(self) -> set[int | None]:
        """Pids listening on the server's API port (None: a process we may not inspect)."""
        return listening_pids(self.lease.port)

    def lost_problem(self) -> str | None:
        """Why this server is no longer the one that was measured, or None: it exited, or the
        listener on its port is another process's."""
        if self._process is None:
            return None
        if self._process.poll() is not None:
            return f"died during the case: {self.exit_description()}"
        foreign = [pid for pid in self.port_owners() if pid not in self._own_pids()]
        if foreign:
            return f"lost its port {self.lease.port} to another process ({describe_pids(foreign)})"
        return None

    def exit_description(self) -> str:
        code = self._process.poll() if self._process is not None else None
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            return f"killed by signal {-code} ({name})"
        return f"exited with code {code}"

    def lost_error(self, problem: str) -> ServerLost:
        """Stops what is left of the server (its stop time and this problem go into the
        record) and says what happened, with the log's tail."""
        self.stop_problems.append(problem)
        tail = self.log_tail()
        said = engine_message(tail)
        self.stop(grace=5.0)
        return ServerLost(
            f"{self.describe()} {problem}"
            + (f" ({said})" if said else "")
            + f"; its measurement does not count; log: {self.log_path}\n"
            f"--- last {LOG_TAIL_LINES} log lines ---\n{tail}"
        )

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group, SIGKILL to what is left after `grace` seconds; then the checks
        that nothing survives and that the GPUs' memory is free (`stop_problems`)."""
        process = self._process
        if process is None or self.stopped_at is not None:
            return
        # Known before the kill: a descendant that left the group (setsid), or one orphaned by
        # an API process that died first (vLLM's EngineCore and worker then live on under
        # init, holding their memory), is still ours.
        watched = {
            p.pid: p
            for p in [
                *process_tree(process.pid),
                *group_members(process.pid),
                *tagged_processes(SERVER_ID_ENV, self._server_id),
            ]
        }
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
        from pytest_profllm.run.telemetry import NvmlGpus, wait_gpu_memory_released

        if self.device != "gpu":
            return  # CPU core sets: no GPU memory to wait for

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

    def devices(self) -> str:
        """`GPUs 0,1`, or `CPU cores 0-3|4-7` (a lease's core sets) for vLLM's CPU build."""
        if self.device == "cpu":
            return "CPU cores " + "|".join(self.lease.gpus)
        return "GPUs " + ",".join(self.lease.gpus)

    def describe(self) -> str:
        return f"server {self.label} ({self.engine}, port {self.lease.port}, {self.devices()})"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with self.log_path.open(errors="replace") as log:
                return "".join(deque(log, maxlen=lines))
        except OSError:
            return ""

    def _start_error(
        self, what: str, kind: type[ServerStartError] = ServerStartError
    ) -> ServerStartError:
        tail = self.log_tail()
        cause = next((name for pattern, name in _LIKELY_CAUSES if pattern.search(tail)), None)
        likely = f" (likely cause: {cause})" if cause else ""
        if cause == "port already in use":
            kind = PortTaken
        said = engine_message(tail)
        self.stop(grace=5.0)
        return kind(
            f"{self.describe()} {what}{likely}"
            + (f": {said}" if said else "")
            + f"; log: {self.log_path}\n--- last {LOG_TAIL_LINES} log lines ---\n{tail}"
        )


# The line in which an engine says why it stopped: an exception's last line (vLLM's
# `ValueError: ...`, pydantic's `Value error, ...`) or argparse's `error: ...`.
_ENGINE_SAYS = re.compile(
    r"^(?:\([A-Za-z]+ pid=\d+\) )?(?:[\w.]+(?:Error|Exception): .+|.*\berror: .+|"
    r"\s*Value error, .+)$"
)


def engine_message(tail: str) -> str | None:
    """The engine's own reason for stopping, from its log's tail, as one line; None where it
    gave none (a kill by signal)."""
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if _ENGINE_SAYS.match(line) and not line.startswith("# profllm"):
            return re.sub(r"^\([A-Za-z]+ pid=\d+\) ", "", line)[:500]
    return None


def tagged_processes(name: str, value: str) -> list[psutil.Process]:
    """Live processes of this user whose environment has name=value."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(name) == value and _alive(process):
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


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


def listening_pids(port: int) -> set[int | None]:
    """Pids of the TCP listeners on `port`, any address (None where the kernel does not tell
    us whose it is: another user's process)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {
        c.pid
        for c in connections
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def describe_pids(pids: list[int | None]) -> str:
    shown = []
    for pid in pids:
        if pid is None:
            shown.append("a process of another user")
            continue
        try:
            command = " ".join(" ".join(psutil.Process(pid).cmdline()).split())
            shown.append(f"pid {pid}: {command[:80]}")
        except psutil.Error:
            shown.append(f"pid {pid}")
    return "; ".join(shown)


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
    sim_device: str | None = None  # the simulator's --sim-device (None: its default)
    current: ServerProcess | None = None
    failed: dict[str, ServerStartError] = field(default_factory=dict)
    # Why a key's next server is a restart: its last server died or lost its port.
    restarts: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    vllm: VllmInstall | None = None  # where the engine is vLLM: its Python and launcher
    device: DeviceKind = "gpu"

    def server_for(self, case: Case) -> ServerProcess:
        """The running server for this case's key, started (once) if need be."""
        key = case.server_key
        if key in self.failed:
            # Every case of a server that failed to start fails the same way, without retrying.
            raise ServerStartError(f"{self.failed[key]}".splitlines()[0] + " (see the first case)")
        current = self.current
        if current is not None and current.key == key:
            if current.alive():
                return current  # its port was checked after the last case
            # Died between cases: the last case's record could not say so, this one's does.
            problem = f"died between cases: {current.exit_description()}"
            current.stop_problems.append(problem)
            self.restarts[key] = f"its server {problem}"
        self.release()
        for attempt in range(1, PORT_TAKEN_ATTEMPTS + 1):
            try:
                return self._start(case)
            except PortTaken as error:
                # Another process took the port between the lease's check and our bind: the
                # next lease skips it (it is no longer free).
                if attempt == PORT_TAKEN_ATTEMPTS:
                    self.failed[key] = error
                    raise
                warnings.warn(
                    f"{str(error).splitlines()[0]}; starting again on another port",
                    PortTakenWarning,
                    stacklevel=2,
                )
        raise AssertionError("unreachable")

    def lost(self, server: ServerProcess, problem: str) -> ServerLost:
        """The server died or lost its port during a case: the case fails with this error, its
        remaining processes are ended and its lease given back now (a CPU server's orphaned
        engine holds gigabytes), and the key's next case starts a new server and says why."""
        self.restarts[server.key] = f"its server {problem}"
        if self.current is server:
            self.current = None
        error = server.lost_error(problem)
        server.lease.release()
        return error

    def _start(self, case: Case) -> ServerProcess:
        key = case.server_key
        lease = self.lease_devices(case)
        name = server_name(case)
        engine_args, profile_dir = engine_args_for(
            case, self.profile_root or self.log_dir / "profiles"
        )
        argv, env = launch(
            self.engine,
            engine_args,
            lease,
            registry_for(self.engine, self.vllm),
            vllm=self.vllm,
            device=self.device,
            sim_device=self.sim_device,
        )
        server = ServerProcess(
            key=key,
            label=case.server_label,
            engine=self.engine,
            argv=argv,
            env=env,
            log_path=self.log_dir / f"{name}.log",
            lease=lease,
            profile_dir=profile_dir,
            restart_reason=self.restarts.get(key),
            device=self.device,
        )
        try:
            with self.pool.serial_start(timeout=self.lease_timeout + self.startup_timeout):
                server.start()
                self.starts += 1
                server.wait_ready(self.startup_timeout)
        except BaseException as error:
            server.stop(grace=5.0)
            lease.release()
            if isinstance(error, ServerStartError) and not isinstance(error, PortTaken):
                self.failed[key] = error
            raise
        self.current = server
        self.restarts.pop(key, None)
        return server

    def lease_devices(self, case: Case) -> Lease:
        """This case's devices and ports, in the scheduler's order, once they are idle; the
        server this worker holds goes back first. Also for offline cases (no server)."""
        self.release()
        lease = self._lease(case)
        try:
            lease.wait_s += nvml.wait_until_idle(
                lease.gpu_uuids, self.wait_for_busy_gpus, self.lease_timeout
            )
        except nvml.GpuBusy:
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
    engine: EngineName,
    server: dict[str, Any],
    lease: Lease,
    registry: Registry | None = None,
    vllm: VllmInstall | None = None,
    device: DeviceKind = "gpu",
    sim_device: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment (over the inherited one) a server starts with.

    `profllm plan` prints what this returns, so the plan is the command that runs.
    """
    argv = serve_command(engine, server, HOST, lease.port, registry, vllm, sim_device)
    return argv, {**server_env(lease, device), **serve_env(server)}


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


def server_env(lease: Lease, device: DeviceKind = "gpu") -> dict[str, str]:
    # No VLLM_TORCH_PROFILER_DIR for a profiling server: vLLM 0.33.0 takes `--profiler-config`
    # (see profiling.py) and warns about that variable as unknown.
    return {
        **device_env(device, lease),
        # A private base for vLLM's internal ports: without it, servers on one host collide.
        "VLLM_PORT": str(lease.internal_port),
    }


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def describe_runtime(server: ServerProcess | None, worker: str, case: Case) -> dict[str, Any]:
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
    }
