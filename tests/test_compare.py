"""`profllm compare A B`: two sessions' results, each a database or a folder of records, judged
case by case by the regression gate. The sessions run on the virtual clock (no server, figures
that do not depend on the host's load); the second is slowed 1.5 times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_suites

from pytest_profllm.cli.main import main

SUITE = """
server:
  model: sim-8b
  enable_prefix_caching: false
  max_num_batched_tokens: 1024
benchmark:
  num_prompts: 20
  random_input_len: 512
  random_output_len: 16
repeat: 2
"""
CASE = "bench_cmp.yaml::sim-8b::random"


@pytest.fixture
def two_runs(pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytester.makefile(".yaml", bench_cmp=SUITE)
    for out in ("a", "b"):
        if out == "b":
            monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.5")
        result = run_suites(pytester, ports, "--profllm-sim-clock=virtual", out=out,
                            gpus=None, cache=False)
        result.assert_outcomes(passed=2)
    return pytester.path


def test_compare_judges_each_metric_as_the_gate_does(
    two_runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A folder of records against a database: either side may be either.
    status = main(["compare", str(two_runs / "a"), str(two_runs / "b" / "results.db")])
    out = capsys.readouterr().out.splitlines()
    assert status == 1  # a metric regressed
    assert out[0].split() == ["case", "metric", "A", "B", "change", "interval", "decision"]
    rows = {line.split()[1]: line for line in out[1:-1]}
    assert set(rows) == {"median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput"}
    assert all(line.startswith(CASE) for line in rows.values())
    # The gate's own decisions: a change is called only where its whole interval lies past
    # the tolerance (a median of 40 requests moved +41 % is `unchanged`, its interval wide).
    assert rows["p99_ttft_ms"].endswith("regressed")
    assert rows["output_throughput"].endswith("regressed")
    assert out[-1].startswith("1 case(s), 4 row(s): ")

    assert main(["compare", "--json", "--metric", "p99_e2el_ms",
                 str(two_runs / "a" / "results.db"), str(two_runs / "b")]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["case_id"] == CASE and row["metric"] == "p99_e2el_ms"
    assert row["decision"] == "regressed" and row["tolerance"] == 0.10
    assert row["change"] > 0.3 and row["ci_low"] > 0.10
    assert row["a_samples"] == row["b_samples"] == 40  # both repeats' requests

    # A session against itself regresses nothing; a case on one side only is said so.
    assert main(["compare", str(two_runs / "a"), str(two_runs / "a" / "results.db")]) == 0
    assert "regressed" not in capsys.readouterr().out
    (two_runs / "empty").mkdir()
    assert main(["compare", str(two_runs / "a"), str(two_runs / "empty")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [CASE, "only-in-A"]


def test_what_cannot_be_compared_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "no-such")]) == 2
    assert "no-such: no such database or folder of records" in capsys.readouterr().err
    assert main(["compare", "--metric", "ttft", str(tmp_path / "empty"),
                 str(tmp_path / "empty")]) == 2
    assert "cannot gate 'ttft'" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip().endswith("0 case(s), 0 row(s): nothing to compare")
