"""Host cores for the load: leased host-wide through file locks, capped on a small host, never
a CPU server's; the client's thread and a simulated server's process tree pinned to them; and
what a run's records say of them."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import Holder, run_records, run_suites

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.hosts import cores as cores_module
from pytest_profllm.hosts.cores import CoreLease, LoadCores, thread_on, tree_off, tree_on
from pytest_profllm.hosts.devices import usable_cores
from pytest_profllm.hosts.pool import Lease, LeaseTimeout, make_pool
from pytest_profllm.options import Settings
from pytest_profllm.run.outcome import client_core_shared
from pytest_profllm.server.process import ServerProcess
from pytest_profllm.session.controller import ControllerSession
from pytest_profllm.session.identity import RunIdentity
from pytest_profllm.session.report import summary_lines

# A second process that holds load cores from the same folder, says so, and gives them back
# when told (a line on stdin); then it sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from pytest_profllm.hosts.cores import LoadCores
directory, cores, client, server = sys.argv[1:5]
pool = LoadCores(Path(directory), tuple(int(c) for c in cores.split(",")))
with pool.hold(int(client), int(server), timeout=10) as lease:
    print("holding", *lease.client, "/", *lease.server, flush=True)
    sys.stdin.readline()
print("released", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(directory: Path, cores: str, client: int, server: int) -> Holder:
        args = [str(directory), cores, str(client), str(server)]
        holder = Holder(HOLDER, args, tmp_path / f"holder-{len(started)}.err")
        started.append(holder)
        return holder

    try:
        yield start
    finally:
        for holder in started:
            holder.kill()
        left = [h.process.pid for h in started if psutil.pid_exists(h.process.pid)]
        assert not left, f"holder processes left behind: {left}"


@pytest.mark.parametrize(
    ("cores", "client", "server", "expected"),
    [
        ((0, 1), 1, 1, ((0,), (1,))),
        ((0, 1, 2, 3), 2, 1, ((0, 1), (2,))),
        ((0, 1, 2, 3), 1, 0, ((0,), ())),  # vLLM's server holds no load core
        # Capped at what there is: the server keeps a core of its own while the client has
        # one; on one core the two share it.
        ((0, 1), 3, 1, ((0,), (1,))),
        ((0,), 1, 1, ((0,), (0,))),
        ((0,), 2, 0, ((0,), ())),
        ((5,), 0, 1, ((), (5,))),
    ],
)
def test_a_hold_gives_the_client_and_the_server_their_cores(
    tmp_path: Path,
    cores: tuple[int, ...],
    client: int,
    server: int,
    expected: tuple[tuple[int, ...], tuple[int, ...]],
) -> None:
    with LoadCores(tmp_path, cores).hold(client, server, timeout=1) as lease:
        assert (lease.client, lease.server) == expected
        assert lease.as_record() == {"client": list(expected[0]), "server": list(expected[1])}
    # Given back: all of them can be held again.
    with LoadCores(tmp_path, cores).hold(len(cores), 0, timeout=1) as lease:
        assert lease.client == cores



def test_client_processes_auto_is_one_per_leased_client_core(tmp_path: Path) -> None:
    pool = LoadCores(tmp_path, (0, 1, 2, 3))
    # `auto` asks for every load core; the simulated server keeps one of its own.
    assert cores_module.cores_wanted("auto", pool) == 4
    assert cores_module.cores_wanted(2, pool) == 2
    with pool.hold(cores_module.cores_wanted("auto", pool), 1, timeout=1) as lease:
        assert (lease.client, lease.server) == ((0, 1, 2), (3,))
        assert cores_module.client_processes("auto", lease) == 3
    assert cores_module.client_processes(2, lease) == 2  # a number stays what it says
    # No core leased (--profllm-no-load-cores, one core for both): one process.
    assert cores_module.client_processes("auto", CoreLease((), (), 0.0)) == 1
    assert cores_module.client_processes("auto", None) == 1

def test_nothing_asked_holds_nothing(tmp_path: Path) -> None:
    with LoadCores(tmp_path / "pool", (0,)).hold(0, 0, timeout=1) as lease:
        assert lease == CoreLease((), (), lease.wait_s)
    assert not (tmp_path / "pool").exists()


def test_holds_block_each_other_across_processes_until_released(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    holder = holders(tmp_path, "0,1", 1, 1)
    assert holder.read_line() == "holding 0 / 1"
    pool = LoadCores(tmp_path, (0, 1))
    with pytest.raises(LeaseTimeout), pool.hold(1, 0, timeout=0.3):
        pass
    # A hold that waits gets the cores once the holder gives them back.
    got: list[CoreLease] = []
    waiter = threading.Thread(target=lambda: got.append(_hold_once(pool, 2, 0, 15)))
    waiter.start()
    holder.release()
    assert holder.read_line() == "released"
    waiter.join(timeout=20)
    assert [(lease.client, lease.server) for lease in got] == [((0, 1), ())]


def test_a_killed_holders_cores_are_free_at_once(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    holder = holders(tmp_path, "0", 1, 1)
    assert holder.read_line() == "holding 0 / 0"
    holder.kill()
    with LoadCores(tmp_path, (0,)).hold(1, 1, timeout=5) as lease:
        assert (lease.client, lease.server) == ((0,), (0,))


def _hold_once(pool: LoadCores, client: int, server: int, timeout: float) -> CoreLease:
    with pool.hold(client, server, timeout) as lease:
        return lease


def test_a_timeout_says_what_was_asked_and_what_the_pool_has(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    holder = holders(tmp_path, "3", 1, 0)
    assert holder.read_line() == "holding 3 /"
    with pytest.raises(LeaseTimeout) as error, LoadCores(tmp_path, (3,)).hold(1, 1, 0.2):
        pass
    assert str(error.value) == (
        "no 1 free load core(s) for a client of 1 and a server of 1 after 0 s waiting for "
        f"them to come free (pool: load cores 3, lock dir {tmp_path}; raise "
        "--profllm-lease-timeout to wait longer)"
    )


def test_the_load_cores_leave_out_cpu_servers_core_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cpu_pool(sets: tuple[str, ...]) -> Any:
        from pytest_profllm.hosts.pool import HostPool

        return HostPool(tmp_path, sets, tuple(f"cpu-{s}" for s in sets), range(40000, 40020))

    monkeypatch.setattr(cores_module, "usable_cores", lambda: [0, 1, 2, 3])
    assert LoadCores.of(cpu_pool(("1-2",)), "cpu").cores == (0, 3)
    assert LoadCores.of(cpu_pool(("1", "2-3")), "cpu").cores == (0,)
    # The simulator's GPUs are virtual: every usable core is a load core.
    virtual = make_pool(tmp_path, 4, range(40000, 40040), [])
    assert LoadCores.of(virtual, "virtual") == LoadCores(tmp_path, (0, 1, 2, 3))
    # One core: the one set shares it, and so does the client.
    monkeypatch.setattr(cores_module, "usable_cores", lambda: [0])
    assert LoadCores.of(cpu_pool(("0",)), "cpu").cores == (0,)


def test_the_client_thread_and_what_it_starts_run_on_its_cores() -> None:
    before = os.sched_getaffinity(0)
    core = usable_cores()[-1]
    child = None
    try:
        with thread_on([core]):
            assert os.sched_getaffinity(0) == {core}
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            assert os.sched_getaffinity(child.pid) == {core}
        assert os.sched_getaffinity(0) == before
        with thread_on([]):
            assert os.sched_getaffinity(0) == before
    finally:
        if child is not None:
            child.kill()
            child.wait(timeout=10)


# A server stand-in: a thread besides its main one, and a child process of its own.
SERVER_TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print("up", flush=True)
time.sleep(30)
"""


