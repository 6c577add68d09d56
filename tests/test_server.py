"""Server processes with the simulated engine as a real process: start, readiness, start-up
failures, stopping the whole process group, and one server per key in `WorkerServers`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from fake_nvml import FakeGpu, FakeNvml

from pytest_profllm.engine.command import serve_command
from pytest_profllm.hosts.pool import HostPool, LeaseTimeout, make_pool
from pytest_profllm.plan.case import Case, expand
from pytest_profllm.plan.suite import validate_suite
from pytest_profllm.server.launch import HOST, server_env
from pytest_profllm.server.process import ServerProcess, ServerStartError, ServerStopWarning
from pytest_profllm.server.workers import WorkerServers

MODEL = "Qwen/Qwen3-8B"
# This file's ports: 24500 and up, one block per xdist worker, so that servers started by
# two workers at once never share a port (each test's pool has its own lock directory).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = range(24500 + 10 * _WORKER, 24510 + 10 * _WORKER)
READY_TIMEOUT = 15.0

# The server ignores SIGTERM, and so does a child it starts in its process group.
IGNORES_SIGTERM = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('child ready', flush=True); time.sleep(60)"])
print("child pid", child.pid, flush=True)
time.sleep(60)
"""


def group_alive(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in the process group."""
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def wait_group_gone(pgid: int, timeout: float = 3.0) -> list[int]:
    # SIGKILL is delivered asynchronously to members other than the one waited for.
    deadline = time.monotonic() + timeout
    while (left := group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def pid_of(server: ServerProcess) -> int:
    # The process leads its own group (start_new_session): its pid is the group id.
    assert server._process is not None
    return server._process.pid


def live_children() -> list[psutil.Process]:
    children = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                children.append(child)
    return children


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    yield
    left = live_children()
    for child in left:  # reap them before failing, so no later test inherits them
        with contextlib.suppress(psutil.Error):
            os.killpg(child.pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def pool(tmp_path: Path) -> HostPool:
    return make_pool(tmp_path / "locks", 1, PORTS, [])


@pytest.fixture
def servers(tmp_path: Path, pool: HostPool) -> Iterator[list[ServerProcess]]:
    """ServerProcesses a test makes; stopped (SIGKILL at once) and their leases freed."""
    made: list[ServerProcess] = []
    try:
        yield made
    finally:
        for server in made:
            server.stop(grace=0)
            server.lease.release()
        for server in made:
            if server._process is not None:
                assert not wait_group_gone(pid_of(server))


def make_server(
    servers: list[ServerProcess], pool: HostPool, log_dir: Path, argv: list[str] | None = None,
    server: dict[str, Any] | None = None,
) -> ServerProcess:
    lease = pool.acquire(1, timeout=5)
    process = ServerProcess(
        key="key",
        label="label",
        engine="sim",
        argv=argv or serve_command("sim", server or {"model": MODEL}, HOST, lease.port),
        env=server_env(lease),
        log_path=log_dir / "server.log",
        lease=lease,
    )
    servers.append(process)
    return process


def test_server_starts_answers_and_stops_its_whole_group(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    server = make_server(servers, pool, tmp_path / "logs")
    server.start()
    server.wait_ready(READY_TIMEOUT)
    assert server.alive()
    response = requests.get(f"{server.base_url}/v1/models", timeout=5)
    assert response.status_code == 200
    assert [model["id"] for model in response.json()["data"]] == [MODEL]
    pgid = pid_of(server)
    server.stop()
    assert not server.alive()
    assert not wait_group_gone(pgid)
    assert server.ready_at is not None and server.stopped_at is not None
    assert 0 < server.started_at <= server.ready_at <= server.stopped_at
    log = server.log_path.read_text()
    assert log.startswith("# profllm: ")
    # The lease reached the server: its GPUs and internal port base are in its environment.
    assert f"CUDA_VISIBLE_DEVICES=0 VLLM_PORT={server.lease.internal_port}" in log
    stopped = server.stopped_at
    server.stop()  # stopping twice changes nothing
    assert server.stopped_at == stopped


def test_server_exiting_at_start_raises_with_exit_tail_and_cause(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    server = make_server(servers, pool, tmp_path / "logs", server={"model": "./no-such-model"})
    server.start()
    started = time.monotonic()
    with pytest.raises(ServerStartError) as raised:
        server.wait_ready(READY_TIMEOUT)
    # It notices the exit, rather than waiting for the ready timeout.
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "exited with code 1 during start-up" in message
    assert "likely cause: model not found" in message
    assert "does not exist" in message  # the log's tail
    assert str(server.log_path) in message
    assert server.stopped_at is not None
    assert not wait_group_gone(pid_of(server))


def test_server_rejecting_an_argument_names_a_bad_engine_argument(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    # vLLM 0.33.0 rejects the torch profiler without its folder, and so does the simulator.
    config = {"model": MODEL, "profiler_config": {"profiler": "torch"}}
    server = make_server(servers, pool, tmp_path / "logs", server=config)
    server.start()
    with pytest.raises(ServerStartError) as raised:
        server.wait_ready(READY_TIMEOUT)
    message = str(raised.value)
    assert "exited with code 2 during start-up (likely cause: bad engine argument)" in message
    assert "error: argument --profiler-config: torch_profiler_dir must be set" in message
    assert server.stop_problems == []
    assert not wait_group_gone(pid_of(server))


def test_startup_timeout_raises_not_ready_and_kills(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = make_server(servers, pool, tmp_path / "logs", argv=argv)
    server.start()
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready on /health within 1 s"):
        server.wait_ready(1)
    assert 1 <= time.monotonic() - started < 8
    assert not server.alive()
    assert server.stopped_at is not None
    assert not wait_group_gone(pid_of(server))


def test_stop_escalates_to_sigkill_for_the_whole_group(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    server = make_server(servers, pool, tmp_path / "logs", argv=[sys.executable, "-c",
                                                                 IGNORES_SIGTERM])
    server.start()
    deadline = time.monotonic() + 10
    # Whole lines only: the log's header line quotes the script itself.
    while not re.search(r"^child ready$", log := server.log_path.read_text(), re.M):
        assert time.monotonic() < deadline, f"child never started; log: {log}"
        time.sleep(0.05)
    found = re.search(r"^child pid (\d+)$", log, re.M)
    assert found, log
    child_pid = int(found.group(1))
    pgid = pid_of(server)
    assert set(group_alive(pgid)) == {pgid, child_pid}
    started = time.monotonic()
    server.stop(grace=0.5)
    # SIGTERM was ignored for the whole grace period, then SIGKILL ended it.
    assert time.monotonic() - started >= 0.5
    assert server._process is not None and server._process.returncode == -signal.SIGKILL
    assert not wait_group_gone(pgid)
    assert not psutil.pid_exists(child_pid) or (
        psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    )


# --- WorkerServers ---------------------------------------------------------------------------


def cases(server: dict[str, Any]) -> list[Case]:
    suite = validate_suite(
        {"server": server, "benchmark": {"num_prompts": [1, 2]}}, "test"
    )
    return expand(suite, "bench_test.yaml")


@pytest.fixture
def workers(tmp_path: Path, pool: HostPool) -> Iterator[WorkerServers]:
    worker = WorkerServers(
        engine="sim",
        pool=pool,
        log_dir=tmp_path / "logs",
        startup_timeout=READY_TIMEOUT,
        lease_timeout=2.0,
    )
    try:
        yield worker
    finally:
        worker.release()


def test_same_server_key_reuses_the_running_server(workers: WorkerServers) -> None:
    first, second, third, _ = cases({"model": MODEL, "max_num_seqs": [8, 16]})
    assert first.server_key == second.server_key != third.server_key
    server = workers.server_for(first)
    workers.after_case(second)  # the next case uses the same server: it keeps running
    assert workers.current is server and server.alive()
    assert workers.server_for(second) is server
    assert workers.starts == 1
    assert "max_num_seqs=8" in server.log_path.read_text()


# Another session's vLLM server, starting: it holds the host's start turn until killed.
HOLD_START_TURN = """
import sys, time
from pathlib import Path
from pytest_profllm.hosts.pool import lock_file
with lock_file(Path(sys.argv[1]), "server-start"):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_simulated_server_starts_while_a_vllm_server_has_the_start_turn(
    workers: WorkerServers, pool: HostPool
) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_START_TURN, str(pool.directory)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        (first, *_) = cases({"model": MODEL, "max_num_seqs": 8})
        server = workers.server_for(first)  # a turn to wait for would time out (2 s + start)
        assert server.alive() and server.ready_at is not None
    finally:
        holder.kill()
        holder.wait()


def test_new_server_key_swaps_the_server(workers: WorkerServers) -> None:
    first, _, other, _ = cases({"model": MODEL, "max_num_seqs": [8, 16]})
    old = workers.server_for(first)
    old_pgid = pid_of(old)
    # The pool has one GPU: the new server can only start if the old lease was given back.
    new = workers.server_for(other)
    assert new is not old and workers.current is new
    assert workers.starts == 2
    assert old.stopped_at is not None and not wait_group_gone(old_pgid)
    assert new.alive()
    assert "max_num_seqs=16" in new.log_path.read_text()
    response = requests.get(f"{new.base_url}/v1/models", timeout=5)
    assert response.status_code == 200


def test_after_case_none_stops_the_server_and_frees_its_lease(
    workers: WorkerServers, pool: HostPool
) -> None:
    first, *_ = cases({"model": MODEL, "max_num_seqs": 8})
    server = workers.server_for(first)
    with pytest.raises(LeaseTimeout):
        pool.acquire(1, timeout=0)  # held by the running server
    workers.after_case(None)
    assert workers.current is None
    assert server.stopped_at is not None and not wait_group_gone(pid_of(server))
    lease = pool.acquire(1, timeout=0)
    assert lease.port == server.lease.port
    lease.release()


def test_after_case_with_another_key_stops_the_server(workers: WorkerServers) -> None:
    first, _, other, _ = cases({"model": MODEL, "max_num_seqs": [8, 16]})
    server = workers.server_for(first)
    workers.after_case(other)
    assert workers.current is None
    assert server.stopped_at is not None and not server.alive()


def test_failed_server_key_fails_again_without_a_second_start(
    workers: WorkerServers, pool: HostPool
) -> None:
    first, second = cases({"model": "./no-such-model"})
    with pytest.raises(ServerStartError, match="likely cause: model not found"):
        workers.server_for(first)
    assert workers.starts == 1 and workers.current is None
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"exited with code 1.*\(see the first case\)"):
        workers.server_for(second)
    assert time.monotonic() - started < 0.5
    assert workers.starts == 1
    # The failed start gave its lease back.
    pool.acquire(1, timeout=0).release()


