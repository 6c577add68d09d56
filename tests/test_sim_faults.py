"""Faults on demand: what a user sees when a server fails each way vLLM's can.

One pytest run of a suite with one server per `seed` (an engine argument that changes nothing
else); `PROFLLM_SIM_FAULTS` in the run's environment gives each server its fault through an
`@seed=N` selector, so the run also shows that the other servers' cases are unaffected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import run_records

from pytest_profllm.sim.faults import Faults, FaultSpecError, parse_faults

FAULTS = {
    1: "exit_at_start",
    2: "slow_start=1.5",
    3: "never_healthy",
    4: "die_after=2",
    5: "error_rate=0.5",
    6: "stall_request=2",
    7: "close_request=2",
    8: "orphan_child",
}
SUITE = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [0, 1, 2, 3, 4, 5, 6, 7, 8]
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
  max_concurrency: 1
  request_timeout_s: 4
thresholds:
  failed: {max: 0}
"""


def _orphans() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "profllm sim orphan_child" in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture
def faulty_run(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[pytest.RunResult, dict[int, dict[str, Any]]]:
    before = {p.pid for p in _orphans()}
    spec = ",".join(f"{fault}@seed={seed}" for seed, fault in FAULTS.items())
    monkeypatch.setenv("PROFLLM_SIM_FAULTS", spec)
    pytester.makefile(".yaml", bench_faults=SUITE)
    try:
        result = pytester.runpytest_subprocess(
            f"--profllm-ports={ports}",
            "--profllm-out=results",
            # never_healthy's case lasts the whole timeout: 6 s still leaves the 1.5 s slow
            # starter (and a loaded host's ~0.5 s starts) far inside it.
            "--profllm-startup-timeout=6",
            # Two workers: a server's wait (the start-up timeout, a stalled stream's
            # 4 s, a slow start) overlaps the other servers' starts and cases.
            "-n",
            "2",
            "--profllm-max-schedule-lag=1000",
            "-W",
            "always::pytest_profllm.server.process.ServerStopWarning",
            timeout=300,
        )
    finally:
        left = [p for p in _orphans() if p.pid not in before]
        for process in left:
            process.kill()
    assert not left, "a server's orphan outlived the run"
    records = {r["config"]["server"]["seed"]: r for r in run_records(pytester)}
    return result, records


def test_each_fault_shows_the_user_a_clear_outcome(
    faulty_run: tuple[pytest.RunResult, dict[int, dict[str, Any]]],
) -> None:
    result, records = faulty_run
    out = result.stdout.str()
    assert sorted(records) == list(range(9)), "every case has a record"
    # The server without a fault, the slow starter and the orphan's server measure normally.
    for seed in (0, 2, 8):
        assert records[seed]["status"] == "passed", (seed, records[seed]["message"])
        assert records[seed]["results"]["completed"] == 4
    slow = records[2]["runtime"]
    assert slow["server_ready_at"] - slow["server_started_at"] >= 1.5
    # exit at start: vLLM's engine-core failure, named as the likely cause.
    assert records[1]["status"] == "error"
    assert "exited with code 1 during start-up" in records[1]["message"]
    assert "likely cause: out of GPU memory" in records[1]["message"]
    # never healthy: the start-up timeout, with the log's tail.
    assert records[3]["status"] == "error"
    assert "was not ready on /health within 6 s" in records[3]["message"]
    # dies after two requests: the case fails and says the server died.
    assert records[4]["status"] in ("failed", "error")
    assert records[4]["results"].get("completed", 0) <= 2
    # 500s, a stalled stream and a cut stream: failed requests, each case failed with why.
    for seed in (5, 6, 7):
        assert records[seed]["status"] == "failed", (seed, records[seed]["message"])
        assert records[seed]["message"]
    assert "500" in records[5]["message"]
    assert records[6]["results"]["failed"] >= 1
    assert records[7]["results"]["failed"] >= 1
    # The orphan was found and killed at stop, and said so.
    assert "outlived the server's process group and were killed" in out
    # One line per failure in the summary, no traceback for a condition we can name.
    assert "Traceback" not in out


def test_fault_specs_parse_and_select_by_argument() -> None:
    argv = ["Qwen/Qwen3-8B", "--max-num-seqs", "16", "--enable-prefix-caching"]
    assert parse_faults(["die_after=3@max_num_seqs=16"], argv) == Faults(die_after=3)
    assert parse_faults(["die_after=3@max_num_seqs=64"], argv) == Faults()
    assert parse_faults(["never_healthy@enable_prefix_caching=true"], argv).never_healthy
    assert parse_faults(["error_rate=0.25, slow_start=2"], argv) == Faults(
        error_rate=0.25, slow_start=2.0
    )
    assert parse_faults(["orphan_child@model=Qwen/Qwen3-8B"], argv).orphan_child
    assert not parse_faults([""], argv)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode", "unknown fault 'explode'; known faults: exit_at_start"),
        ("die_after=x", "fault 'die_after=x': expected a number"),
        ("error_rate=2", "error_rate is a fraction from 0 to 1"),
        ("never_healthy=1", "never_healthy takes no value"),
    ],
)
def test_bad_fault_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message.replace("(", r"\(")):
        parse_faults([spec], [])


def test_a_bad_fault_spec_stops_the_simulator_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pytest_profllm.sim", "m", "--sim-fault", "explode"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "argument --sim-fault: unknown fault 'explode'" in done.stderr
