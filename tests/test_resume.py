"""`--profllm-resume`: a campaign cut short by SIGKILL is finished by the same command with
`--profllm-resume`; no finished case runs twice, and the database ends with every case."""

from __future__ import annotations

import collections
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import pytest_argv, records

from pytest_profllm.hosts.processes import OWNER_ENV

# Four cases of one server, 0.6 s or so each (the three after the first take well over the
# 50 ms poll that sees the first one end): the session is killed between them.
SUITE = """
server:
  model: Qwen/Qwen3-0.6B
benchmark:
  num_prompts: 12
  random_input_len: 16
  random_output_len: [8, 9, 10, 11]
  request_rate: 20
"""


def _db_cases(out: Path) -> set[str]:
    with sqlite3.connect(out / "results.db") as db:
        return {row[0] for row in db.execute("select nodeid from benchmark_runs")}


def _owned_by(token: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(OWNER_ENV) == token:
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def test_a_killed_campaign_is_finished_by_resume(
    pytester: pytest.Pytester, ports: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytester.makefile(".yaml", bench_resume=SUITE)
    # A pool of its own: the killed session's leftovers are this test's to sweep.
    env = {**os.environ, "PROFLLM_POOL_DIR": str(tmp_path_factory.mktemp("pool"))}
    env.pop(OWNER_ENV, None)
    argv = pytest_argv(ports, "-rs", cache=False)
    out = pytester.path / "results"
    killed = subprocess.Popen(
        argv, cwd=pytester.path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    token = ""
    try:
        token = f"{killed.pid}:{psutil.Process(killed.pid).create_time():.2f}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(out.glob("*.requests.jsonl.gz")):
            time.sleep(0.05)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        before = records(out)
        assert 1 <= len(before) < 4, "the session was not killed mid-way"
        assert not (out / "results.db").exists()  # SIGKILL: nothing loaded

        def resume() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*argv, "--profllm-resume"], cwd=pytester.path, env=env, capture_output=True,
                text=True, timeout=180, check=False,
            )

        finished = resume()
        assert finished.returncode == 0, finished.stdout[-3000:]
        for record in before:
            assert f"already measured in {record['run_id']}" in finished.stdout
        assert f"{len(before)} case(s) resumed" in finished.stdout
        after = records(out)
        # Each case ran exactly once over both sessions: one record each, all measured.
        runs = collections.Counter(record["nodeid"] for record in after)
        assert len(runs) == 4 and set(runs.values()) == {1}, runs
        assert {record["status"] for record in after} == {"passed"}
        assert len({record["session_id"] for record in after}) == 2
        assert _db_cases(out) == set(runs)

        # Once all are measured, a resume starts no server and writes no record.
        again = resume()
        assert again.returncode == 0, again.stdout[-3000:]
        assert "4 skipped" in again.stdout and "4 case(s) resumed" in again.stdout
        assert "server start(s)" not in again.stdout
        assert len(records(out)) == 4
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait(10)
        for process in _owned_by(token) if token else []:
            process.kill()

    # An uninterrupted run of the same suite has the same cases in its database (the cases
    # are the suite's, whatever the clock: the virtual one runs them without a server).
    whole = subprocess.run(
        pytest_argv(ports, "--profllm-sim-clock=virtual", out="whole", cache=False),
        cwd=pytester.path, env=env,
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert whole.returncode == 0, whole.stdout[-3000:]
    assert _db_cases(pytester.path / "whole") == _db_cases(out)


def test_resume_needs_an_out_folder(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--profllm-resume", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--profllm-resume reads the records of earlier sessions*"])


def test_only_valid_measured_records_count(tmp_path: Path) -> None:
    from pytest_profllm.results.record_files import write_record
    from pytest_profllm.session.resume import read_index

    base = {
        "schema_version": 1, "session_id": "s", "suite": "x", "source": "bench_x.yaml",
        "case_id": "c", "nodeid": "n", "timestamp": "2026-11-24T00:00:00+00:00",
        "duration": 1.0, "engine": {"name": "sim", "reason": "test"},
        "config": {"server": {"model": "m"}, "benchmark": {"num_prompts": 1}},
        "system": {"host": "h", "platform": "p", "python": "3.11"},
        "runtime": {"worker": "main", "server_key": "k"},
    }
    measured = {"completed": 1, "failed": 0}
    for run_id, status, results in [
        ("ok", "passed", measured), ("missed", "failed", measured), ("err", "error", {}),
        ("bad", "invalid", measured), ("skip", "skipped", {}), ("none", "passed", {}),
    ]:
        write_record(tmp_path, {**base, "run_id": run_id, "status": status, "results": results})
    (tmp_path / "summary.json").write_text("{}")  # not a record: passed over
    assert set(read_index(tmp_path).records) == {"ok", "missed"}


ONE_CASE = """
server:
  model: sim-8b
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
  request_rate: 20
thresholds:
  completed: {min: MIN}
"""


def test_a_resumed_case_is_judged_by_the_suite_as_it_is_now(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_rs=ONE_CASE.replace("MIN", "1"))
    argv = pytest_argv(ports, "-rA", cache=False)

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *extra], cwd=pytester.path, capture_output=True,
                              text=True, timeout=120, check=False)

    first = run()
    assert first.returncode == 0, first.stdout[-3000:]
    (measured,) = records(pytester.path / "results")

    # A threshold raised out of reach: the earlier figures now fail it, without a new run.
    pytester.makefile(".yaml", bench_rs=ONE_CASE.replace("MIN", "1000000"))
    raised = run("--profllm-resume")
    assert raised.returncode == 1, raised.stdout[-3000:]
    assert (
        f"already measured in {measured['run_id']}: completed = 4 < min 1e+06 (threshold "
        "missed), judged by the suite's current thresholds" in raised.stdout
    ), raised.stdout[-3000:]
    assert "server start(s)" not in raised.stdout
    (record,) = records(pytester.path / "results")
    assert record["run_id"] == measured["run_id"] and record["status"] == "failed"
    assert record["thresholds"] == {"completed": {"min": 1000000.0, "max": None}}
    assert [v["passed"] for v in record["threshold_results"]] == [False]
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        assert db.execute("select status from benchmark_runs").fetchall() == [("failed",)]

    # Back within reach: resumed, skipped, passing.
    pytester.makefile(".yaml", bench_rs=ONE_CASE.replace("MIN", "1"))
    lowered = run("--profllm-resume")
    assert lowered.returncode == 0 and "1 skipped" in lowered.stdout, lowered.stdout[-3000:]

    # Another suite of the same server and workload has records of its own.
    pytester.makefile(".yaml", bench_other=ONE_CASE.replace("MIN", "1"))
    other = run("--profllm-resume")
    assert other.returncode == 0, other.stdout[-3000:]
    assert "1 passed" in other.stdout and "1 skipped" in other.stdout, other.stdout[-3000:]
    assert {r["suite"] for r in records(pytester.path / "results")} == {"rs", "other"}
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        suites = {row[0] for row in db.execute("select suite from benchmark_runs")}
    assert suites == {"rs", "other"}

def test_a_deep_file_in_the_out_folder_is_passed_over(tmp_path: Path) -> None:
    # Deeper than limits.py allows. Once: RecursionError, an INTERNALERROR of
    # `--profllm-resume`. A damaged file is not a record: its case runs again.
    from pytest_profllm.session.resume import read_index

    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "deep-value.json").write_text('{"run_id": ' + "[" * 5_000 + "]" * 5_000 + "}")
    assert read_index(tmp_path).records == {}
