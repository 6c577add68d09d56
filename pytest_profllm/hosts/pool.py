"""A host-wide pool of GPUs and ports, leased through OS file locks.

Every xdist worker and every pytest session on the host, whichever user runs it, leases from
the same directory, so no two servers share a GPU or a port. The locks are `flock`s: the kernel
drops them when their holder dies, so a killed worker's lease is free at once, with no stale
files to clean up.

The default folder is shared by all users, as /tmp is: world-writable with the sticky bit, so
anyone may create and lock a lock file (0o666) but nobody may delete or replace another's. A
user who wants to can hold locks and so delay others' leases; nobody can make a case measure
their server, since a server is ready only when its port's listener is its own process.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import filelock

from pytest_profllm.hosts.processes import OWNER_ENV, POOL_SETTING_ENV, owner_alive

POOL_DIR_ENV = POOL_SETTING_ENV
# One API port, then vLLM's internal ports (VLLM_PORT and up), per lease.
PORT_BLOCK = 10
_POLL_S = 0.2
_TURN_POLL_S = 0.05
VIRTUAL_PREFIX = "virtual-"
CPU_PREFIX = "cpu-"  # lock names of CPU core sets (devices.py); neither is an NVML UUID
_NOT_NVML = (VIRTUAL_PREFIX, CPU_PREFIX)
_Taken = TypeVar("_Taken")


class LeaseTimeout(Exception):
    """No GPUs or ports came free in time."""


class PoolEntryWarning(UserWarning):
    """Something that is not a lock file sits under a lock's name in the pool folder."""


_SHARED_DIR_MODE = 0o1777  # as /tmp: all may create, none may remove another's files
_LOCK_FILE_MODE = 0o666  # every user's session must be able to open and lock it


def default_pool_dir() -> Path:
    directory = os.environ.get(POOL_DIR_ENV)
    if directory:
        return Path(directory)
    # One folder for the host, not one per user: two users' sessions must see each other's
    # leases, or they take the same GPUs and ports.
    return Path(tempfile.gettempdir()) / "pytest-profllm-pool"


