"""The regression gate through real pytest runs on the simulated engine: a baseline run, then
the same suite slowed down (PROFLLM_SIM_SLOWDOWN), barely slowed, or with another seed; the
verdict in the failure, the record, the database, JUnit XML and the Markdown summary; and
pytest-benchmark's --benchmark-compare-fail on the same slowdown under xdist. The verdicts
come from the virtual clock (PROFLLM_SIM_SLOWDOWN multiplies its steps as it does the real-time
engine's), in seconds rather than minutes; the schedule-lag test needs the real-time client."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_invalid, run_records, run_suites

# Prefill-heavy (the simulator's step times, which PROFLLM_SIM_SLOWDOWN multiplies, outweigh its
# own CPU overhead on a busy host), prefix caching off (every repeat sends the same prompts).
WORKLOAD = """
server:
  model: sim-8b
  enable_prefix_caching: false
  max_num_batched_tokens: 1024
benchmark:
  num_prompts: 20
  random_input_len: 512
  random_output_len: 16
  seed: {seed}
"""
SUITE = (
    WORKLOAD
    + """
repeat: 2
regression:
  output_throughput: 5%
  p99_e2el_ms: 10%
"""
)
CASE = "bench_gate.yaml::sim-8b::random"
# No server: the engine stepped in the worker's process (docs/simulated-engine/virtual-clock.md).
VIRTUAL = "--profllm-sim-clock=virtual"


def last_record(pytester: pytest.Pytester, out: str) -> dict[str, Any]:
    (last,) = [r for r in run_records(pytester, out) if r["repeat_index"] == 1]
    assert isinstance(last, dict)
    return last


@pytest.fixture
def baseline(pytester: pytest.Pytester, ports: str) -> Path:
    pytester.makefile(".yaml", bench_gate=SUITE.format(seed=0))
    result = run_suites(
        pytester,
        ports,
        "--profllm-baseline=base/results.db",
        "--profllm-baseline-update",
        VIRTUAL,
        out="base",
        gpus=None,
        cache=False,
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*this run is the new baseline in*", "*no-baseline*"])
    return pytester.path / "base" / "results.db"


def test_a_15_percent_slowdown_fails_the_gate(
    pytester: pytest.Pytester, ports: str, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.15")
    summary = pytester.path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = run_suites(
        pytester,
        ports,
        f"--profllm-baseline={baseline}",
        "--junitxml=junit.xml",
        VIRTUAL,
        out="slow",
        gpus=None,
        cache=False,
    )
    result.assert_outcomes(passed=1, failed=1)
    # The failure names the metric, the baseline value, the new value, the change and the
    # interval, on the last repeat (the first has nothing to judge yet).
    result.stdout.re_match_lines(
        [
            r"_+ gate: sim-8b::random-r2 _+",
            r"regression: .*(output_throughput|p99_e2el_ms) regressed: "
            r"baseline [0-9.]+, now [0-9.]+, [+-][0-9.]+% \(99% CI [+-][0-9.]+% \.\. "
            r"[+-][0-9.]+%, tolerance (5|10)%\)",
        ]
    )
    result.stdout.fnmatch_lines(["*profllm: regression gate against *base*results.db (2 run(s))*"])
    # Where the Markdown went, in one line: the latest file, this session's copy, the step's.
    (said,) = [line for line in result.outlines if "Markdown summary" in line]
    assert said.startswith("profllm: Markdown summary in ") and "(also summary-" in said
    assert said.endswith(f", {summary})")
    record = last_record(pytester, "slow")
    assert record["status"] == "failed"
    verdicts = {v["metric"]: v for v in record["regression"]}
    assert {v["decision"] for v in verdicts.values()} <= {"regressed", "unchanged"}
    assert "regressed" in {v["decision"] for v in verdicts.values()}
    e2el = verdicts["p99_e2el_ms"]
    assert e2el["change"] > 0.05 and e2el["baseline_samples"] == 40 and e2el["samples"] == 40
    with sqlite3.connect(pytester.path / "slow" / "results.db") as db:
        stored = db.execute(
            "select metric, verdict, baseline, value, ci_low, ci_high from regression_verdicts"
        ).fetchall()
        gate = db.execute("select gate from gate_runs where run_id = ?", (record["run_id"],))
        assert gate.fetchone() == ("regressed",)
        samples = db.execute("select count(*) from request_samples").fetchone()
    assert {(m, v) for m, v, *_ in stored} == {(m, v["decision"]) for m, v in verdicts.items()}
    assert samples == (40,)
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="profllm_gate" value="regressed"' in junit
    assert 'name="profllm_gate_p99_e2el_ms" value="' in junit
    markdown = (pytester.path / "slow" / "summary.md").read_text()
    assert markdown == summary.read_text()
    assert f"| {CASE}-r2 | failed |" in markdown and "| regressed |" in markdown


def test_a_1_percent_slowdown_passes(
    pytester: pytest.Pytester, ports: str, baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.01")
    result = run_suites(
        pytester, ports, f"--profllm-baseline={baseline}", VIRTUAL, out="new", gpus=None,
        cache=False,
    )
    result.assert_outcomes(passed=2)
    verdicts = {v["decision"] for v in last_record(pytester, "new")["regression"]}
    assert verdicts <= {"unchanged", "improved"}


def test_another_seed_unchanged_passes(
    pytester: pytest.Pytester, ports: str, baseline: Path
) -> None:
    pytester.makefile(".yaml", bench_gate=SUITE.format(seed=7))
    result = run_suites(
        pytester, ports, f"--profllm-baseline={baseline}", VIRTUAL, out="new", gpus=None,
        cache=False,
    )
    result.assert_outcomes(passed=2)
    record = last_record(pytester, "new")
    assert record["config"]["benchmark"]["seed"] == 7
    assert {v["decision"] for v in record["regression"]} <= {"unchanged", "improved"}
    assert all(v["baseline"] is not None for v in record["regression"])


def test_a_missing_baseline_is_a_usage_error(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_gate=SUITE.format(seed=0))
    result = run_suites(
        pytester, ports, "--profllm-baseline=nowhere.db", out="new", gpus=None, cache=False
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--profllm-baseline *nowhere.db: no such file or folder*"])
    result = run_suites(
        pytester, ports, "--profllm-baseline-update", out="new", gpus=None, cache=False
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--profllm-baseline-update needs --profllm-baseline PATH*"])


def test_benchmark_compare_fail_under_xdist(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makefile(".yaml", bench_gate=WORKLOAD.format(seed=0))
    storage = f"file://{pytester.path / 'benchmarks-storage'}"
    plain = run_suites(
        pytester,
        ports,
        "-n",
        "2",
        f"--benchmark-storage={storage}",
        VIRTUAL,
        out="base",
        gpus=None,
        cache=False,
    )
    plain.assert_outcomes(passed=1)
    # Without pytest-benchmark's options, none of its tables.
    assert "benchmark 'profllm" not in plain.stdout.str()
    saved = run_suites(
        pytester,
        ports,
        "-n",
        "2",
        f"--benchmark-storage={storage}",
        VIRTUAL,
        "--benchmark-save=base",
        "--benchmark-json=base.json",
        out="base",
        gpus=None,
        cache=False,
    )
    saved.assert_outcomes(passed=1)
    written = json.loads((pytester.path / "base.json").read_text())
    names = {bench["fullname"] for bench in written["benchmarks"]}
    assert names == {f"{CASE}[{m}]" for m in ("ttft", "tpot", "itl", "e2el")}
    e2el = next(b for b in written["benchmarks"] if b["name"].endswith("[e2el]"))
    assert len(e2el["stats"]["data"]) == 20 and e2el["group"] == "profllm e2el"
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.6")
    slow = run_suites(
        pytester,
        ports,
        "-n",
        "2",
        f"--benchmark-storage={storage}",
        VIRTUAL,
        "--benchmark-compare=0001",
        "--benchmark-compare-fail=mean:5%",
        out="slow",
        gpus=None,
        cache=False,
    )
    assert slow.ret != 0
    # pytest-benchmark's own report (its logger writes to stderr).
    report = slow.stdout.str() + slow.stderr.str()
    assert "Performance has regressed" in report
    assert "sim-8b::random[e2el] (0001_base) - Field 'mean' has failed" in report


def test_an_invalid_measurement_is_not_judged(pytester: pytest.Pytester, ports: str) -> None:
    # At a finite rate the client's schedule lag is checked; none keeps within a microsecond.
    paced = SUITE.format(seed=0).replace("  seed: 0", "  seed: 0\n  request_rate: 50")
    pytester.makefile(".yaml", bench_gate=paced)
    (pytester.path / "empty").mkdir()
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=new",
        "--profllm-baseline=empty",
        "--profllm-max-schedule-lag=0.001",
        "-p",
        "no:cacheprovider",
        timeout=300,
    )
    assert_invalid(result, 2)
    result.stdout.fnmatch_lines(["*invalid measurement: *"])
    assert "regression:" not in result.stdout.str()
    record = last_record(pytester, "new")
    assert record["status"] == "invalid" and record["regression"] == []
