"""`kind: accuracy`: lm-eval scores a task against the configuration's server. The suite's keys
and the plan, the shipped task, lm-eval's figures as results, the gate on accuracy (lm-eval's
standard errors), the skip without lm-eval; and whole runs on the simulated engine and on
vLLM's CPU build (marked `accuracy`: they need `pip install -e '.[test,accuracy]'`)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import cases_of, run_records, run_suites, suite_error, write_suite
from packaging.version import Version

from pytest_profllm.browse.run_page import run_page
from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.gates.regression import GateSettings, judge_regression
from pytest_profllm.gates.samples import RunSamples
from pytest_profllm.load.accuracy import INSTALL_HINT, results_of, task_hash
from pytest_profllm.load.accuracy_task import DATA_FILE, SHIPPED_TASKS, render, task_config
from pytest_profllm.plan.regression import gated_metric, parse_regression
from pytest_profllm.plan.suite import AccuracyConfig
from pytest_profllm.results.record import normalize

HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason=INSTALL_HINT)
# The lm-eval versions the accuracy extra allows (pyproject.toml), and this test checks.
LM_EVAL_RANGE = (Version("0.4.13"), Version("0.5"))

SERVER = """
server:
  model: Qwen/Qwen3-8B
  max_model_len: 4096
  enable_tokenizer_info_endpoint: true
"""
ACCURACY = (
    SERVER
    + """
benchmark:
  kind: accuracy
  task: [profllm_arithmetic_mc, profllm_arithmetic_gen]
  limit: 60
  batch_size: 4
thresholds:
  accuracy_samples: {min: 60}
