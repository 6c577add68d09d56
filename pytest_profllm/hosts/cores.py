"""A host-wide pool of load cores: the cores a case's load client, and a simulated server, run
on while the load is measured, leased through file locks beside the GPUs' (pool.py).

On a small host the client competes with what it measures: four workers' loads and their
simulators on two cores make the client fall behind its arrival schedule. So a load holds
cores, as a server holds GPUs; loads that do not fit wait, before their measurement starts.
A vLLM server on CPU holds its core sets for its whole life and no load core; the load cores
are the usable cores its sets leave (devices.py keeps the first for the client). The locks
are `flock`s, so a killed worker's cores are free at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import filelock
import psutil

from pytest_profllm.hosts.devices import DeviceKind, cores_of, usable_cores
from pytest_profllm.hosts.pool import HostPool, LeaseTimeout, in_turn, try_locks
from pytest_profllm.hosts.processes import process_tree

# Its own queue: a load must not wait behind a server waiting minutes for GPUs.
_QUEUE = "load-core-queue"


@dataclass(frozen=True)
class CoreLease:
    """The cores a load runs on, and how long it waited for them."""

    client: tuple[int, ...]
    server: tuple[int, ...]  # a simulated server's; none for vLLM
    wait_s: float

    def as_record(self) -> dict[str, list[int]]:
        return {"client": list(self.client), "server": list(self.server)}


@dataclass(frozen=True)
class LoadCores:
    directory: Path  # the pool's folder: every session on the host leases from it
    cores: tuple[int, ...]  # the cores loads may hold, taken in this order

    @classmethod
    def of(cls, pool: HostPool, device: DeviceKind) -> LoadCores:
        """This process's usable cores but those of the pool's CPU core sets, which vLLM
        servers on CPU hold; all usable cores where the sets leave none (a one-core host)."""
        usable = usable_cores()
        sets = {c for s in pool.gpu_ids for c in cores_of(s)} if device == "cpu" else set()
        return cls(pool.directory, tuple(c for c in usable if c not in sets) or tuple(usable))

    @contextlib.contextmanager
    def hold(self, client: int, server: int, timeout: float) -> Iterator[CoreLease]:
        """`client` cores for the load client and `server` for its server, held for the
        block, once they are free; LeaseTimeout after `timeout` seconds. A request for more
        cores than there are takes them all: the server keeps one of its own where the
        client is left one, else the two share."""
        count = min(client + server, len(self.cores))
        started = time.monotonic()
        locks: list[tuple[int, filelock.BaseFileLock]] = []
        if count:
            locks = in_turn(
                self.directory,
                _QUEUE,
                timeout,
                lambda: self._try(count),
                lambda doing: self._timeout(client, server, count, timeout, doing),
            )
        try:
            yield _split(tuple(core for core, _ in locks), client, server, started)
        finally:
            for _, lock in locks:
                lock.release(force=True)

    def _try(self, count: int) -> list[tuple[int, filelock.BaseFileLock]] | None:
        names = [(core, f"load-core-{core}") for core in self.cores]
        return try_locks(self.directory, names, count)

    def _timeout(
        self, client: int, server: int, count: int, timeout: float, doing: str
    ) -> LeaseTimeout:
        return LeaseTimeout(
            f"no {count} free load core(s) for a client of {client} and a server of {server} "
            f"after {timeout:.0f} s {doing} (pool: load cores "
            f"{','.join(map(str, self.cores))}, lock dir {self.directory}; "
            "raise --profllm-lease-timeout to wait longer)"
        )


def _split(taken: tuple[int, ...], client: int, server: int, started: float) -> CoreLease:
    own = min(server, len(taken) - min(client, 1))  # the client keeps one where it can
    server_cores = taken[len(taken) - own :] if own else taken[-1:] if server else ()
    client_cores = taken[: len(taken) - own] if client else ()
    return CoreLease(client_cores, server_cores, time.monotonic() - started)


def client_processes(wanted: int | Literal["auto"], lease: CoreLease | None) -> int:
    """How many processes a load's client runs: `auto` is one per core the lease gave the
    client, at least one (none leased: --profllm-no-load-cores)."""
    if wanted == "auto":
        return max(1, len(lease.client) if lease is not None else 0)
    return wanted


def cores_wanted(wanted: int | Literal["auto"], pool: LoadCores) -> int:
    """How many cores a load's client asks the pool for: `auto` asks for every load core
    (the lease leaves the server its own), so it waits until no other load holds any."""
    return len(pool.cores) if wanted == "auto" else wanted


@contextlib.contextmanager
def thread_on(cores: Sequence[int]) -> Iterator[None]:
    """The calling thread, and the threads and processes it starts in the block, run on these
    cores; it gets its own affinity back after. Nothing changes for no cores."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread, on Linux
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def tree_on(pid: int | None, cores: Sequence[int]) -> Iterator[None]:
    """Every thread of the process and its children runs on these cores in the block (a
    process's affinity is its threads': sched_setaffinity's pid is one thread); each still
    there gets its own affinity back after. One that ends meanwhile is passed over: the
    server's own checks say when it is gone."""
    wanted = set(cores)
    with _threads_moved(pid if cores else None, lambda before: wanted):
        yield


@contextlib.contextmanager
def tree_off(pid: int | None, client: Sequence[int]) -> Iterator[None]:
    """Every thread of the process and its children stays off the client's cores in the block:
    a thread allowed on one of them loses those cores (or, allowed on nothing else, is left
    as it is: it has nowhere else to run). A thread already off them is not touched, so
    vLLM's own per-thread binds (VLLM_CPU_OMP_THREADS_BIND) stay as vLLM set them; its
    API server and engine core, which vLLM does not bind, are the ones moved. Each moved
    thread still there gets its affinity back after."""
    avoid = set(client)

    def off(before: set[int]) -> set[int] | None:
        rest = before - avoid
        return rest if rest and rest != before else None

    with _threads_moved(pid if avoid else None, off):
        yield


@contextlib.contextmanager
def _threads_moved(
    pid: int | None, affinity: Callable[[set[int]], set[int] | None]
) -> Iterator[None]:
    """Each thread of the process tree gets `affinity(its own)` for the block (None: left
    as it is), and its own back after, while it is still that process's thread."""
    moved: list[tuple[Path, int, set[int]]] = []
    if pid is not None:
        for process in process_tree(pid):
            with contextlib.suppress(psutil.Error):
                for thread in process.threads():
                    with contextlib.suppress(OSError):
                        before = os.sched_getaffinity(thread.id)
                        after = affinity(before)
                        if after is not None:
                            os.sched_setaffinity(thread.id, after)
                            task = Path(f"/proc/{process.pid}/task/{thread.id}")
                            moved.append((task, thread.id, before))
    try:
        yield
    finally:
        for task, thread_id, before in moved:
            # Only while it is still that process's thread: an ended thread's id may be reused.
            if task.exists():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread_id, before)


# The niceness a simulated server takes where it shares its client's cores: below the client,
# as the GPU it stands for would take none of the client's CPU.
SHARED_SERVER_NICENESS = 10


def below_the_client(pid: int | None) -> None:
    """Lowers the priority of a server's process tree to `SHARED_SERVER_NICENESS` (never
    raises it: that takes a privilege, and a lower one stays lower)."""
    if pid is None:
        return
    for process in process_tree(pid):
        with contextlib.suppress(psutil.Error, OSError):
            if process.nice() < SHARED_SERVER_NICENESS:
                process.nice(SHARED_SERVER_NICENESS)
