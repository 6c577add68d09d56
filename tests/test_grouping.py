"""Parallel runs on one host: every server starts once, on one worker; no two servers alive at
the same time share a GPU or a port, across xdist workers and across pytest sessions; a killed
worker's GPUs and ports go to the next server. Proven from the records the runs write."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
from helpers import run_records

# Six server configurations (tp 1, 2 and 4 by two batch sizes), three cases each.
MIXED_TP_SUITE = """
server:
  model: sim-mixed
  tensor_parallel_size: [1, 2, 4]
  max_num_seqs: [8, 16]
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: [4, 6, 8]
thresholds:
  completed: {min: 4}
"""
SERVERS = 6
CASES = 18
# Two sessions at once: a one- and a two-GPU server each, two cases each. Together they need six
# GPUs of the pool's four, so the sessions contend for the same GPUs and ports.
TWO_SESSIONS_SUITE = (
    MIXED_TP_SUITE.replace("[1, 2, 4]", "[1, 2]").replace("[8, 16]", "8")
    .replace("[4, 6, 8]", "[4, 6]")
)
TWO_SESSIONS_SERVERS = 2
TWO_SESSIONS_CASES = 4
# Proof that the sessions overlapped, whichever one the host started first: after each case
# (its server still alive) a worker leaves a marker; a one-GPU server's first case then waits
# (two minutes at most) for a marker of the other session. Only one-GPU servers wait: with one
# GPU held, the other session's servers still fit in the three left, so nobody waits forever.
BARRIER_CONFTEST = """
import os
import time
from pathlib import Path

import pytest

waited = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    global waited
    here = Path(str(item.config.rootpath))
    (here / f"served-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}").touch()
    if waited or "-tp1::" not in item.nodeid:
        return
    waited = True
    other = here.parent / ("second" if here.name == "first" else "first")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(other.glob("served-*")):
        time.sleep(0.05)
"""


@dataclass(frozen=True)
class Lifetime:
    session: str
    worker: str
    server_key: str
    started: float
    stopped: float
    gpus: frozenset[str]
    port: int


def lifetimes(records: list[dict[str, Any]]) -> list[Lifetime]:
    """One entry per server start, from its cases' records (they agree on it)."""
    found: dict[tuple[Any, ...], Lifetime] = {}
    for record in records:
        runtime = record["runtime"]
        assert runtime["server_stopped_at"] is not None, record["case_id"]
        lifetime = Lifetime(
            record["session_id"],
            runtime["worker"],
            runtime["server_key"],
            runtime["server_started_at"],
            runtime["server_stopped_at"],
            frozenset(runtime["gpus"]),
            runtime["port"],
        )
        key = (lifetime.session, lifetime.worker, lifetime.server_key, lifetime.started)
        assert found.setdefault(key, lifetime) == lifetime
    return list(found.values())


def collisions(servers: list[Lifetime]) -> list[tuple[Lifetime, Lifetime]]:
    """Pairs of servers alive at the same time that shared a GPU or a port."""
    clashes = []
    for i, first in enumerate(servers):
        for second in servers[i + 1 :]:
            overlap = first.started < second.stopped and second.started < first.stopped
            if overlap and (first.gpus & second.gpus or first.port == second.port):
                clashes.append((first, second))
    return clashes


def test_collisions_sees_a_shared_gpu_or_port_only_when_lifetimes_overlap() -> None:
    def server(started: float, stopped: float, gpus: set[str], port: int) -> Lifetime:
        return Lifetime("s", "gw0", f"k{started}", started, stopped, frozenset(gpus), port)

    assert collisions([server(0, 10, {"0"}, 100), server(5, 15, {"0", "1"}, 110)])
    assert collisions([server(0, 10, {"0"}, 100), server(5, 15, {"1"}, 100)])
    assert not collisions([server(0, 10, {"0"}, 100), server(5, 15, {"1"}, 110)])
    assert not collisions([server(0, 10, {"0"}, 100), server(10, 15, {"0"}, 100)])


