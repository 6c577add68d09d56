"""A gate that gates nothing is an error, never green: a failed session never
becomes a baseline, a baseline that matches no run of the session fails it, cases without a
baseline are counted (and fail on request), and a baseline that is no baseline is one line."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from helpers import run_suites

SUITE = """
server:
  model: Qwen/Qwen3-0.6B
benchmark:
  num_prompts: 8
  random_input_len: 16
  random_output_len: 8
  max_concurrency: 2
repeat: 2
regression:
  output_throughput: 10%
"""
# Sessions whose gate is the point run on the virtual clock (no server; PROFLLM_SIM_SLOWDOWN
# slows it too); the faults of PROFLLM_SIM_FAULTS need the real-time engine.
VIRTUAL = "--profllm-sim-clock=virtual"


def test_an_all_failed_session_is_never_the_baseline(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".yaml", bench_gated=SUITE)
    monkeypatch.setenv("PROFLLM_SIM_FAULTS", "error_rate=1")
    made = run_suites(
        pytester, ports, "--profllm-baseline=base.db", "--profllm-baseline-update",
        out=None, gpus=None, timeout=180,
    )
    assert made.ret == pytest.ExitCode.TESTS_FAILED
    with sqlite3.connect(pytester.path / "base.db") as db:
        stored = db.execute("SELECT count(*) FROM gate_runs").fetchone()[0] if db.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'gate_runs'"
        ).fetchone() else 0
    assert stored == 0  # before: two failed runs of 0.0 tok/s, the baseline of the next run
    monkeypatch.delenv("PROFLLM_SIM_FAULTS")
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.5")
    slowed = run_suites(
        pytester, ports, "--profllm-baseline=base.db", out=None, gpus=None, timeout=180
    )
    # Before: "unchanged (baseline 0.0)" and exit 0. Now nothing was compared: an error.
    assert slowed.ret == pytest.ExitCode.USAGE_ERROR
    slowed.stdout.fnmatch_lines([
        "*--profllm-baseline*base.db matches no run of this session's 1 gated case(s): "
        "nothing was compared*",
    ])
    assert "unchanged (baseline 0.0)" not in slowed.stdout.str()


def test_cases_without_a_baseline_are_counted_and_may_be_required(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_gated=SUITE)
    made = run_suites(
        pytester, ports, "--profllm-baseline=base.db", "--profllm-baseline-update", VIRTUAL,
        out=None, gpus=None, timeout=180,
    )
    assert made.ret == pytest.ExitCode.OK, made.stdout.str()
    other = SUITE.replace("num_prompts: 8", "num_prompts: 6")
    pytester.makefile(".yaml", bench_other=other)
    again = run_suites(
        pytester, ports, "--profllm-baseline=base.db", VIRTUAL, out=None, gpus=None, timeout=180
    )
    again.stdout.fnmatch_lines(["*profllm: no baseline for 1 of 2 gated case(s)*"])
    assert again.ret == pytest.ExitCode.OK
    required = run_suites(
        pytester, ports, "--profllm-baseline=base.db", "--profllm-require-baseline", VIRTUAL,
        out=None, gpus=None, timeout=180,
    )
    assert required.ret == pytest.ExitCode.TESTS_FAILED
    required.stdout.fnmatch_lines(
        ["*other: qwen3-0.6b::random-r2*", "no baseline for this case (--profllm-require-baseline)"]
    )


def test_a_garbage_baseline_is_one_usage_line(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_gated=SUITE)
    (pytester.path / "garbage.db").write_bytes(bytes(range(256)) * 8)
    result = run_suites(
        pytester, ports, "--profllm-baseline=garbage.db", out=None, gpus=None, timeout=180
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --profllm-baseline */garbage.db: not a baseline: file is not a database"]
    )
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_history_of_a_garbage_file_is_one_line(tmp_path: Path) -> None:
    from pytest_profllm.cli.main import main

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(bytes(range(256)) * 8)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["history", str(garbage)]))
    assert exit_info.value.code == 2
    assert time.monotonic() - started < 10


def test_a_database_built_by_ingest_is_a_baseline_and_a_history(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_profllm.cli.main import main

    suite = SUITE + "  median_tpot_ms: 10%\n"
    pytester.makefile(".yaml", bench_gated=suite)
    first = run_suites(pytester, ports, VIRTUAL, out="ci-artifacts", gpus=None, timeout=180)
    assert first.ret == pytest.ExitCode.OK, first.stdout.str()
    # The documented CI workflow: artifacts through `profllm ingest` into one database.
    combined = pytester.path / "combined.db"
    assert main(["ingest", str(combined), str(pytester.path / "ci-artifacts")]) == 0
    with sqlite3.connect(combined) as db:
        assert db.execute("SELECT count(*) FROM gate_runs").fetchone() == (2,)
        assert db.execute("SELECT count(*) FROM request_samples").fetchone() == (16,)
    assert main(["history", str(combined)]) == 0  # before: refused, no gate_runs table
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.3")
    slowed = run_suites(
        pytester, ports, f"--profllm-baseline={combined}", VIRTUAL, out=None, gpus=None, timeout=180
    )
    # Before: "(0 run(s))", every case no-baseline, exit 0 under the slowdown.
    assert slowed.ret == pytest.ExitCode.TESTS_FAILED, slowed.stdout.str()
    slowed.stdout.fnmatch_lines(["*regression: median_tpot_ms regressed*"])


def test_a_deep_record_in_a_baseline_folder_is_one_usage_line(
    pytester: pytest.Pytester, ports: str
) -> None:
    # Deeper than limits.py allows. Once: RecursionError, an INTERNALERROR.
    pytester.makefile(".yaml", bench_gated=SUITE)
    (pytester.path / "base").mkdir()
    (pytester.path / "base" / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    result = run_suites(
        pytester, ports, "--profllm-baseline=base", out=None, gpus=None, timeout=180
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: --profllm-baseline */base: not a baseline: */base/deep.json: the file nests "
        "JSON deeper than 64 levels"
    ])
    assert "Traceback" not in result.stderr.str() + result.stdout.str()