@pytest.fixture
def server_tree() -> Iterator[psutil.Process]:
    """SERVER_TREE running in its own process group (its root), killed whatever the test
    does."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_TREE], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 15)
        assert ready and server.stdout.readline().strip() == b"up"
        root = psutil.Process(server.pid)
        assert len(root.children(recursive=True)) == 1
        yield root
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()


def _threads(root: psutil.Process) -> list[int]:
    return [t.id for p in [root, *root.children(recursive=True)] for t in p.threads()]


def test_a_servers_every_process_and_thread_runs_on_its_cores(
    server_tree: psutil.Process,
) -> None:
    core = usable_cores()[-1]
    threads = _threads(server_tree)
    assert len(threads) >= 3
    before = {thread: os.sched_getaffinity(thread) for thread in threads}
    with tree_on(server_tree.pid, [core]):
        assert {thread: os.sched_getaffinity(thread) for thread in threads} == {
            thread: {core} for thread in threads
        }
    assert {thread: os.sched_getaffinity(thread) for thread in threads} == before
    with tree_on(None, [core]), tree_on(server_tree.pid, []):
        assert {thread: os.sched_getaffinity(thread) for thread in threads} == before


def _cpus_allowed(pid: int) -> set[int]:
    """A process's `Cpus_allowed_list` in /proc/PID/status, as a set of cores."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two usable cores")