def shared_dir(directory: Path) -> Path:
    """`directory`, made if need be; one we create is open to every user's sessions."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return directory
    os.chmod(directory, _SHARED_DIR_MODE)  # mkdir's mode goes through the umask; chmod not
    return directory


@dataclass
class Lease:
    gpus: tuple[str, ...]  # CUDA device ids (CUDA_VISIBLE_DEVICES), or virtual ids
    gpu_uuids: tuple[str, ...]  # NVML UUIDs of real GPUs; empty for virtual ones
    port: int
    internal_port: int  # VLLM_PORT: vLLM takes this and the ports after it for its own sockets
    wait_s: float
    _locks: list[filelock.BaseFileLock] = field(default_factory=list, repr=False)

    def release(self) -> None:
        while self._locks:
            self._locks.pop().release(force=True)


@dataclass(frozen=True)
class HostPool:
    directory: Path
    gpu_ids: tuple[str, ...]  # CUDA device ids, or virtual ids for the simulator
    gpu_lock_names: tuple[str, ...]  # per GPU: its UUID on real GPUs, so all sessions agree
    ports: range

    @property
    def port_blocks(self) -> range:
        return range(self.ports.start, self.ports.stop - PORT_BLOCK + 1, PORT_BLOCK)

    def acquire(
        self, gpu_count: int, timeout: float, queued: Callable[[], None] | None = None
    ) -> Lease:
        """GPUs and a port block, waiting up to `timeout` seconds for them to come free.

        Waiters queue host-wide: only the one holding the queue lock may take GPUs, so a server
        that needs four GPUs is not starved by one-GPU servers taking each GPU as it frees.
        `queued` is called once this request heads the queue.
        """
        if gpu_count > len(self.gpu_ids):
            raise LeaseTimeout(f"needs {gpu_count} GPU(s) but the pool has {len(self.gpu_ids)}")
        started = time.monotonic()
        return in_turn(
            self.directory,
            "lease-queue",
            timeout,
            lambda: self._try_lease(gpu_count, started),
            lambda doing: self._timeout(gpu_count, timeout, doing),
            queued,
        )

    def _try_lease(self, gpu_count: int, started: float) -> Lease | None:
        gpu_locks = self._try_gpus(gpu_count)
        if gpu_locks is None:
            return None
        port_lock = self._try_port_block()
        if port_lock is None:
            for _, lock in gpu_locks:
                lock.release(force=True)
            return None
        block, lock = port_lock
        lock_names = [self.gpu_lock_names[i] for i, _ in gpu_locks]
        return Lease(
            gpus=tuple(self.gpu_ids[i] for i, _ in gpu_locks),
            gpu_uuids=tuple(name for name in lock_names if not name.startswith(_NOT_NVML)),
            port=block,
            internal_port=_internal_port(block),
            wait_s=time.monotonic() - started,
            _locks=[lock for _, lock in gpu_locks] + [lock],
        )

    def _timeout(self, gpu_count: int, timeout: float, doing: str) -> LeaseTimeout:
        return LeaseTimeout(
            f"no {gpu_count} free GPU(s) and port block after {timeout:.0f} s {doing} "
            f"(pool: GPUs {','.join(self.gpu_ids)}, ports "
            f"{self.ports.start}-{self.ports.stop - 1}, lock dir {self.directory}; "
            "raise --profllm-lease-timeout to wait longer)"
        )

    def lease_when_empty(self, gpu_count: int) -> Lease:
        """The lease `acquire` gives when nothing is held (for `profllm plan`); holds nothing."""
        block = self.port_blocks[0]
        names = self.gpu_lock_names[:gpu_count]
        uuids = tuple(name for name in names if not name.startswith(_NOT_NVML))
        return Lease(self.gpu_ids[:gpu_count], uuids, block, _internal_port(block), 0.0)

    @contextmanager
    def serial_start(self, timeout: float) -> Iterator[None]:
        """Held while a server starts: vLLM sizes its KV cache wrongly when two start at once."""
        lock = self._lock("server-start")
        try:
            lock.acquire(timeout=timeout)
        except filelock.Timeout:
            raise LeaseTimeout(
                f"another server on this host was still starting after {timeout:.0f} s "
                f"(lock {self.directory / 'server-start.lock'})"
            ) from None
        except OSError as error:
            raise LeaseTimeout(_not_a_lock(lock, error)) from None
        try:
            yield
        finally:
            lock.release(force=True)

    def _try_gpus(self, count: int) -> list[tuple[int, filelock.BaseFileLock]] | None:
        names = [(index, f"gpu-{name}") for index, name in enumerate(self.gpu_lock_names)]
        return try_locks(self.directory, names, count)

    def _try_port_block(self) -> tuple[int, filelock.BaseFileLock] | None:
        for block in self.port_blocks:
            lock = self._lock(f"port-{block}")
            if not try_lock(lock):
                continue
            # A port outside our control (another program) may be bound already.
            if all(_port_free(port) for port in range(block, block + PORT_BLOCK)):
                return block, lock
            lock.release(force=True)
        return None

    def _lock(self, name: str) -> filelock.BaseFileLock:
        return lock_file(self.directory, name)


@dataclass(frozen=True)
class SessionTurns:
    """The order in which one session's servers join the host-wide lease queue.

    xdist hands out servers largest first, but its workers reach the queue in any order: a
    one-GPU server that gets there first makes a four-GPU one wait with GPUs idle. Each server
    has a rank (its place in the scheduler's order); rank r joins the queue only once rank r-1
    has reached its head (a marker file), so GPUs go out in the scheduler's order. Waiting for
    a turn is capped: a predecessor that never comes (its worker died) delays, never blocks.
    """

    directory: Path  # per session, inside the pool folder

    def wait_for(self, rank: int, timeout: float) -> float:
        """Wait until every rank before `rank` has had its turn; returns the seconds waited."""
        started = time.monotonic()
        if rank <= 0:
            return 0.0
        while not (self.directory / f"turn-{rank - 1}").exists():
            if time.monotonic() - started >= timeout:
                break
            time.sleep(_TURN_POLL_S)
        return time.monotonic() - started

    def taken(self, rank: int) -> None:
        shared_dir(self.directory.parent)  # `turns/`, where every session has its folder
        self.directory.mkdir(exist_ok=True)
        owner = self.directory / _OWNER_FILE
        if not owner.exists() and (token := os.environ.get(OWNER_ENV)):
            owner.write_text(token)  # whose the folder is: a later session sweeps it if dead
        (self.directory / f"turn-{rank}").touch()


_OWNER_FILE = "owner"
# A session folder with no owner (written before owners were) is stale after this long.
_UNOWNED_STALE_S = 24 * 3600


def sweep_stale_turns(pool_dir: Path) -> list[Path]:
    """Remove the turn folders of sessions whose controller is gone (a SIGKILL leaves them);
    returns what was removed."""
    removed: list[Path] = []
    turns = pool_dir / "turns"
    if not turns.is_dir():
        return removed
    for folder in turns.iterdir():
        try:
            token = (folder / _OWNER_FILE).read_text().strip()
            stale = not owner_alive(token)
        except FileNotFoundError:
            stale = time.time() - folder.stat().st_mtime > _UNOWNED_STALE_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def in_turn(
    directory: Path,
    queue: str,
    timeout: float,
    attempt: Callable[[], _Taken | None],
    timed_out: Callable[[str], LeaseTimeout],
    queued: Callable[[], None] | None = None,
) -> _Taken:
    """The first answer of `attempt` that is not None, tried until `timeout` seconds are up.

    Waiters queue host-wide on the lock `queue`: only its holder tries, so a large request is
    not starved by small ones taking each thing as it frees. `queued` is called once this
    request heads the queue; `timed_out(doing)` is the error when time runs out.
    """
    shared_dir(directory)
    deadline = time.monotonic() + timeout
    lock = lock_file(directory, queue)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        raise timed_out("waiting in the lease queue") from None
    except OSError as error:
        # The queue has no second lock to turn to: nothing is leasable until it is removed.
        raise LeaseTimeout(_not_a_lock(lock, error)) from None
    try:
        if queued is not None:
            queued()
        while True:
            taken = attempt()
            if taken is not None:
                return taken
            if time.monotonic() >= deadline:
                raise timed_out("waiting for them to come free")
            time.sleep(_POLL_S)
    finally:
        lock.release(force=True)


def _internal_port(block: int) -> int:
    return block + 1


def lock_file(directory: Path, name: str) -> filelock.BaseFileLock:
    """The host-wide lock `name` in the pool folder (`name`.lock), which any user may take."""
    return filelock.FileLock(directory / f"{name}.lock", mode=_LOCK_FILE_MODE, thread_local=False)


def try_lock(lock: filelock.BaseFileLock) -> bool:
    """Takes the lock if it is free; never waits. Something planted under its name in the
    shared folder (a folder, a symlink, another user's unreadable file) makes it one that
    cannot be taken, said in a warning: another user can at most keep us off it."""
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return False
    except OSError as error:
        warnings.warn(_not_a_lock(lock, error) + ": passed over", PoolEntryWarning, stacklevel=2)
        return False
    return True


def try_locks(
    directory: Path, named: Sequence[tuple[int, str]], count: int
) -> list[tuple[int, filelock.BaseFileLock]] | None:
    """The first `count` free locks of `named` (a key, a lock name), in order, with their keys;
    all or none: None, holding none of them, where fewer are free."""
    taken: list[tuple[int, filelock.BaseFileLock]] = []
    for key, name in named:
        if len(taken) == count:
            break
        lock = lock_file(directory, name)
        if try_lock(lock):
            taken.append((key, lock))
    if len(taken) == count:
        return taken
    for _, lock in taken:
        lock.release(force=True)
    return None


def _not_a_lock(lock: filelock.BaseFileLock, error: OSError) -> str:
    return f"{lock.lock_file} cannot be locked ({error.strerror or error}; not a lock file?)"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def make_pool(
    directory: Path,
    gpu_spec: int | Sequence[str] | None,
    ports: range,
    real_gpus: Sequence[tuple[str, str]],
) -> HostPool:
    """The pool for this session.

    `real_gpus` holds (index, uuid) of NVML's GPUs. `gpu_spec` is a count (the first N real
    GPUs, or N virtual ones where there is none), explicit device ids, or None (all real GPUs,
    else 8 virtual ones). Asking for real GPUs the host lacks is a ValueError.
    """
    if isinstance(gpu_spec, int) or gpu_spec is None:
        count = gpu_spec if gpu_spec is not None else (len(real_gpus) or 8)
        if real_gpus:
            if count > len(real_gpus):
                raise ValueError(
                    f"--profllm-gpus {count}: NVML finds only {len(real_gpus)} GPU(s) on this host"
                )
            chosen = list(real_gpus)[:count]
            return HostPool(
                directory, tuple(i for i, _ in chosen), tuple(u for _, u in chosen), ports
            )
        virtual = tuple(str(i) for i in range(count))
        return HostPool(directory, virtual, tuple(f"{VIRTUAL_PREFIX}{i}" for i in virtual), ports)
    by_index = dict(real_gpus)
    missing = [i for i in gpu_spec if real_gpus and i not in by_index]
    if missing:
        raise ValueError(
            f"--profllm-gpus: no GPU with id {', '.join(missing)} "
            f"(NVML finds ids {', '.join(by_index)})"
        )
    names = tuple(by_index.get(i, f"{VIRTUAL_PREFIX}{i}") for i in gpu_spec)
    return HostPool(directory, tuple(gpu_spec), names, ports)