def test_dead_server_is_started_again_for_its_key(workers: WorkerServers) -> None:
    first, second, *_ = cases({"model": MODEL, "max_num_seqs": 8})
    server = workers.server_for(first)
    os.killpg(pid_of(server), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while server.alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.warns(ServerStopWarning, match="died between cases: killed by signal 9"):
        again = workers.server_for(second)
    assert again is not server and again.alive()
    assert workers.starts == 2
    # The dead server's stop is recorded, and the new one says why it was started.
    assert server.stopped_at is not None
    assert server.stop_problems == ["died between cases: killed by signal 9 (SIGKILL)"]
    assert again.restart_reason == "its server died between cases: killed by signal 9 (SIGKILL)"


# --- After stop: survivors and GPU memory ----------------------------------------------------

# The server starts a child that leaves the process group (setsid) and ignores SIGTERM: a
# SIGKILL of the group misses it, as it would miss an engine process that did the same.
ESCAPES_GROUP = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('escaped', flush=True); time.sleep(60)"])
print("child pid", child.pid, flush=True)
time.sleep(60)
"""


def wait_for_line(server: ServerProcess, pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + 10
    while not (found := re.search(pattern, log := server.log_path.read_text(), re.M)):
        assert time.monotonic() < deadline, f"{pattern!r} never logged; log: {log}"
        time.sleep(0.05)
    return found


def test_stop_kills_and_reports_a_process_that_left_the_group(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    server = make_server(servers, pool, tmp_path / "logs", argv=[sys.executable, "-c",
                                                                 ESCAPES_GROUP])
    server.start()
    wait_for_line(server, r"^escaped$")
    child_pid = int(wait_for_line(server, r"^child pid (\d+)$").group(1))
    assert os.getpgid(child_pid) != pid_of(server)  # really out of the group
    with pytest.warns(ServerStopWarning, match=r"1 process\(es\) outlived .* were killed: pid "):
        server.stop(grace=0.5)
    (problem,) = server.stop_problems
    assert f"pid {child_pid} (" in problem
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child_pid) and psutil.Process(child_pid).status() != "zombie":
        assert time.monotonic() < deadline, "the escaped child is still alive"
        time.sleep(0.05)
    assert f"# profllm: {problem}" in server.log_path.read_text()


def test_clean_stop_reports_nothing(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess]
) -> None:
    server = make_server(servers, pool, tmp_path / "logs")
    server.start()
    server.wait_ready(READY_TIMEOUT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServerStopWarning)
        server.stop()
    assert server.stop_problems == []


def test_stop_waits_for_the_leased_gpus_memory_to_be_freed(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(servers, pool, tmp_path / "logs")
    server.start()
    server.wait_ready(READY_TIMEOUT)
    server_pid = pid_of(server)
    queries = []

    def holders() -> dict[int, int]:
        # The driver frees the dead server's memory on the third query after stop.
        queries.append(time.monotonic())
        return {server_pid: 2**30, 1: 2**20} if len(queries) < 3 else {1: 2**20}

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeGpu(holders=holders)]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServerStopWarning)
        server.stop()
    assert len(queries) == 3
    assert server.stop_problems == []


def test_gpu_memory_still_held_after_stop_is_reported(
    tmp_path: Path, pool: HostPool, servers: list[ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(servers, pool, tmp_path / "logs")
    server.gpu_release_timeout = 0.3
    server.start()
    server.wait_ready(READY_TIMEOUT)
    server_pid = pid_of(server)
    nvml = FakeNvml([FakeGpu(holders=lambda: {server_pid: 5 * 2**30})])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.warns(ServerStopWarning, match="GPU memory still held"):
        server.stop()
    assert server.stop_problems == [
        f"GPU memory still held 0 s after the server stopped (GPU 0: pid {server_pid} 5120 MiB)"
    ]


# --- Profiling servers -----------------------------------------------------------------------


def test_profiling_case_gets_its_own_server_with_vllms_profiler_config(
    workers: WorkerServers, tmp_path: Path
) -> None:
    suite = validate_suite(
        {"server": {"model": MODEL}, "benchmark": {"num_prompts": 1}, "profile": True}, "test"
    )
    (profiled,) = expand(suite, "bench_test.yaml")
    plain, _ = cases({"model": MODEL})
    assert profiled.profile and not plain.profile
    assert profiled.server_key != plain.server_key
    server = workers.server_for(profiled)
    assert server.profile_dir == tmp_path / "logs" / "profiles" / (
        f"test-qwen3-8b-{profiled.server_key}"
    )
    flag = server.argv.index("--profiler-config")
    assert json.loads(server.argv[flag + 1]) == {
        "profiler": "torch",
        "torch_profiler_dir": str(server.profile_dir),
    }
    assert "VLLM_TORCH_PROFILER_DIR" not in server.env  # vLLM 0.33.0 warns about it as unknown
    response = requests.post(f"{server.base_url}/start_profile", timeout=5)
    assert response.status_code == 200
    assert requests.post(f"{server.base_url}/stop_profile", timeout=5).status_code == 200
    assert len(list(server.profile_dir.glob("*.pt.trace.json.gz"))) == 1


def test_a_server_dying_mid_case_errors_the_case_at_once(workers: WorkerServers) -> None:
    # The schedule would take 20 s (200 requests at 10/s); the server dies 1 s in: the case
    # errors within a second or so of its death, with its lease given back.
    import threading

    from pytest_profllm.engine.choice import EngineChoice
    from pytest_profllm.run.outcome import CaseOutcome
    from pytest_profllm.run.serve import run_case
    from pytest_profllm.server.process import ServerLost

    suite = validate_suite(
        {
            "server": {"model": MODEL},
            "benchmark": {"num_prompts": 200, "request_rate": 10, "random_input_len": 8,
                          "random_output_len": 4},
        },
        "test",
    )
    (case,) = expand(suite, "bench_test.yaml")
    server = workers.server_for(case)
    outcome = CaseOutcome(case, "n", "s", EngineChoice("sim", "test", None), "main", time.time())
    threading.Timer(1.0, lambda: os.killpg(pid_of(server), signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(ServerLost, match=r"died during the case: killed by signal 9"):
        run_case(case, workers, outcome)
    assert time.monotonic() - started < 8
    assert outcome.results == {}
    assert workers.current is None
    workers.pool.acquire(1, timeout=0).release()