def pytest_command(ports: str, out: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:hypothesispytest",  # as in helpers.suite_args
        f"--profllm-ports={ports}",
        f"--profllm-out={out}",
        "--profllm-gpus=4",
        "--profllm-lease-timeout=240",
        # The loads' host cores are a lease of their own (tests/test_load_cores.py): on a
        # 2-core host they queue every load behind the other worker's, and these runs are
        # about GPUs, ports and server starts.
        "--profllm-no-load-cores",
        *args,
    ]


def assert_all_passed_without_collisions(
    records: list[dict[str, Any]], sessions: int, configurations: int = SERVERS,
    cases: int = CASES,
) -> None:
    assert len(records) == cases * sessions
    assert {r["status"] for r in records} == {"passed"}
    servers = lifetimes(records)
    # One start per server configuration in each session, on one worker.
    assert len(servers) == configurations * sessions
    assert len({(s.session, s.server_key) for s in servers}) == configurations * sessions
    assert not collisions(servers), collisions(servers)
    for server in servers:
        assert len(server.gpus) in (1, 2, 4)
    # The pool has four GPUs, so tp 4 servers never overlap with any other server.
    for big in (s for s in servers if len(s.gpus) == 4):
        assert not [
            s
            for s in servers
            if s is not big and s.started < big.stopped and big.started < s.stopped
        ]


def test_four_workers_share_four_gpus_without_collisions(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_mixed=MIXED_TP_SUITE)
    result = pytester.run(*pytest_command(ports, "results", "-n", "4"), timeout=400)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines([f"{SERVERS} server start(s) on * worker(s)*", f"*{CASES} passed*"])
    records = run_records(pytester)
    assert_all_passed_without_collisions(records, sessions=1)
    # Each server's cases ran back to back on the worker that started it.
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["timestamp"]):
        by_worker.setdefault(record["runtime"]["worker"], []).append(record)
    for cases in by_worker.values():
        keys = [r["runtime"]["server_key"] for r in cases]
        runs = [key for i, key in enumerate(keys) if i == 0 or keys[i - 1] != key]
        assert len(runs) == len(set(runs)), keys


