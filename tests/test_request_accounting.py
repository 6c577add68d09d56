"""Every request is accounted for: a request completes only when its stream ends
normally with token counts that can be believed. A failed request fails its case unless the
suite allows it; counts the server made up make the measurement invalid. Shown on the
simulated engine, a real server process, with its faults on demand."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import records as records_in

from conftest import shared_ports, sim_processes
from pytest_profllm.sim.faults import FaultSpecError, parse_faults

Run = tuple[subprocess.CompletedProcess[str], dict[int, dict[str, Any]]]

FAULTS = {
    1: "close_request=3",
    2: "stall_request=3",
    3: "error_event=3",
    4: "junk_line=3",
    5: "usage_claims=100000",
    6: "usage_claims=-3",
    7: "usage_text",
    8: "short_stream=3",
    9: "close_request=3",  # in the suite that allows one failed request
}
STRICT = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [0, 1, 2, 3, 4, 5, 6, 7, 8]
benchmark:
  num_prompts: 6
  random_input_len: 16
  random_output_len: 8
  max_concurrency: 2
  request_timeout_s: 3
"""
TOLERANT = """
server:
  model: Qwen/Qwen3-0.6B
  seed: 9
benchmark:
  num_prompts: 6
  random_input_len: 16
  random_output_len: 8
  max_concurrency: 2
thresholds:
  failed: {max: 1}
"""


@pytest.fixture(scope="module")
def faulty_run(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, test_pool_dir: Path
) -> Iterator[tuple[subprocess.CompletedProcess[str], dict[int, dict[str, Any]]]]:
    """One pytest run of both suites for every test here (ten servers take a while)."""
    folder = tmp_path_factory.mktemp("accounting")
    (folder / "bench_strict.yaml").write_text(STRICT)
    (folder / "bench_tolerant.yaml").write_text(TOLERANT)
    ports = shared_ports("request_accounting", worker_id)
    spec = ",".join(f"{fault}@seed={seed}" for seed, fault in FAULTS.items())
    env = {**os.environ, "PROFLLM_SIM_FAULTS": spec, "PROFLLM_POOL_DIR": str(test_pool_dir)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
            f"--profllm-ports={ports}", "--profllm-out=results",
            "--profllm-max-schedule-lag=1000",
            # No host-core lease: on 2 cores it queues each worker's loads behind the other's,
            # and these runs are about the requests' accounting.
            "--profllm-no-load-cores"]
    try:
        done = subprocess.run(
            argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        leaked = sim_processes(ports)
        for process in leaked:
            process.kill()
    assert not leaked, "a server outlived the run"
    records = {r["config"]["server"]["seed"]: r for r in records_in(folder / "results")}
    yield done, records


def test_a_clean_stream_passes(faulty_run: Run) -> None:
    _, records = faulty_run
    assert records[0]["status"] == "passed", records[0]["message"]
    assert records[0]["results"]["completed"] == 6


@pytest.mark.parametrize(
    ("seed", "why"),
    [
        (1, "connection closed in the middle of the body"),
        (2, "TimeoutError: no end within 3 s"),
        (3, "StreamError: error event in the stream: simulated fault error_event"),
        (4, "StreamError: a message in the stream is not a JSON object"),
    ],
)
def test_a_request_failed_mid_stream_fails_its_case(
    faulty_run: Run, seed: int, why: str
) -> None:
    done, records = faulty_run
    record = records[seed]
    assert record["status"] == "failed", record["message"]
    assert record["results"]["failed"] == 1
    assert record["message"].startswith(
        "1 of 6 requests failed (1 failed in the middle of their stream; none allowed"
    )
    assert why in record["message"]
    assert "Traceback" not in done.stdout


@pytest.mark.parametrize(
    ("seed", "why"),
    [
        (5, "usage says 100000 output tokens, more than the 8 asked for"),
        (6, "usage.completion_tokens is -3, not a count"),
        (7, "usage.completion_tokens is '8', not a count"),
        (8, "2 of 8 output tokens under ignore_eos"),
    ],
)
def test_token_counts_the_server_made_up_make_the_measurement_invalid(
    faulty_run: Run, seed: int, why: str
) -> None:
    _, records = faulty_run
    record = records[seed]
    assert record["status"] == "invalid", record["message"]
    assert "inconsistent token counts in" in record["message"]
    assert why in record["message"]


def test_a_suite_may_allow_failed_requests(
    faulty_run: Run,
) -> None:
    _, records = faulty_run
    assert records[9]["status"] == "passed", records[9]["message"]
    assert records[9]["results"]["failed"] == 1


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("usage_claims=-3", {"usage_claims": -3}),
        ("usage_text", {"usage_text": True}),
        (
            "error_event=2,junk_line=3,short_stream=4",
            {"error_event": 2, "junk_line": 3, "short_stream": 4},
        ),
    ],
)
def test_the_new_faults_parse(spec: str, expected: dict[str, object]) -> None:
    faults = parse_faults([spec], [])
    assert {name: getattr(faults, name) for name in expected} == expected


def test_a_bad_usage_claim_is_refused() -> None:
    with pytest.raises(FaultSpecError, match="expected a number"):
        parse_faults(["usage_claims=many"], [])
