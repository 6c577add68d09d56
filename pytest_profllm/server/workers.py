"""The one live server each worker keeps: started for a case's server key, shared by the cases
that follow with the same key, swapped when the key changes, and given back with its lease.
A case takes it through `serving(case)`, which also ends the case at once if the server dies."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pytest_profllm.engine.choice import EngineName
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.engine.otel import otel_missing
from pytest_profllm.engine.registry import registry_for
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.cores import (
    CoreLease,
    LoadCores,
    below_the_client,
    cores_wanted,
    thread_on,
    tree_off,
    tree_on,
)
from pytest_profllm.hosts.devices import DeviceKind
from pytest_profllm.hosts.pool import HostPool, Lease, SessionTurns
from pytest_profllm.load import stages
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.plan.case import Case
from pytest_profllm.server.launch import engine_args_for, launch, safe_name, server_name
from pytest_profllm.server.process import (
    PORT_TAKEN_ATTEMPTS,
    PortTaken,
    PortTakenWarning,
    ServerLost,
    ServerProcess,
    ServerStartError,
)
from pytest_profllm.server.tracing import Tracing

# How long a server waits for the one before it in the scheduler's order to reach the lease
# queue: seconds at most, since that one may still be finishing a case on a busy worker.
TURN_WAIT_CAP_S = 5.0


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
    sim_profile: Path | None = None  # the simulator's --sim-profile (None: none)
    current: ServerProcess | None = None
    failed: dict[str, ServerStartError] = field(default_factory=dict)
    # Why a key's next server is a restart: its last server died or lost its port.
    restarts: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    vllm: VllmInstall | None = None  # where the engine is vLLM: its Python and launcher
    device: DeviceKind = "gpu"
    # The host's cores that loads hold while they are measured; None: a load holds none.
    cores: LoadCores | None = None
    # The session's id: each server's log is its own for the session (a log named by server
    # alone gathered every session's output, and a run page linked all of it).
    session_id: str | None = None
    # Which servers it starts export each request's trace span (--profllm-trace-requests).
    tracing: Tracing = field(default_factory=Tracing)
    # Where they export them: made for the first traced server, closed by `close_receiver`.
    span_receiver: SpanReceiver | None = None
    # Why a server key's server exports no spans (the record's `spans_problem`).
    untraced: dict[str, str] = field(default_factory=dict)

    def spans_of(self, server: ServerProcess) -> tuple[SpanReceiver | None, str | None]:
        """Where `server` exports its spans, or None and why it exports none."""
        why_not = self.untraced.get(server.key)
        if why_not is not None or self.span_receiver is None:
            return None, why_not
        return self.span_receiver, None

    def close_receiver(self) -> None:
        if self.span_receiver is not None:
            self.span_receiver.close()
            self.span_receiver = None

    def _traces_endpoint(self, case: Case) -> str | None:
        """The endpoint a case's server exports its spans to; None: it is not traced (why, in
        `untraced`). Tracing asked for and impossible fails the server's start in one line."""
        python = self.vllm.python if self.vllm is not None else sys.executable
        choice = self.tracing.choose(case, self.engine, lambda: otel_missing(python))
        if choice.error is not None:
            raise ServerStartError(choice.error)
        if not choice.traced:
            self.untraced[case.server_key] = choice.why_not or "not traced"
            return None
        self.untraced.pop(case.server_key, None)
        if self.span_receiver is None:
            self.span_receiver = SpanReceiver()
        return self.span_receiver.url

    def log_path(self, name: str) -> Path:
        """Where the server (or offline command) `name` writes its output this session."""
        session = f".{safe_name(self.session_id)}" if self.session_id else ""
        return self.log_dir / f"{name}{session}.log"

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

    @contextlib.contextmanager
    def serving(self, case: Case) -> Iterator[ServerProcess]:
        """The case's server, started or reused, for the part of the case that measures it.
        On leaving (also by an error), a server that died or lost its port ends the case with
        ServerLost: what the block measured was not this server."""
        server = self.server_for(case)
        try:
            yield server
        except Exception:
            problem = server.lost_problem()
            if problem is None:
                raise
            raise self.lost(server, problem) from None
        if (problem := server.lost_problem()) is not None:
            raise self.lost(server, problem)

    @contextlib.contextmanager
    def load_cores(
        self, server: ServerProcess, client: int | Literal["auto"]
    ) -> Iterator[CoreLease]:
        """Cores for a case's load, held for the block (its measured part), once free: the
        client's (this thread and the processes it starts run there) and a simulated
        server's (its processes run there; vLLM's hold their devices for life). The wait is
        the block's, before anything in it is measured."""
        simulated = server.engine == "sim"
        if self.cores is None:
            if simulated:
                below_the_client(server.pid)  # no core of its own: it shares the client's
            yield CoreLease((), (), 0.0)
            return
        with contextlib.ExitStack() as held:
            with stages.during("waiting", "load cores"):
                lease = held.enter_context(
                    self.cores.hold(
                        cores_wanted(client, self.cores), 1 if simulated else 0,
                        self.lease_timeout,
                    )
                )
            held.enter_context(thread_on(lease.client))
            held.enter_context(tree_on(server.pid, lease.server))
            # vLLM's processes (API server, engine core, workers) keep off the client's
            # cores: its workers are bound by vLLM, its API server and engine core were not.
            held.enter_context(tree_off(None if simulated else server.pid, lease.client))
            if simulated and set(lease.server) & set(lease.client):
                below_the_client(server.pid)  # one core for both (a one-core host)
            yield lease

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

    def _start_turn(self) -> contextlib.AbstractContextManager[None]:
        """Held while a server starts. vLLM sizes its KV cache from the device memory it finds
        free, so two vLLM starts at once size it wrongly: they take turns host-wide. The
        simulated engine sizes it from its device profile, so its starts need no turn (and a
        simulator that never gets healthy holds nobody else's start up)."""
        if self.engine == "sim":
            return contextlib.nullcontext()
        return self.pool.serial_start(timeout=self.lease_timeout + self.startup_timeout)

    def _start(self, case: Case) -> ServerProcess:
        key = case.server_key
        try:
            traces_endpoint = self._traces_endpoint(case)
        except ServerStartError as error:
            self.failed[key] = error
            raise
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
            sim_profile=self.sim_profile,
            traces_endpoint=traces_endpoint,
        )
        server = ServerProcess(
            key=key,
            label=case.server_label,
            engine=self.engine,
            argv=argv,
            env=env,
            log_path=self.log_path(name),
            lease=lease,
            profile_dir=profile_dir,
            restart_reason=self.restarts.get(key),
            device=self.device,
        )
        stages.enter("starting", case.server_label)
        try:
            with self._start_turn():
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
        what = f"{case.gpus_needed} GPU(s) and a port" if case.gpus_needed else "a port"
        stages.enter("waiting", what)
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
