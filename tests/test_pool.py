"""The host pool: GPU and port-block leases through flocks, within and across processes."""

from __future__ import annotations

import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock
import psutil
import pytest
from helpers import Holder

from pytest_profllm.hosts.pool import (
    POOL_DIR_ENV,
    PORT_BLOCK,
    HostPool,
    LeaseTimeout,
    PoolEntryWarning,
    default_pool_dir,
    make_pool,
)

# Each test has its own port range inside 24000-24299, so a lingering socket of one test
# cannot make another skip a block.
_FIRST_PORT = 24000

# A second process that leases from the same lock directory (or holds serial_start), says
# what it got on one line, then sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from pytest_profllm.hosts.pool import make_pool
directory, gpus, first, last, mode, count = sys.argv[1:7]
pool = make_pool(Path(directory), int(gpus), range(int(first), int(last)), [])
if mode == "lease":
    lease = pool.acquire(int(count), timeout=10)
    print(lease.port, ",".join(lease.gpus), flush=True)
else:
    with pool.serial_start(timeout=10):
        print("holding", flush=True)
        time.sleep(60)
time.sleep(60)
"""


def ports(index: int, blocks: int) -> range:
    start = _FIRST_PORT + index * 20
    return range(start, start + blocks * PORT_BLOCK)


def virtual_pool(directory: Path, gpu_count: int, port_range: range) -> HostPool:
    return make_pool(directory, gpu_count, port_range, [])


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(directory: Path, gpus: int, port_range: range, mode: str, count: int = 0) -> Holder:
        args = [str(directory), str(gpus), str(port_range.start), str(port_range.stop), mode,
                str(count)]
        holder = Holder(HOLDER, args, tmp_path / f"holder-{len(started)}.err")
        started.append(holder)
        return holder

    try:
        yield start
    finally:
        for holder in started:
            holder.kill()
        # Every holder is reaped: none of their pids is left, not even as a zombie.
        left = [h.process.pid for h in started if psutil.pid_exists(h.process.pid)]
        assert not left, f"holder processes left behind: {left}"


def lease_line(line: str) -> tuple[int, set[str]]:
    port, gpus = line.split()
    return int(port), set(gpus.split(","))


def test_lease_takes_gpus_and_a_port_block(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path, 4, ports(0, 2))
    lease = pool.acquire(2, timeout=1)
    try:
        assert len(lease.gpus) == 2
        assert set(lease.gpus) <= set(pool.gpu_ids)
        assert lease.port in pool.port_blocks
        # vLLM's internal ports follow the API port, inside the same block.
        assert lease.internal_port == lease.port + 1
        assert 0 <= lease.wait_s < 1
    finally:
        lease.release()


def test_two_leases_in_one_process_never_share(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path, 4, ports(1, 2))
    first = pool.acquire(2, timeout=1)
    second = pool.acquire(2, timeout=1)
    try:
        assert not set(first.gpus) & set(second.gpus)
        assert first.port != second.port
        assert abs(first.port - second.port) >= PORT_BLOCK
        # Everything is taken now: a third lease cannot be had.
        with pytest.raises(LeaseTimeout):
            pool.acquire(1, timeout=0)
    finally:
        first.release()
        second.release()


def test_release_frees_gpus_and_port(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path, 1, ports(2, 1))
    lease = pool.acquire(1, timeout=1)
    with pytest.raises(LeaseTimeout):
        pool.acquire(1, timeout=0)
    lease.release()
    lease.release()  # a second release is harmless
    again = pool.acquire(1, timeout=0)
    try:
        assert (again.gpus, again.port) == (lease.gpus, lease.port)
    finally:
        again.release()


def test_another_process_lease_is_disjoint_from_ours(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    port_range = ports(3, 2)
    holder = holders(tmp_path, 4, port_range, "lease", 2)
    their_port, their_gpus = lease_line(holder.read_line())
    pool = virtual_pool(tmp_path, 4, port_range)
    ours = pool.acquire(2, timeout=2)
    try:
        assert not set(ours.gpus) & their_gpus
        assert ours.port != their_port
    finally:
        ours.release()


def test_another_process_blocks_its_gpus_until_killed(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    # Two port blocks but only two GPUs, all leased by the holder: only GPUs are scarce.
    port_range = ports(4, 2)
    holder = holders(tmp_path, 2, port_range, "lease", 2)
    their_port, their_gpus = lease_line(holder.read_line())
    pool = virtual_pool(tmp_path, 2, port_range)
    with pytest.raises(LeaseTimeout):
        pool.acquire(1, timeout=0.3)
    holder.kill()
    # The kernel dropped the holder's flocks with it: no wait, no stale lock to clean.
    lease = pool.acquire(2, timeout=0)
    try:
        assert set(lease.gpus) == their_gpus
        assert lease.port == their_port
    finally:
        lease.release()


def test_another_process_blocks_its_port_block_until_killed(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    # One port block, two GPUs: after the holder takes one GPU, only the port is scarce.
    port_range = ports(5, 1)
    holder = holders(tmp_path, 2, port_range, "lease", 1)
    their_port, _ = lease_line(holder.read_line())
    pool = virtual_pool(tmp_path, 2, port_range)
    with pytest.raises(LeaseTimeout):
        pool.acquire(1, timeout=0.3)
    holder.kill()
    lease = pool.acquire(2, timeout=0)
    try:
        assert lease.port == their_port
    finally:
        lease.release()


@pytest.mark.parametrize("offset", [0, 5], ids=["api-port", "internal-port"])
def test_block_with_a_foreign_bound_port_is_skipped(tmp_path: Path, offset: int) -> None:
    port_range = ports(6 + offset // 5, 2)
    pool = virtual_pool(tmp_path, 2, port_range)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as foreign:
        foreign.bind(("127.0.0.1", port_range.start + offset))
        foreign.listen()
        lease = pool.acquire(1, timeout=1)
        try:
            assert lease.port == port_range.start + PORT_BLOCK
        finally:
            lease.release()
    # The skipped block's lock was given back: once the port is free, it is leased again.
    lease = pool.acquire(1, timeout=1)
    try:
        assert lease.port == port_range.start
    finally:
        lease.release()


def test_more_gpus_than_the_pool_has_fails_at_once(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path, 2, ports(8, 1))
    started = time.monotonic()
    with pytest.raises(LeaseTimeout, match=r"needs 3 GPU\(s\) but the pool has 2"):
        pool.acquire(3, timeout=30)
    assert time.monotonic() - started < 1


def test_busy_pool_times_out_naming_the_pool(tmp_path: Path) -> None:
    port_range = ports(9, 1)
    pool = virtual_pool(tmp_path, 1, port_range)
    held = pool.acquire(1, timeout=1)
    try:
        started = time.monotonic()
        with pytest.raises(LeaseTimeout) as raised:
            pool.acquire(1, timeout=0.6)
        elapsed = time.monotonic() - started
    finally:
        held.release()
    assert 0.6 <= elapsed < 3
    message = str(raised.value)
    assert "GPUs 0" in message
    assert f"ports {port_range.start}-{port_range.stop - 1}" in message
    assert str(tmp_path) in message


def test_serial_start_is_exclusive_across_processes(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    port_range = ports(10, 1)
    holder = holders(tmp_path, 1, port_range, "serial")
    assert holder.read_line() == "holding"
    pool = virtual_pool(tmp_path, 1, port_range)
    started = time.monotonic()
    with (
        pytest.raises(LeaseTimeout, match=r"another server on this host was still starting"),
        pool.serial_start(timeout=0.3),
    ):
        pytest.fail("entered serial_start while another process holds it")
    assert time.monotonic() - started >= 0.3
    holder.kill()
    entered = False
    with pool.serial_start(timeout=0):
        entered = True
    assert entered
    # Leaving the block released it: it can be entered again at once.
    with pool.serial_start(timeout=0):
        pass


def test_make_pool_with_a_count_and_no_real_gpus_is_virtual(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, 3, ports(11, 1), [])
    assert pool.gpu_ids == ("0", "1", "2")
    assert pool.gpu_lock_names == ("virtual-0", "virtual-1", "virtual-2")


def test_make_pool_with_explicit_ids_keeps_them(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, ["2", "5"], ports(11, 1), [])
    assert pool.gpu_ids == ("2", "5")
    assert pool.gpu_lock_names == ("virtual-2", "virtual-5")


def test_make_pool_with_none_and_no_real_gpus_has_eight(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, None, ports(11, 1), [])
    assert pool.gpu_ids == tuple(str(i) for i in range(8))


def test_make_pool_on_real_gpus_locks_by_uuid(tmp_path: Path) -> None:
    real = [("0", "GPU-aaa"), ("1", "GPU-bbb"), ("2", "GPU-ccc")]
    assert make_pool(tmp_path, None, ports(11, 1), real).gpu_ids == ("0", "1", "2")
    first_two = make_pool(tmp_path, 2, ports(11, 1), real)
    assert first_two.gpu_ids == ("0", "1")
    assert first_two.gpu_lock_names == ("GPU-aaa", "GPU-bbb")
    explicit = make_pool(tmp_path, ["2"], ports(11, 1), real)
    assert explicit.gpu_lock_names == ("GPU-ccc",)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (4, "--profllm-gpus 4: NVML finds only 3 GPU(s) on this host"),
        (["1", "7"], "--profllm-gpus: no GPU with id 7 (NVML finds ids 0, 1, 2)"),
    ],
)
def test_make_pool_refuses_real_gpus_the_host_lacks(
    tmp_path: Path, spec: int | list[str], message: str
) -> None:
    real = [("0", "GPU-aaa"), ("1", "GPU-bbb"), ("2", "GPU-ccc")]
    with pytest.raises(ValueError) as error:
        make_pool(tmp_path, spec, ports(11, 1), real)
    assert str(error.value) == message


def test_pools_of_different_specs_agree_on_a_gpu(tmp_path: Path) -> None:
    # GPU "1" is the same lock whether a session names it or counts up to it.
    counted = make_pool(tmp_path, 2, ports(12, 1), [])
    named = make_pool(tmp_path, ["1"], ports(13, 1), [])
    lease = named.acquire(1, timeout=1)
    try:
        with pytest.raises(LeaseTimeout):
            counted.acquire(2, timeout=0)
        only = counted.acquire(1, timeout=0)
        try:
            assert only.gpus == ("0",)
        finally:
            only.release()
    finally:
        lease.release()


def test_default_pool_dir_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POOL_DIR_ENV, str(tmp_path / "locks"))
    assert default_pool_dir() == tmp_path / "locks"
    monkeypatch.delenv(POOL_DIR_ENV)
    # One folder for every user of the host, so their sessions see each other's leases.
    assert default_pool_dir().name == "pytest-profllm-pool"


def test_pool_folder_and_locks_are_open_to_every_user(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path / "shared", 1, ports(10, 1))
    lease = pool.acquire(1, timeout=5)
    try:
        mode = (tmp_path / "shared").stat().st_mode
        assert stat.S_IMODE(mode) == 0o1777  # sticky: nobody removes another's lock file
        for lock in (tmp_path / "shared").glob("*.lock"):
            assert stat.S_IMODE(lock.stat().st_mode) == 0o666, lock
    finally:
        lease.release()


def test_waiters_queue_so_a_large_lease_is_not_starved(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    port_range = ports(12, 3)
    small = holders(tmp_path, 2, port_range, "lease", 1)
    small.read_line()
    large = holders(tmp_path, 2, port_range, "lease", 2)
    # Wait until the large request holds the queue (it waits there for both GPUs).
    queue = virtual_pool(tmp_path, 2, port_range)._lock("lease-queue")
    deadline = time.monotonic() + 15
    while True:
        try:
            queue.acquire(timeout=0)
        except filelock.Timeout:
            break
        queue.release(force=True)
        assert time.monotonic() < deadline, "the large request never queued"
        time.sleep(0.05)
    # One GPU is free, but the large request came first: we wait behind it.
    pool = virtual_pool(tmp_path, 2, port_range)
    with pytest.raises(LeaseTimeout, match="waiting in the lease queue"):
        pool.acquire(1, timeout=0.3)
    small.kill()
    _, gpus = lease_line(large.read_line())
    assert gpus == {"0", "1"}
    large.kill()
    lease = pool.acquire(1, timeout=5)
    lease.release()


@pytest.mark.parametrize("planted", ["folder", "symlink"])
def test_an_entry_planted_under_a_port_lock_is_passed_over_with_a_warning(
    tmp_path: Path, planted: str
) -> None:
    # Another user of the shared pool folder may plant anything under a lock's name: that
    # block is not leasable, and the next one is leased.
    port_range = ports(14, 2)
    pool = virtual_pool(tmp_path, 1, port_range)
    name = tmp_path / f"port-{port_range.start}.lock"
    if planted == "folder":
        name.mkdir()
    else:
        (tmp_path / "elsewhere").write_text("")
        name.symlink_to(tmp_path / "elsewhere")
    with pytest.warns(PoolEntryWarning) as warned:
        lease = pool.acquire(1, timeout=1)
    try:
        assert lease.port == port_range.start + PORT_BLOCK
    finally:
        lease.release()
    [warning] = warned.list
    message = str(warning.message)
    assert str(name) in message and "\n" not in message


def test_an_entry_planted_under_every_gpu_lock_times_out_in_one_line(tmp_path: Path) -> None:
    pool = virtual_pool(tmp_path, 2, ports(14, 1))
    for name in pool.gpu_lock_names:
        (tmp_path / f"gpu-{name}.lock").mkdir()
    with pytest.warns(PoolEntryWarning), pytest.raises(LeaseTimeout) as raised:
        pool.acquire(1, timeout=0.3)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("lock", ["lease-queue", "server-start"])
def test_an_entry_planted_under_a_single_lock_is_one_line(tmp_path: Path, lock: str) -> None:
    # The queue and the start have one lock each, and no other to turn to.
    pool = virtual_pool(tmp_path, 1, ports(14, 1))
    (tmp_path / f"{lock}.lock").mkdir()
    with pytest.raises(LeaseTimeout, match=f"{lock}.lock") as raised:
        if lock == "lease-queue":
            pool.acquire(1, timeout=0.3)
        else:
            with pool.serial_start(timeout=0.3):
                pass
    assert "\n" not in str(raised.value)
