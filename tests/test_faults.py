"""Faults as users hit them, on the simulated engine: a server that dies mid-case, a port
someone else holds, SIGTERM, a read-only folder, a full disk, a locked database, secrets in
pytest's reprs. Each ends in one clear line, with every record on disk also in the database,
no server of ours left running and no lease left held."""

from __future__ import annotations

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
from helpers import pytest_argv, records, run_suites

from pytest_profllm.hosts.pool import PORT_BLOCK, Lease
from pytest_profllm.load.metrics import RequestOutcome, served_problem
from pytest_profllm.server.process import PortTaken, ServerProcess

SMALL = "benchmark:\n  num_prompts: 2\n  random_input_len: 8\n  random_output_len: [2, 3, 4]\n"


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

import pytest_profllm.run.serve as runner
from pytest_profllm.server.process import listening_pids

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
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "server sim-dies (sim, port *) died during "
            "the case: killed by signal 9 (SIGKILL); its measurement does not count; log: *",
            "*--- last 50 log lines ---*",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    first, second = assert_records_are_rows(pytester.path / "results")
    first, second = sorted((first, second), key=lambda r: r["case_id"])
    assert first["status"] == "error"
    assert first["results"] == {}  # nothing measured counts
    assert first["message"].startswith("server sim-dies (sim, port ")
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
        "2 of 5 requests failed (2 got no response (connection refused, reset or closed); none "
        "allowed: thresholds: {failed: {max: N}}); first errors: "
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