"""
)


def test_the_shipped_data_is_what_its_generator_writes() -> None:
    assert DATA_FILE.read_bytes() == render()
    rows = [json.loads(line) for line in DATA_FILE.read_text().splitlines()]
    assert len(rows) == 200
    for row in rows:  # one right answer, among four different ones
        assert row["choices"][row["label"]] == row["answer"]
        assert len(set(row["choices"])) == 4


def test_the_shipped_tasks_read_the_packages_file_wherever_it_is() -> None:
    for name in SHIPPED_TASKS:
        config = task_config(name)
        assert config["task"] == name
        assert config["dataset_kwargs"]["data_files"] == {"test": str(DATA_FILE)}
    assert task_config(SHIPPED_TASKS[0])["output_type"] == "multiple_choice"
    assert task_config(SHIPPED_TASKS[1])["output_type"] == "generate_until"


def test_a_task_hash_follows_the_data_not_where_it_lies(tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(DATA_FILE.read_bytes())
    config = task_config(SHIPPED_TASKS[0])
    moved = {**config, "dataset_kwargs": {"data_files": {"test": str(copy)}}}
    assert task_hash(config) == task_hash(moved)
    copy.write_bytes(DATA_FILE.read_bytes()[:-10])
    assert task_hash(config) != task_hash(moved)


def test_an_accuracy_case_per_task_shares_the_serve_cases_server(tmp_path: Path) -> None:
    accuracy = cases_of(write_suite(tmp_path, ACCURACY, "bench_accuracy.yaml"))
    serve = cases_of(write_suite(tmp_path, SERVER + "benchmark:\n  num_prompts: 4\n"))
    assert [c.name for c in accuracy] == [
        "qwen3-8b::accuracy-profllm_arithmetic_mc",
        "qwen3-8b::accuracy-profllm_arithmetic_gen",
    ]
    assert {c.server_key for c in accuracy} == {serve[0].server_key}
    bench = accuracy[0].benchmark
    assert isinstance(bench, AccuracyConfig)
    assert (bench.limit, bench.batch_size, bench.api) == (60, 4, "completions")


def test_the_plan_shows_accuracy_cases_on_their_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_suite(tmp_path, ACCURACY, "bench_accuracy.yaml")
    assert cli_main(["plan", str(path), "--json", "--engine", "sim"]) == 0
    document = json.loads(capsys.readouterr().out)
    (server,) = document["servers"]
    assert "--enable-tokenizer-info-endpoint" in server["argv"]
    assert [case["kind"] for case in document["cases"]] == ["accuracy", "accuracy"]
    assert {case["server_key"] for case in document["cases"]} == {server["server_key"]}


def test_an_accuracy_case_without_the_tokenizer_endpoint_is_refused(tmp_path: Path) -> None:
    text = ACCURACY.replace("  enable_tokenizer_info_endpoint: true\n", "")
    message = suite_error(write_suite(tmp_path, text))
    assert "bench_x.yaml:" in message
    assert "enable_tokenizer_info_endpoint: true" in message
    # Chat generates only: it needs no tokenizer of the server's.
    chat = text.replace("  batch_size: 4\n", "  batch_size: 4\n  api: chat-completions\n")
    assert len(cases_of(write_suite(tmp_path, chat))) == 2


@pytest.mark.parametrize(
    ("line", "replacement", "said"),
    [
        ("  limit: 60\n", "  limit: 1.5\n", "a fractional limit lies under 1"),
        ("  batch_size: 4\n", "  batch_size: 0\n", "benchmark.batch_size"),
        ("  accuracy_samples: {min: 60}\n", "  accuracy: {min: 0.6}\n",
         "unknown metric 'thresholds.accuracy'"),
    ],
)
def test_an_accuracy_suites_keys_are_checked(
    tmp_path: Path, line: str, replacement: str, said: str
) -> None:
    error = suite_error(write_suite(tmp_path, ACCURACY.replace(line, replacement)))
    assert "bench_x.yaml:" in error and said in error


def test_acc_takes_a_threshold(tmp_path: Path) -> None:
    text = ACCURACY.replace("  accuracy_samples: {min: 60}\n", "  acc: {min: 0.6}\n")
    (case, _) = cases_of(write_suite(tmp_path, text))
    assert case.thresholds["acc"].min == 0.6


def test_lm_evals_figures_become_results() -> None:
    answer = {
        "metrics": {
            "acc,none": 0.5, "acc_stderr,none": 0.05,
            "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A",
        },
        "samples": 40,
    }
    assert results_of(answer) == {
        "acc": 0.5, "acc_stderr": 0.05,
        "exact_match_strict_match": 0.25, "exact_match_strict_match_stderr": None,
        "accuracy_samples": 40,
    }


def _run(acc: float, stderr: float) -> RunSamples:
    return RunSamples("r", "s", "t", {"acc": acc, "acc_stderr": stderr, "accuracy_samples": 400})


def test_the_gate_judges_accuracy_by_the_two_standard_errors() -> None:
    acc = gated_metric("acc", parse_regression(["acc"])["acc"])
    assert acc.higher_is_better and acc.tolerance == 0
    settings = GateSettings()  # 99 %: z = 2.58; sqrt(0.02^2 + 0.02^2) = 0.028, times z: 0.073
    base = [_run(0.80, 0.02)]
    lower = judge_regression(acc, [_run(0.70, 0.02)], base, settings)
    assert lower.decision == "regressed"
    assert lower.ci_high is not None and lower.ci_high < 0
    assert judge_regression(acc, [_run(0.76, 0.02)], base, settings).decision == "unchanged"
    assert judge_regression(acc, [_run(0.90, 0.02)], base, settings).decision == "improved"
    # No standard error on a side (lm-eval's "N/A"): no interval, so not judged (it
    # was once `unchanged`, and passed acc 1.0 -> 0.0), with the reason.
    no_error = RunSamples("r", "s", "t", {"acc": 0.5, "acc_stderr": None})
    unjudged = judge_regression(acc, [no_error], base, settings)
    assert unjudged.decision == "not-judged" and unjudged.change == pytest.approx(0.5 / 0.8 - 1)
    assert unjudged.reason is not None and "standard error" in unjudged.reason


def test_without_lm_eval_an_accuracy_case_is_skipped_with_one_line(
    pytester: pytest.Pytester, ports: str
) -> None:
    # The example suite (README's main job), as where lm-eval is not installed.
    example = Path(__file__).parents[1] / "benchmarks" / "bench_accuracy.yaml"
    pytester.makefile(".yaml", bench_accuracy=example.read_text())
    pytester.makeconftest(
        "import pytest_profllm.session.worker as worker\n"
        f"worker.lm_eval_missing = lambda: {INSTALL_HINT!r}\n"
    )
    result = run_suites(pytester, ports, "-rs", gpus=None, cache=False)
    result.assert_outcomes(skipped=2)
    # (fnmatch reads [accuracy] as a set of characters: the line is matched up to it.)
    result.stdout.fnmatch_lines(["SKIPPED [[]2[]] *: lm-eval is not installed: pip install *"])
    assert INSTALL_HINT in result.stdout.str()
    assert "Traceback" not in result.stdout.str()
    assert {r["status"] for r in run_records(pytester)} == {"skipped"}


@pytest.mark.accuracy
@needs_lm_eval
def test_the_installed_lm_eval_is_in_the_supported_range() -> None:
    low, high = LM_EVAL_RANGE
    assert low <= Version(importlib.metadata.version("lm-eval")) < high


def _row(db: Path, task: str) -> dict[str, Any]:
    with sqlite3.connect(db) as connection:
        connection.row_factory = sqlite3.Row
        row = connection.execute(
            "SELECT * FROM benchmark_runs WHERE accuracy_task = ?", (task,)
        ).fetchone()
        landing = connection.execute(
            "SELECT acc, exact_match FROM runs WHERE run_id = ?", (row["run_id"],)
        ).fetchone()
    return {**dict(row), "landing": tuple(landing)}


@pytest.mark.accuracy
@needs_lm_eval
def test_an_accuracy_case_on_the_simulated_engine_is_recorded_stored_and_gated(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_accuracy=ACCURACY + "regression: [acc]\n")
    first = run_suites(
        pytester, ports, "--profllm-baseline=base/results.db", "--profllm-baseline-update",
        out="base", gpus=None, cache=False,
    )
    first.assert_outcomes(passed=2)
    records = {r["accuracy"]["task"]: r for r in run_records(pytester, "base")}
    multiple_choice = records["profllm_arithmetic_mc"]
    normalize(multiple_choice)  # the record model reads it back
    accuracy = multiple_choice["accuracy"]
    assert accuracy["plumbing_check"] is True  # the simulator's answers are no model's
    assert accuracy["samples"] == 60 and accuracy["samples_available"] == 200
    assert accuracy["lm_eval_version"] == importlib.metadata.version("lm-eval")
    assert len(accuracy["task_hash"]) == 16
    results = multiple_choice["results"]
    # Near chance (one of four), as answers by hash are: within four standard errors.
    assert abs(results["acc"] - 0.25) < 4 * results["acc_stderr"]
    assert multiple_choice["runtime"]["prefix_cache"] == "emptied before the load"
    generated = records["profllm_arithmetic_gen"]["results"]
    assert set(generated) == {"exact_match", "exact_match_stderr", "accuracy_samples"}
    row = _row(pytester.path / "base" / "results.db", "profllm_arithmetic_mc")
    assert row["acc"] == results["acc"] and row["acc_stderr"] == results["acc_stderr"]
    assert row["accuracy_plumbing_check"] == 1
    assert row["landing"][0] == round(results["acc"], 3)
    first.stdout.fnmatch_lines(["*accuracy: acc 0.* ± 0.0*, n=60 (plumbing check)"])
    with sqlite3.connect(pytester.path / "base" / "results.db") as connection:
        page = run_page(connection, multiple_choice["run_id"])
    assert page is not None and page.plumbing_check
    assert page.headlines[0] == ("acc", f"{results['acc']:.3f} ± {results['acc_stderr']:.3f}", "")
    assert page.accuracy is not None and "on 60 of 200 samples" in page.accuracy

    # The same simulator answers the same: against that baseline, unchanged. The generate
    # task measures no acc, so it is not gated on it: before, it was `no-baseline` for ever,
    # and a required baseline failed it.
    again = run_suites(
        pytester, ports, "--profllm-baseline=base/results.db", "--profllm-require-baseline",
        out="new", gpus=None, cache=False
    )
    again.assert_outcomes(passed=2)
    by_task = {r["accuracy"]["task"]: r for r in run_records(pytester, "new")}
    assert not by_task["profllm_arithmetic_gen"]["regression"]
    gated = by_task["profllm_arithmetic_mc"]
    (verdict,) = gated["regression"]
    assert (verdict["metric"], verdict["decision"]) == ("acc", "unchanged")
    assert verdict["baseline"] == results["acc"]


@pytest.mark.accuracy
@needs_lm_eval
def test_lm_eval_runs_in_a_process_of_its_own_that_a_timeout_ends(
    pytester: pytest.Pytester, ports: str
) -> None:
    text = ACCURACY.replace("  batch_size: 4\n", "  batch_size: 4\n  timeout_s: 0.5\n")
    pytester.makefile(".yaml", bench_accuracy=text.replace(
        "  task: [profllm_arithmetic_mc, profllm_arithmetic_gen]\n",
        "  task: profllm_arithmetic_mc\n",
    ))
    started = time.time() - 1
    result = run_suites(pytester, ports, gpus=None, cache=False)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*lm-eval did not finish within timeout_s=0.5 s*"])
    left = [
        p for p in psutil.process_iter(["cmdline", "create_time"])
        if "pytest_profllm.load.accuracy" in (p.info["cmdline"] or [])
        and p.info["create_time"] >= started
    ]
    assert not left  # its own process group, ended with it


@pytest.mark.accuracy
@needs_lm_eval
def test_the_servers_api_key_reaches_lm_eval_and_nothing_it_writes(
    pytester: pytest.Pytester, ports: str
) -> None:
    secret = "sk-accuracy-7f3e9c"
    server = f"  max_model_len: 4096\n  api_key: {secret}\n"
    text = ACCURACY.replace("  max_model_len: 4096\n", server, 1)
    pytester.makefile(".yaml", bench_accuracy=text.replace(
        "  task: [profllm_arithmetic_mc, profllm_arithmetic_gen]\n",
        "  task: profllm_arithmetic_mc\n",
    ))
    result = run_suites(pytester, ports, gpus=None, cache=False)
    result.assert_outcomes(passed=1)  # the simulator refuses /v1 requests without the key
    written = [p for p in (pytester.path / "results").rglob("*") if p.is_file()]
    assert any(".lm-eval." in p.name for p in written)  # lm-eval's own log among them
    assert secret not in result.stdout.str()
    for path in written:
        assert secret.encode() not in path.read_bytes(), path.name


@pytest.mark.accuracy
@needs_lm_eval
def test_a_generate_task_runs_through_the_chat_api_without_the_tokenizer_endpoint(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_chat="""
server:
  model: Qwen/Qwen3-8B
benchmark:
  kind: accuracy
  task: profllm_arithmetic_gen
  api: chat-completions
  limit: 10
""")
    run_suites(pytester, ports, gpus=None, cache=False).assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["accuracy"]["api"] == "local-chat-completions"
    assert record["results"]["accuracy_samples"] == 10