def test_two_sessions_at_once_on_one_host_share_nothing(
    pytester: pytest.Pytester, ports: str
) -> None:
    # Both sessions lease from the same host-wide pool folder (PROFLLM_POOL_DIR of the tests).
    for name in ("first", "second"):
        (pytester.path / name).mkdir()
        (pytester.path / name / "bench_mixed.yaml").write_text(TWO_SESSIONS_SUITE)
        (pytester.path / name / "conftest.py").write_text(BARRIER_CONFTEST)
    runs = [
        subprocess.Popen(
            pytest_command(ports, "results", "-n", "2"),
            cwd=pytester.path / name,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        for name in ("first", "second")
    ]
    outputs = []
    try:
        for run in runs:
            outputs.append(run.communicate(timeout=500)[0].decode())
    finally:
        for run in runs:
            run.kill()
            run.wait()
    assert [run.returncode for run in runs] == [0, 0], outputs
    records = run_records(pytester, "first/results") + run_records(pytester, "second/results")
    assert len({r["session_id"] for r in records}) == 2
    assert_all_passed_without_collisions(
        records, sessions=2, configurations=TWO_SESSIONS_SERVERS, cases=TWO_SESSIONS_CASES)
    # The two sessions really ran at the same time: some servers of one were alive while
    # servers of the other were (else this would prove nothing about sharing).
    servers = lifetimes(records)
    first = [s for s in servers if s.session == records[0]["session_id"]]
    second = [s for s in servers if s.session != records[0]["session_id"]]
    assert max(s.stopped for s in first) > min(s.started for s in second)
    assert max(s.stopped for s in second) > min(s.started for s in first)


# The victim case's worker writes the lease its server holds, then SIGKILLs itself, once.
KILLER_CONFTEST = """
import json, os, signal
from pathlib import Path

import pytest

from pytest_profllm.session.worker import WORKER_KEY


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    flag = Path(item.config.rootpath) / "victim.json"
    if "victim" in item.nodeid and not flag.exists():
        current = item.config.stash[WORKER_KEY].servers.current
        flag.write_text(json.dumps({
            "gpus": list(current.lease.gpus),
            "port": current.lease.port,
            "server_pid": current._process.pid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        }))
        os.kill(os.getpid(), signal.SIGKILL)
    return result
"""


def test_killed_worker_frees_its_gpus_and_ports_for_the_next_server(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(KILLER_CONFTEST)
    # One GPU and one port block: the next server can only start if the dead worker's lease
    # was freed at once.
    pytester.makefile(
        ".yaml",
        bench_victim="server:\n  model: sim-victim\n"
        "benchmark:\n  num_prompts: 2\n  random_input_len: 8\n  random_output_len: [2, 3, 4]\n",
        bench_after="server:\n  model: sim-after\n"
        "benchmark:\n  num_prompts: 2\n  random_input_len: 8\n  random_output_len: [2, 3]\n",
    )
    low = int(ports.split("-")[0])
    started = time.monotonic()
    result = pytester.run(
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--profllm-ports={low}-{low + 9}",
        "--profllm-out=results",
        "--profllm-gpus=1",
        "--profllm-lease-timeout=60",
        "-n",
        "2",
        timeout=300,
    )
    output = result.stdout.str()
    victim = json.loads((pytester.path / "victim.json").read_text())
    # xdist reports the case whose worker died, replaces the worker, and the run goes on.
    result.stdout.fnmatch_lines([f"*worker '{victim['worker']}' crashed while running*victim*"])
    written = run_records(pytester)
    after = [r for r in written if "bench_after" in r["case_id"]]
    assert [r["status"] for r in after] == ["passed", "passed"], output
    # The crashed case has its record, `error` with the reason, written and loaded.
    victim_case = "bench_victim.yaml::sim-victim::random-out2"
    (crashed,) = [r for r in written if r["case_id"] == victim_case]
    assert crashed["status"] == "error"
    assert crashed["message"] == (
        f"worker '{victim['worker']}' crashed while running '{victim_case}'"
    )
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = db.execute("select run_id, status from benchmark_runs").fetchall()
    assert sorted(rows) == sorted((r["run_id"], r["status"]) for r in written)
    # The rest of the victim's server cases ran on a new server, after the crash.
    rest = [r for r in written if "bench_victim" in r["case_id"] and r is not crashed]
    assert len(rest) == 2 and {r["status"] for r in rest} == {"passed"}, output
    for record in after + rest:
        assert record["runtime"]["gpus"] == victim["gpus"]
        assert record["runtime"]["port"] == victim["port"]
    assert time.monotonic() - started < 240
    # The killed worker's server died with it.
    assert not _alive(victim["server_pid"])
    # The summary counts the servers it saw (the crashed case's record was built before its
    # server started) and says which worker's it could not count.
    result.stdout.fnmatch_lines([
        f"* server start(s) on * worker(s)*; not counted: any server crashed worker(s) "
        f"{victim['worker']} started in the case they crashed in"
    ])


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


MARKED_TESTS = """
import pytest

SMALL = dict(num_prompts=2, random_input_len=8, random_output_len=2)
BOTH = pytest.mark.profllm(
    server=dict(model="sim-shared", max_num_seqs=[4, 8]), benchmark=SMALL
)

@BOTH
def test_first(profllm_result):
    assert profllm_result.results["completed"] == 2

def test_plain_in_between():
    pass

@BOTH
def test_second(profllm_result):
    assert profllm_result.results["completed"] == 2
"""


@pytest.mark.parametrize(
    "mode", [["-p", "no:xdist"], ["-n", "2"], ["-n", "2", "--dist", "loadscope"]]
)
def test_marked_tests_of_one_server_share_one_start(
    pytester: pytest.Pytester, ports: str, mode: list[str]
) -> None:
    # Two test functions in two modules use the same two server configurations, interleaved
    # in collection order: each configuration still starts once.
    pytester.makepyfile(test_a=MARKED_TESTS, test_b=MARKED_TESTS)
    result = pytester.run(*pytest_command(ports, "results", *mode), timeout=300)
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=10)
    servers = lifetimes(run_records(pytester))
    assert len(servers) == 2, servers
    assert not collisions(servers)
