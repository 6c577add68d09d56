"""Faults as users hit them, on the simulated engine: a server that dies mid-case, a port
someone else holds, SIGTERM, a read-only folder, a full disk, a locked database, secrets in
pytest's reprs. Each ends in one clear line, with every record on disk also in the database,
no server of ours left running and no lease left held."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import pytest

from pytest_profllm.metrics import RequestOutcome, served_problem
from pytest_profllm.pool import PORT_BLOCK, Lease
from pytest_profllm.server import PortTaken, ServerProcess

SMALL = "benchmark:\n  num_prompts: 2\n  random_input_len: 8\n  random_output_len: [2, 3, 4]\n"


def run(pytester: pytest.Pytester, ports: str, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        "--profllm-gpus=4",
        "--profllm-max-schedule-lag=1000",
        *args,
        timeout=300,
    )


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]


def assert_records_are_rows(out: Path, db: Path | None = None) -> list[dict[str, Any]]:
    """Every record on disk is a row of the database, and nothing else is."""
    written = records(out)
    with sqlite3.connect(db or out / "results.db") as connection:
        rows = connection.execute("select run_id, status from benchmark_runs").fetchall()
    assert sorted(rows) == sorted((r["run_id"], r["status"]) for r in written)
    return written


def assert_no_lease_left(ports: str, pool: Path | None = None) -> None:
    """Every port block of the range can be locked: nobody holds a lease on it."""
    low, high = (int(p) for p in ports.split("-"))
    directory = pool or Path(os.environ["PROFLLM_POOL_DIR"])
    for block in range(low, high - PORT_BLOCK + 2, PORT_BLOCK):
        lock = filelock.FileLock(directory / f"port-{block}.lock", thread_local=False)
        lock.acquire(timeout=0)  # raises filelock.Timeout where a lease is still held
        lock.release(force=True)


# --- 1: a server that dies mid-case --------------------------------------------------------

# The first measured run SIGKILLs its server 0.4 s in, while requests are under way.
KILL_MID_CASE = """
import asyncio, os, signal
from urllib.parse import urlparse

import pytest_profllm.runner as runner
from pytest_profllm.server import listening_pids

real_run_load = runner.run_load
killed = []


async def run_load_then_kill(settings, prompts):
    if not killed:
        killed.append(True)
        (pid,) = listening_pids(urlparse(settings.base_url).port)
        asyncio.get_running_loop().call_later(0.4, os.kill, pid, signal.SIGKILL)
    return await real_run_load(settings, prompts)


runner.run_load = run_load_then_kill
"""


def test_server_killed_mid_case_fails_it_as_error_and_the_next_case_restarts(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(KILL_MID_CASE)
    pytester.makefile(
        ".yaml",
        bench_dies="server:\n  model: sim-dies\nbenchmark:\n  num_prompts: 16\n"
        "  request_rate: 10\n  random_input_len: 8\n  random_output_len: [4, 5]\n",
    )
    result = run(pytester, ports)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*bench_dies.yaml::sim-dies::random-out4: server sim-dies (sim, port *) died during "
            "the case: killed by signal 9 (SIGKILL); its measurement does not count; log: *",
            "*--- last 50 log lines ---*",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    first, second = assert_records_are_rows(pytester.path / "results")
    first, second = sorted((first, second), key=lambda r: r["case_id"])
    assert first["status"] == "error"
    assert first["results"] == {}  # nothing measured counts
    assert first["message"].startswith(
        "bench_dies.yaml::sim-dies::random-out4: server sim-dies (sim, port "
    )
    assert "died during the case: killed by signal 9 (SIGKILL)" in first["message"]
    # The dead server's end is in its record; the next case's server says why it started.
    assert first["runtime"]["server_stopped_at"] is not None
    assert first["runtime"]["server_stop_problems"] == [
        "died during the case: killed by signal 9 (SIGKILL)"
    ]
    assert second["status"] == "passed"
    assert second["runtime"]["server_restart_reason"] == (
        "its server died during the case: killed by signal 9 (SIGKILL)"
    )
    assert second["runtime"]["server_pid"] != first["runtime"]["server_pid"]
    assert_no_lease_left(ports)


def test_requests_without_a_response_fail_the_case() -> None:
    answered = [RequestOutcome(8, success=True, output_tokens=4, status=200) for _ in range(3)]
    refused = RequestOutcome(8, error="ClientConnectorError: Connect call failed")
    cut = RequestOutcome(8, error="ServerDisconnectedError: Server disconnected")
    problem = served_problem([*answered, refused, cut], {"completed": 3, "total_output_tokens": 12})
    assert problem == (
        "2 of 5 requests got no response (connection refused, reset or closed); first errors: "
        "ClientConnectorError: Connect call failed; ServerDisconnectedError: Server disconnected"
    )


# --- 2: a port that is not ours ----------------------------------------------------------------

# Answers 200 to everything: a stranger's server on the port, as healthy as ours would be.
FOREIGN_SERVER = """
import http.server, sys
class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[2], "a") as seen:
            seen.write(self.path + "\\n")
        self.send_response(200)
        self.end_headers()
    do_POST = do_GET
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Healthy).serve_forever()
"""


def start_foreign_server(port: int, seen: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", FOREIGN_SERVER, str(port), str(seen)])
    deadline = time.monotonic() + 20
    while not _listening(port):
        assert process.poll() is None and time.monotonic() < deadline, "foreign server failed"
        time.sleep(0.05)
    return process


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def foreign(port_range: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A stranger's healthy HTTP server on the first port of the range, reaped afterwards."""
    port = int(port_range.split("-")[0])
    seen = tmp_path / "foreign-requests.txt"
    process = start_foreign_server(port, seen)
    try:
        yield port, seen
    finally:
        process.kill()
        process.wait()