def start_foreign_server(port: int, seen: Path) -> subprocess.Popen[bytes] | None:
    """The stranger's server on `port`; None where it could not bind it (another process
    holds the port)."""
    process = subprocess.Popen([sys.executable, "-c", FOREIGN_SERVER, str(port), str(seen)],
                               stderr=subprocess.DEVNULL)
    # A minute: a Python start on a host others keep busy has taken seconds.
    deadline = time.monotonic() + 60
    while not _listening(port):
        if process.poll() is not None:
            return None
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"the foreign server did not listen on {port} within 60 s")
        time.sleep(0.05)
    return process


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def foreign(port_range: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A stranger's healthy HTTP server on the first free port of the range, reaped
    afterwards."""
    # The first port of the range a stranger can take: a process of an earlier test of this
    # worker, given the same range, may still hold the first (a setup error once, on a busy host).
    first = int(port_range.split("-")[0])
    seen = tmp_path / "foreign-requests.txt"
    for port in range(first, first + 10):
        if (process := start_foreign_server(port, seen)) is not None:
            break
    else:
        raise AssertionError(f"no port of {first}-{first + 9} was free for the foreign server")
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

import pytest_profllm.server.process as server

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
        result = run_suites(pytester, ports, "-W", "always")
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
            pytest_argv(ports, "-n", "2", "-W", "always", cache=False),
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
    # port in this session's logs, and no server of the other session may have been in use
    # (ready, not yet stopped) on that port at the same time: one port, one listener.
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
    # From ready to stopped: the time a server is measured. (From its start it may overlap
    # the end of the port's last server, which had closed its listener but not yet exited.)
    return bool(
        one["port"] == other["port"]
        and one["server_ready_at"] < other["server_stopped_at"]
        and other["server_ready_at"] < one["server_stopped_at"]
    )


# --- 3: SIGTERM ------------------------------------------------------------------------------


@pytest.mark.parametrize("xdist", [["-n", "2"], ["-p", "no:xdist"]], ids=["xdist", "serial"])
def test_sigterm_stops_the_session_as_ctrl_c_does(
    pytester: pytest.Pytester, ports: str, tmp_path: Path, xdist: list[str]
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
        pytest_argv(ports, *xdist, cache=False),
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


# --- 4: writes that cannot fail the session ---------------------------------------------------


def private_mount(mount_point: Path, options: str, argv: list[str]) -> list[str]:
    """`argv` run with a tmpfs of its own at `mount_point` (a user and mount namespace: no
    privilege needed, nothing to undo, the mount ends with the command)."""
    script = 'mount -t tmpfs -o "$1" profllm-test "$2" && shift 2 && exec "$@"'
    return [
        "unshare", "--user", "--map-root-user", "--mount",
        "sh", "-c", script, "sh", options, str(mount_point), *argv,
    ]  # fmt: skip


@pytest.fixture
def mounts(tmp_path: Path) -> None:
    """Skips where this host cannot give a test a private tmpfs."""
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        done = subprocess.run(
            private_mount(probe, "size=64k", ["true"]), capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        pytest.skip("needs `unshare` (util-linux) and user namespaces to mount a small tmpfs")


@pytest.mark.usefixtures("mounts")
def test_a_read_only_out_folder_is_a_usage_error_before_anything_starts(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_ro="server:\n  model: sim-ro\n" + SMALL)
    read_only = pytester.path / "ro"
    read_only.mkdir()
    argv = pytest_argv(ports, out=str(read_only / "results"), cache=False)
    result = pytester.run(*private_mount(read_only, "ro,size=64k", argv), timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == (
        f"ERROR: --profllm-out: cannot write to {read_only / 'results'}: Read-only file system"
    )
    result.stdout.no_fnmatch_line("*bench_ro*")  # nothing ran


# After the first case's record is written, the disk fills up.
FILL_THE_DISK = """
import pytest

filled = []


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when == "teardown" and not filled:
        filled.append(True)
        with open("results/filler", "wb") as filler:
            try:
                while True:
                    filler.write(bytes(65536))
                    filler.flush()
            except OSError:
                pass
"""


@pytest.mark.usefixtures("mounts")
def test_a_full_disk_fails_the_cases_it_cannot_record_and_never_corrupts_the_database(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(FILL_THE_DISK)
    pytester.makefile(".yaml", bench_full="server:\n  model: sim-full\n" + SMALL)
    out = pytester.path / "results"
    out.mkdir()
    kept = pytester.path / "kept"  # what the full disk held, copied out before it goes
    # The run, then (on the same mount) the filler removed and everything copied out.
    argv = [
        "sh", "-c",
        'kept=$1; shift; "$@"; code=$?; rm -f "$0/filler"; cp -a "$0/." "$kept"; exit $code',
        str(out), str(kept),
        # The records are the point, not the server: the virtual clock writes the same ones.
        *pytest_argv(ports, "-p", "no:xdist", "--profllm-sim-clock=virtual", out=str(out),
                     cache=False),
    ]  # fmt: skip
    result = pytester.run(*private_mount(out, "size=4m", argv), timeout=300)
    # The two cases whose records could not be written fail, each clearly; all three ran.
    result.assert_outcomes(passed=3, errors=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    db = out / "results.db"
    result.stdout.fnmatch_lines(
        [
            f"bench_full.yaml::sim-full::random-out3: record not written to {out}: "
            "No space left on device",
            f"bench_full.yaml::sim-full::random-out4: record not written to {out}: "
            "No space left on device",
            f"profllm: {db}: database or disk is full: nothing loaded; 1 JSON record(s) are in "
            f"{out} (2 more could not be written: see their cases): load them with: "
            f"profllm ingest {db} {out}",
        ]
    )
    result.stdout.fnmatch_lines([f"1 record(s) in {out} (2 could not be written)"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    result.stdout.no_fnmatch_line("*Traceback*")
    # The database the full disk left is sound (or absent), and the command the line gives
    # loads the records that were written.
    (record,) = records(kept)
    assert record["case_id"] == "bench_full.yaml::sim-full::random-out2"
    kept_db = kept / "results.db"
    if kept_db.exists():
        with sqlite3.connect(kept_db) as connection:
            assert connection.execute("pragma integrity_check").fetchall() == [("ok",)]
    ingest = subprocess.run(
        [sys.executable, "-m", "pytest_profllm.cli", "ingest", str(kept_db), str(kept)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ingest.returncode == 0, ingest.stderr
    assert_records_are_rows(kept, kept_db)


def test_a_failed_database_load_leaves_the_database_as_it_was(tmp_path: Path) -> None:
    from pytest_profllm.results.store import load_records

    db = tmp_path / "results.db"
    load_records(db, [_record("before")])
    with sqlite3.connect(db) as connection:
        connection.execute(
            "create trigger full before insert on benchmark_runs "
            "begin select raise(abort, 'database or disk is full'); end"
        )
    with pytest.raises(sqlite3.IntegrityError, match="database or disk is full"):
        load_records(db, [_record("after-1"), _record("after-2")])
    with sqlite3.connect(db) as connection:
        assert connection.execute("pragma integrity_check").fetchall() == [("ok",)]
        assert connection.execute("select run_id from benchmark_runs").fetchall() == [("before",)]


def _record(run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, "status": "passed", "results": {"completed": 1}}


# Holds the database's write lock for as long as the test says.
def test_a_locked_database_costs_the_load_not_the_session(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(
        "import pytest_profllm.session.controller as controller\ncontroller.DB_LOCK_WAIT_S = 1\n"
    )
    pytester.makefile(".yaml", bench_locked="server:\n  model: sim-locked\n" + SMALL)
    out = pytester.path / "results"
    out.mkdir()
    db = out / "results.db"
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("begin exclusive")
        # Under xdist the controller loads the records; the three cases share one server,
        # hence one worker: a second would start idle.
        result = run_suites(pytester, ports, "-n", "1")
    finally:
        holder.close()
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK  # every test passed: the load is not a test
    result.stdout.fnmatch_lines(
        [
            f"profllm: {db} is locked by another process; waiting up to 1 s to load 3 record(s)",
            f"profllm: {db}: still locked by another process after 1 s: nothing loaded; the 3 "
            f"JSON record(s) in {out} are complete: load them with: profllm ingest {db} {out}",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    ingest = subprocess.run(
        [sys.executable, "-m", "pytest_profllm.cli", "ingest", str(db), str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ingest.returncode == 0, ingest.stderr
    assert len(assert_records_are_rows(out)) == 3
    assert_no_lease_left(ports)


# --- 6: secrets in pytest's reprs --------------------------------------------------------------


def test_secrets_never_show_in_pytest_reprs_or_junit_xml(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makepyfile(
        test_secret="""
        import pytest

        # Up here, so that the test's own source in the traceback does not show them.
        SERVER = {"model": "sim-secret", "api_key": "sk-topsecret-1", "hf_token": "hf_topsecret"}

        @pytest.mark.profllm(
            server=SERVER,
            benchmark={"num_prompts": 2, "random_input_len": 8, "random_output_len": 2},
        )
        def test_fails(profllm_result):
            case = profllm_result.case
            server = profllm_result.server
            env = server.env
            assert profllm_result.results["completed"] == 99
        """
    )
    result = run_suites(pytester, ports, "-l", "-vv", "--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    # The locals were shown (pytest pretty-prints them over lines), their secrets as ***.
    shown = result.stdout.str()
    for secret in ("'api_key': '***'", "'hf_token': '***'", "'VLLM_API_KEY': '***'"):
        assert secret in shown, secret
    result.stdout.fnmatch_lines(["env * = {*'HF_TOKEN': '***'*"])
    junit = (pytester.path / "junit.xml").read_text()
    assert "VLLM_API_KEY" in junit
    assert "topsecret" not in result.stdout.str() + result.stderr.str()
    assert "topsecret" not in junit