def test_every_process_of_a_vllm_server_keeps_off_the_clients_core(
    server_tree: psutil.Process,
) -> None:
    # vLLM binds its CPU workers' threads itself; its API server and engine core were left on
    # every core, the client's too. A thread bound elsewhere keeps its bind.
    client, *rest = usable_cores()
    tree = [server_tree, *server_tree.children(recursive=True)]
    threads = _threads(server_tree)
    assert all(client in _cpus_allowed(p.pid) for p in tree)
    bound = next(t.id for t in server_tree.threads() if t.id != server_tree.pid)
    os.sched_setaffinity(bound, {rest[-1]})  # as vLLM binds an OMP thread
    before = {thread: os.sched_getaffinity(thread) for thread in threads}
    with tree_off(server_tree.pid, [client]):
        assert all(client not in _cpus_allowed(p.pid) for p in tree)
        after = {thread: os.sched_getaffinity(thread) for thread in threads}
        assert all(client not in cores for cores in after.values())
        assert after[bound] == {rest[-1]}
    assert {thread: os.sched_getaffinity(thread) for thread in threads} == before


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs two usable cores")
def test_a_vllm_server_on_cpu_starts_pinned_to_its_core_sets(tmp_path: Path) -> None:
    # Pinned at launch, before vLLM's code runs: its API server and engine core, and every
    # process and thread they start later (which a pin during the load alone would miss
    # until the next load), never run on the client's core.
    client, *rest = usable_cores()
    core_set = f"{rest[0]}-{rest[-1]}" if len(rest) > 1 else str(rest[0])
    lease = Lease(gpus=(core_set,), gpu_uuids=(), port=1, internal_port=2, wait_s=0.0)
    server = ServerProcess(key="k", label="l", engine="vllm", argv=[sys.executable, "-c",
                           SERVER_TREE], env={}, log_path=tmp_path / "server.log", lease=lease,
                           device="cpu")
    server.start()
    try:
        assert server.pid is not None
        log = tmp_path / "server.log"
        for _ in range(150):  # bounded: 15 s for its "up"
            if "up" in log.read_text().splitlines():
                break
            time.sleep(0.1)
        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        assert all(_cpus_allowed(p.pid) == set(rest) for p in tree)
        assert all(client not in os.sched_getaffinity(t) for t in _threads(tree[0]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid or 0, signal.SIGKILL)
        assert server._process is not None
        server._process.wait(timeout=10)
    # The simulator is not pinned at its start: a load pins it to the core it leases.
    sim = ServerProcess(key="k", label="l", engine="sim", argv=[], env={},
                        log_path=tmp_path / "sim.log", lease=lease, device="cpu")
    assert sim.launch_cores() == set()


def test_the_record_says_when_the_client_had_no_core_of_its_own() -> None:
    lease = Lease(gpus=("1",), gpu_uuids=(), port=1, internal_port=2, wait_s=0.0)
    vllm = ServerProcess(key="k", label="l", engine="vllm", argv=[], env={},
                         log_path=Path("x.log"), lease=lease, device="cpu")
    sim = ServerProcess(key="k", label="l", engine="sim", argv=[], env={},
                        log_path=Path("x.log"), lease=lease, device="gpu")
    assert client_core_shared(vllm, CoreLease((0,), (), 0.0)) is None
    assert client_core_shared(sim, CoreLease((0,), (1,), 0.0)) is None
    assert client_core_shared(sim, None) is None  # no load ran
    off = client_core_shared(vllm, CoreLease((), (), 0.0))
    assert off is not None and "--profllm-no-load-cores" in off
    one_core = client_core_shared(sim, CoreLease((0,), (0,), 0.0))
    assert one_core is not None and "core(s) 0" in one_core
    # A vLLM core set that takes the client's core (a one-core host's only set).
    assert client_core_shared(vllm, CoreLease((1,), (), 0.0)) is not None


def test_the_summary_adds_up_the_loads_waits(tmp_path: Path) -> None:
    settings = Settings(
        out_dir=tmp_path, db_path=None, engine="sim", gpus=4, ports=range(20000, 20100),
        startup_timeout=10, lease_timeout=10, suite_glob="bench_*.yaml",
    )
    session = ControllerSession(settings, RunIdentity("s", EngineChoice("sim", "test", None)))
    for case, wait in (("c1", 0.1), ("c2", 2.0), ("c3", 3.5)):
        runtime = {"worker": "gw0", "server_key": "k", "load_core_wait_s": wait,
                   "load_cores": {"client": [0], "server": [1]}}
        session.receive({"run_id": case, "case_id": case, "status": "passed", "results": {},
                         "runtime": runtime}, None)
    assert (
        "2 load(s) waited for host cores, 5.5 s in all (longest 3.5 s), not counted in any "
        "measurement"
    ) in summary_lines(session)


def test_a_runs_records_say_which_cores_each_load_held(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_cores="""
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [8, 16]
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
""",
    )
    result = run_suites(pytester, ports, "-n", "2", load_cores=True)
    result.assert_outcomes(passed=2)
    usable = usable_cores()
    records = run_records(pytester)
    assert len(records) == 2
    for record in records:
        runtime = record["runtime"]
        held = runtime["load_cores"]
        assert set(held) == {"client", "server"}
        assert len(held["client"]) == 1 and len(held["server"]) == 1
        assert set(held["client"] + held["server"]) <= set(usable)
        # Two cores or more: the simulator never shares the client's.
        assert (held["client"] == held["server"]) == (len(usable) == 1)
        assert runtime["load_core_wait_s"] >= 0
    # The table has them as columns: the cores as JSON, the wait as a number.
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = db.execute(
            "select runtime_load_cores, typeof(runtime_load_core_wait_s) from benchmark_runs"
        ).fetchall()
    assert sorted((json.loads(cores), kind) for cores, kind in rows) == sorted(
        (r["runtime"]["load_cores"], "real") for r in records
    )


def test_a_server_sharing_the_clients_core_runs_below_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        process = psutil.Process(child.pid)
        start = process.nice()
        cores_module.below_the_client(child.pid)
        lowered = max(start, cores_module.SHARED_SERVER_NICENESS)
        assert process.nice() == lowered
        cores_module.below_the_client(child.pid)  # never raised again, never lowered
        assert process.nice() == lowered
        cores_module.below_the_client(None)  # no server process: nothing to do
    finally:
        child.kill()
        child.wait()


def test_the_plugin_starts_its_simulators_at_the_clients_priority() -> None:
    # A simulator with a load core of its own needs no lower priority (it would only make it
    # give way to the host's other work); vLLM is started as it is.
    from pytest_profllm.hosts.pool import Lease
    from pytest_profllm.server.launch import SIM_NICE_ENV, launch

    lease = Lease(("0",), (), 20000, 20001, 0.0)
    _, sim_env = launch("sim", {"model": "Qwen/Qwen3-8B"}, lease, device="virtual")
    assert sim_env[SIM_NICE_ENV] == "0"
    assert sim_env["VLLM_SERVER_DEV_MODE"] == "1"