def test_a_server_is_not_ready_when_another_process_answers_on_its_port(
    foreign: tuple[int, Path], tmp_path: Path
) -> None:
    port, _ = foreign
    server = ServerProcess(
        key="k",
        label="sim-late",
        engine="sim",
        argv=[sys.executable, "-m", "pytest_profllm.sim", "sim-late", "--port", str(port)],
        env={},
        log_path=tmp_path / "server.log",
        lease=Lease(("0",), (), port, port + 1, 0.0),
    )
    server.start()
    try:
        with pytest.raises(PortTaken) as caught:
            server.wait_ready(60)
    finally:
        server.stop(grace=5)
    first_line = str(caught.value).splitlines()[0]
    assert re.fullmatch(
        rf"server sim-late \(sim, port {port}, GPUs 0\) ("
        rf"found port {port} held by another process \(pid \d+: .*\), not by this server"
        r"|exited with code 1 during start-up \(likely cause: port already in use\)"
        r"); log: .*",
        first_line,
    ), first_line
    assert server.ready_at is None
    assert not server.alive()


# Between the lease's check and the server's bind, a stranger takes the port (once).
TAKE_PORT_AT_START = """
import subprocess, sys, time, socket
from pathlib import Path

import pytest_profllm.server as server

real_start = server.ServerProcess.start


def start_after_a_stranger(self):
    flag = Path("stranger.pid")
    if not flag.exists():
        stranger = subprocess.Popen(
            [sys.executable, "-c", Path("foreign.py").read_text(), str(self.lease.port),
             "foreign-requests.txt"]
        )
        flag.write_text(str(stranger.pid))
        while socket.socket().connect_ex(("127.0.0.1", self.lease.port)) != 0:
            time.sleep(0.05)
    real_start(self)


server.ServerProcess.start = start_after_a_stranger
"""


def test_a_port_taken_after_the_lease_is_never_measured(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(TAKE_PORT_AT_START)
    (pytester.path / "foreign.py").write_text(FOREIGN_SERVER)
    pytester.makefile(".yaml", bench_taken="server:\n  model: sim-taken\n" + SMALL)
    try:
        result = run(pytester, ports, "-W", "always")
    finally:
        stranger = int((pytester.path / "stranger.pid").read_text())
        os.kill(stranger, signal.SIGKILL)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["*PortTakenWarning: server sim-taken * starting again on another port"]
    )
    taken = int(ports.split("-")[0])
    written = assert_records_are_rows(pytester.path / "results")
    assert {r["runtime"]["port"] for r in written} == {taken + PORT_BLOCK}
    # The stranger saw our /health probe at most, never a benchmark request.
    seen = (pytester.path / "foreign-requests.txt").read_text().split()
    assert set(seen) <= {"/health"}, seen
    assert_no_lease_left(ports)


# Two users on one host, each with a pool folder of their own: their leases do not see each
# other, so only the ownership checks keep each case on its own server.
TWO_USERS_SUITE = """
server:
  model: sim-shared
  max_num_seqs: [4, 8, 16]
benchmark:
  num_prompts: 2
  random_input_len: 8
  random_output_len: [2, 3]
"""


