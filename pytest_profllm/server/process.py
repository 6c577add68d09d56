"""A server process (vLLM or the simulator): start in its own process group, wait for
`/health`, stop with SIGTERM then SIGKILL of the whole group, then check that nothing of it
survives and (with NVML) that its GPU memory is free before the lease goes back."""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pytest_profllm.engine.choice import EngineName
from pytest_profllm.engine.secrets import RedactedArgv, RedactedDict, redact_argv
from pytest_profllm.hosts.devices import DeviceKind, cores_of
from pytest_profllm.hosts.nvml import NvmlGpus, wait_gpu_memory_released
from pytest_profllm.hosts.pool import Lease
from pytest_profllm.hosts.processes import (
    alive,
    describe_pids,
    group_members,
    listening_pids,
    process_tree,
    tagged_processes,
)
from pytest_profllm.load.prometheus_counters import without_session_metrics
from pytest_profllm.server.launch import HOST

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


class ServerExited(Exception):
    """The server exited while a case was using it (raised by whoever watches it, such as the
    load); `WorkerServers.serving` turns it into ServerLost with the log's tail."""


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
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write the disk refuses fails here, not again as the file closes.
            log = self.log_path.open("ab", buffering=0)
        except OSError as error:
            raise self._unwritable_log(error) from None
        with log:
            try:
                log.write(f"# profllm: {' '.join(redact_argv(self.argv))}\n".encode())
            except OSError as error:
                raise self._unwritable_log(error) from None
            self.started_at = time.time()
            self._process = subprocess.Popen(
                self.argv,
                env={
                    **without_session_metrics(dict(os.environ)),
                    **self.env,
                    SERVER_ID_ENV: self._server_id,
                },
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stop() reaches every child
                preexec_fn=self._in_child() if sys.platform == "linux" else None,
            )

    def launch_cores(self) -> set[int]:
        """The cores the whole server starts on: for vLLM on CPU its core sets, so its API
        server and engine core (which vLLM does not bind) and every process they start stay
        off the client's core, as its workers (bound by vLLM) do; none (no pin) otherwise."""
        if self.engine != "vllm" or self.device != "cpu":
            return set()
        return {core for core_set in self.lease.gpus for core in cores_of(core_set)}

    def _in_child(self) -> Callable[[], None]:
        cores = self.launch_cores()

        def setup() -> None:
            die_with_parent()
            if cores:
                # Set before exec: every thread and child inherits it from the first.
                os.sched_setaffinity(0, cores)

        return setup

    def _unwritable_log(self, error: OSError) -> ServerStartError:
        """A log that cannot be written (a full disk, a file where its folder should be, a
        read-only folder): the server is not started, and the case says so in one line."""
        return ServerStartError(
            f"{self.label}: not started: cannot write its log {self.log_path}: "
            f"{error.strerror or error}"
        )

    def wait_ready(self, timeout: float) -> None:
        # Deferred: requests takes about 0.1 s to import, on every pytest run otherwise.
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
        what = problem + (f" ({said})" if said else "")
        return ServerLost(self._failure(what, tail, "its measurement does not count"))

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
            survivors.update({pid: p for pid, p in watched.items() if alive(p)})
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
        return kind(self._failure(f"{what}{likely}" + (f": {said}" if said else ""), tail))

    def _failure(self, what: str, tail: str, *notes: str) -> str:
        """A server failure as the case shows it: the server, what happened, where its log is,
        and the log's tail."""
        head = "; ".join((f"{self.describe()} {what}", *notes, f"log: {self.log_path}"))
        return f"{head}\n--- last {LOG_TAIL_LINES} log lines ---\n{tail}"


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


def die_with_parent() -> None:
    # If the worker is killed outright, the kernel sends the server SIGTERM: no orphans that
    # hold GPUs and ports after a crash.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