def test_two_sessions_with_their_own_pool_folders_never_measure_each_others_servers(
    pytester: pytest.Pytester, ports: str
) -> None:
    names = ("first", "second")
    for name in names:
        (pytester.path / name).mkdir()
        (pytester.path / name / "bench_shared.yaml").write_text(TWO_USERS_SUITE)
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-n",
                "2",
                "-W",
                "always",
                f"--profllm-ports={ports}",
                "--profllm-out=results",
                "--profllm-gpus=4",
                "--profllm-max-schedule-lag=1000",
            ],
            cwd=pytester.path / name,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PROFLLM_POOL_DIR": str(pytester.path / f"pool-{name}")},
        )
        for name in names
    ]
    try:
        outputs = [run.communicate(timeout=500)[0].decode() for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    assert [run.returncode for run in runs] == [0, 0], outputs
    measured: list[tuple[str, dict[str, Any]]] = []
    for name in names:
        out = pytester.path / name / "results"
        measured += [(name, record) for record in assert_records_are_rows(out)]
    assert len(measured) == 12 and {r["status"] for _, r in measured} == {"passed"}
    # Whose server each case measured: the process it names must have logged binding its
    # port in this session's logs, and no server of the other session may have been alive on
    # that port at the same time.
    not_own = [
        record["case_id"]
        for name, record in measured
        if not _bound_by(pytester.path / name / "results" / "logs", record["runtime"])
        or any(
            _overlap(record["runtime"], other["runtime"])
            for other_name, other in measured
            if other_name != name
        )
    ]
    retries = sum(output.count("starting again on another port") for output in outputs)
    print(
        f"{len(measured)} cases; {len(not_own)} measured a server not their own; "
        f"{retries} server start(s) found their port taken and started again"
    )
    assert not_own == []
    for name in names:
        assert_no_lease_left(ports, pytester.path / f"pool-{name}")


def _bound_by(logs: Path, runtime: dict[str, Any]) -> bool:
    line = f"on http://127.0.0.1:{runtime['port']} (pid {runtime['server_pid']})"
    return any(line in log.read_text() for log in logs.glob("*.log"))


def _overlap(one: dict[str, Any], other: dict[str, Any]) -> bool:
    return bool(
        one["port"] == other["port"]
        and one["server_started_at"] < other["server_stopped_at"]
        and other["server_started_at"] < one["server_stopped_at"]
    )


# --- 3: SIGTERM ------------------------------------------------------------------------------


def test_sigterm_stops_the_session_as_ctrl_c_does(
    pytester: pytest.Pytester, ports: str, tmp_path: Path
) -> None:
    pytester.makefile(
        ".yaml",
        bench_quick="server:\n  model: sim-quick\nbenchmark:\n  num_prompts: 2\n"
        "  random_input_len: 8\n  random_output_len: 2\n",
        # Eight requests a second apart: still running when SIGTERM comes.
        bench_slow="server:\n  model: sim-slow\nbenchmark:\n  num_prompts: 8\n"
        "  request_rate: 1\n  random_input_len: 8\n  random_output_len: [2, 3]\n",
    )
    temp = tmp_path / "tmp"  # where the session's scope folder goes
    temp.mkdir()
    controller = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            f"--profllm-ports={ports}",
            "--profllm-out=results",
            "--profllm-gpus=4",
            "--profllm-max-schedule-lag=1000",
        ],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    try:
        out = pytester.path / "results"
        deadline = time.monotonic() + 120
        while not (list(out.glob("*.json")) and _slow_case_running(out)):
            assert controller.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)
        controller.send_signal(signal.SIGTERM)
        output = controller.communicate(timeout=120)[0].decode()
    finally:
        controller.kill()
        controller.wait()
    assert controller.returncode == pytest.ExitCode.INTERRUPTED, output
    for line in (
        "profllm: SIGTERM received: stopping as on Ctrl-C (finished records are written and "
        "loaded, servers stopped, leases released)",
        "profllm benchmark results",
        "interrupted by SIGTERM: every case that finished has its record; cases cut short are "
        "`error`",
    ):
        assert line in output, output
    assert "Traceback" not in output, output
    written = {r["case_id"]: r for r in assert_records_are_rows(out)}
    assert written["bench_quick.yaml::sim-quick::random"]["status"] == "passed"
    cut = written["bench_slow.yaml::sim-slow::random-out2"]
    assert cut["status"] == "error"
    assert cut["message"] == "interrupted by SIGTERM before the case finished"
    assert "bench_slow.yaml::sim-slow::random-out3" not in written  # never started
    assert_no_lease_left(ports)
    session_id = cut["session_id"]
    assert not (Path(os.environ["PROFLLM_POOL_DIR"]) / "turns" / session_id).exists()
    assert not list(temp.glob("profllm-scopes-*"))


def _slow_case_running(out: Path) -> bool:
    return any(
        "Starting vLLM API server" in log.read_text() for log in out.glob("logs/*sim-slow*.log")
    )
