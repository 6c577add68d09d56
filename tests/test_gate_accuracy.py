"""The gate on accuracy cases, without lm-eval: a conftest answers for lm-eval (its figures as
load/accuracy.py's child returns them), so whole sessions run, are gated and end as users see
them. The rule: every metric a case measures can be gated under the name its record
shows; a metric that cannot be judged is `not-judged`, named in the summary, and failed by
--profllm-require-baseline; the fingerprint carries what changes what is measured."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import pytest_argv, run_records, run_suites
from hypothesis import assume, given
from hypothesis import strategies as st

from conftest import shared_ports, sim_processes
from pytest_profllm.load.accuracy import results_of
from pytest_profllm.plan.metric_names import ACCURACY_METRICS
from pytest_profllm.plan.regression import gated_metric, measured, parse_regression
from pytest_profllm.results.fingerprint import digest, digests, fingerprint

SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_model_len: 4096
  enable_tokenizer_info_endpoint: true
benchmark:
  kind: accuracy
  task: profllm_arithmetic_gen
  limit: {limit}
regression: {regression}
"""

# lm-eval's answer for a "task", as load/accuracy.py's child process hands it over.
CONFTEST = """
import json
from pathlib import Path

import pytest_profllm.run.accuracy as accuracy
import pytest_profllm.session.worker as worker

worker.lm_eval_missing = lambda: None
accuracy.evaluate = lambda evaluation, api_key, log: json.loads(Path({path!r}).read_text())
"""


def answer(metrics: dict[str, Any], *, samples: int = 200, task_hash: str = "t1",
           lm_eval: str = "0.4.13") -> dict[str, Any]:
    return {
        "task": "gsm8k", "metrics": metrics, "higher_is_better": {"exact_match": True},
        "samples": samples, "samples_available": 1319, "num_fewshot": 5, "task_version": 3,
        "task_hash": task_hash, "lm_eval_version": lm_eval,
    }


def gsm8k(strict: float, flexible: float, stderr: float | str = 0.02) -> dict[str, Any]:
    return answer({
        "exact_match,strict-match": strict, "exact_match_stderr,strict-match": stderr,
        "exact_match,flexible-extract": flexible, "exact_match_stderr,flexible-extract": stderr,
    })


def session(pytester: pytest.Pytester, ports: str, lm_eval: dict[str, Any], *args: str,
            out: str = "results", regression: str = "[exact_match]",
            limit: int = 200) -> pytest.RunResult:
    """One session of the suite, lm-eval answering `lm_eval`."""
    path = pytester.path / "answer.json"
    path.write_text(json.dumps(lm_eval))
    pytester.makeconftest(CONFTEST.format(path=str(path)))
    pytester.makefile(".yaml", bench_acc=SUITE.format(limit=limit, regression=regression))
    return run_suites(pytester, ports, *args, out=out, gpus=None, cache=False)


def baseline(pytester: pytest.Pytester, ports: str, lm_eval: dict[str, Any],
             regression: str = "[exact_match]", limit: int = 200) -> None:
    made = session(pytester, ports, lm_eval, "--profllm-baseline=base/results.db",
                   "--profllm-baseline-update", out="base", regression=regression,
                   limit=limit)
    made.assert_outcomes(passed=1)


@pytest.fixture(scope="module")
def gsm8k_baseline(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, test_pool_dir: Path
) -> Path:
    """`baseline(pytester, ports, gsm8k(0.80, 0.82))`'s folder, made once for the tests that
    compare against it (each copies it into its own folder, as `copy_baseline` does)."""
    folder = tmp_path_factory.mktemp("gsm8k-baseline")
    path = folder / "answer.json"
    path.write_text(json.dumps(gsm8k(0.80, 0.82)))
    (folder / "conftest.py").write_text(CONFTEST.format(path=str(path)))
    (folder / "bench_acc.yaml").write_text(SUITE.format(limit=200, regression="[exact_match]"))
    ports = shared_ports("gate_accuracy", worker_id)
    argv = pytest_argv(ports, "--profllm-baseline=base/results.db", "--profllm-baseline-update",
                       out="base", gpus=None, cache=False)
    try:
        made = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300,
                              check=False)
    finally:
        assert not sim_processes(ports)
    assert made.returncode == 0 and "1 passed" in made.stdout, made.stdout[-3000:]
    return folder / "base"


def copy_baseline(pytester: pytest.Pytester, made: Path) -> None:
    """The shared baseline in this test's folder, where `baseline` would have written it."""
    shutil.copytree(made, pytester.path / "base")


def verdicts(pytester: pytest.Pytester) -> dict[str, dict[str, Any]]:
    [record] = run_records(pytester)
    return {verdict["metric"]: verdict for verdict in record["regression"]}


# --- every metric a case measures can be gated under the name its record shows -------------


def test_a_filtered_metric_can_be_named_as_its_record_names_it() -> None:
    # Once refused: `cannot gate 'exact_match_strict_match'`.
    assert parse_regression(["exact_match_strict_match"]) == {"exact_match_strict_match": 0.0}
    metric = gated_metric("exact_match_strict_match", 0.0)
    assert metric.higher_is_better and metric.by_stderr
    assert not gated_metric("perplexity_none_x", 0.0).higher_is_better
    # Its standard error and names that only look alike are not metrics to gate.
    for name in ("exact_match_strict_match_stderr", "exact_matchx", "accuracy_samples"):
        with pytest.raises(ValueError, match="cannot gate"):
            gated_metric(name, 0.0)


@given(metric=st.sampled_from(sorted(ACCURACY_METRICS)),
       filter_name=st.text(st.characters(codec="ascii"), max_size=30))
def test_any_filter_gives_a_name_the_gate_takes_with_its_metrics_direction(
    metric: str, filter_name: str
) -> None:
    # lm-eval's filter names come from task YAMLs: whatever one is, the name the record shows
    # for it (load/accuracy.py) can be gated, the way its metric can. (A filter named
    # "stderr" would be its metric's standard error: no task names one so.)
    assume(not re.sub(r"[^A-Za-z0-9]+", "_", filter_name).strip("_").lower().endswith("stderr"))
    [name] = [key for key in results_of(answer({f"{metric},{filter_name}": 0.5}))
              if key not in ("accuracy_samples",) and not key.endswith("_stderr")]
    gated = gated_metric(name, 0.0)
    assert gated.by_stderr and gated.higher_is_better == ACCURACY_METRICS[metric]


@given(name=st.text(max_size=40))
def test_any_name_is_gated_or_refused_in_one_line(name: str) -> None:
    try:
        gated_metric(name, 0.0)
    except ValueError as error:
        assert "\n" not in str(error)
        assert "cannot gate" in str(error) or "percentile" in str(error)


def test_a_bare_metric_gates_each_of_its_filtered_variants_and_no_other_metric() -> None:
    results = ["acc", "acc_stderr", "acc_norm", "exact_match_strict_match",
               "exact_match_flexible_extract", "exact_match_strict_match_stderr"]
    named = [gated_metric("exact_match", 0.0), gated_metric("acc", 0.0)]
    assert [m.name for m in measured(named, results)] == [
        "exact_match_strict_match", "exact_match_flexible_extract", "acc"]
    # A variant named as well keeps its own tolerance.
    both = [gated_metric("exact_match", 0.0), gated_metric("exact_match_strict_match", 0.05)]
    tolerances = {m.name: m.tolerance for m in measured(both, results)}
    assert tolerances == {"exact_match_strict_match": 0.05, "exact_match_flexible_extract": 0.0}


def test_a_drop_under_an_lm_eval_filter_is_caught_by_the_bare_metric(
    pytester: pytest.Pytester, ports: str, gsm8k_baseline: Path
) -> None:
    # Once, gsm8k's exact_match,strict-match fell, and `regression: [exact_match]` ended
    # `1 passed`, rc 0, with no verdict at all.
    copy_baseline(pytester, gsm8k_baseline)
    result = session(pytester, ports, gsm8k(0.50, 0.81), "--profllm-baseline=base/results.db")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*regression: exact_match_strict_match regressed*"])
    shown = verdicts(pytester)
    assert shown["exact_match_strict_match"]["decision"] == "regressed"
    assert shown["exact_match_flexible_extract"]["decision"] == "unchanged"


def test_a_filtered_metric_named_itself_is_gated(pytester: pytest.Pytester, ports: str) -> None:
    regression = "[exact_match_strict_match]"
    baseline(pytester, ports, gsm8k(0.80, 0.82), regression=regression)
    result = session(pytester, ports, gsm8k(0.50, 0.50), "--profllm-baseline=base/results.db",
                     regression=regression)
    result.assert_outcomes(failed=1)
    assert set(verdicts(pytester)) == {"exact_match_strict_match"}


def test_a_baseline_that_compares_no_metric_of_the_session_is_an_error(
    pytester: pytest.Pytester, ports: str
) -> None:
    # A gated metric no case measures compares nothing: README's exit status 4 and its line,
    # never a silent pass.
    baseline(pytester, ports, gsm8k(0.80, 0.82), regression="[f1]")
    result = session(pytester, ports, gsm8k(0.80, 0.82), "--profllm-baseline=base/results.db",
                     regression="[f1]")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["*--profllm-baseline *base/results.db*nothing was compared*"])


# --- a metric that cannot be judged is "not judged", and named ------------------------------


def one_sample(value: float) -> dict[str, Any]:
    # lm-eval at `limit: 1`: its standard error is "N/A".
    return answer({"acc,none": value, "acc_stderr,none": "N/A"}, samples=1)


def test_a_drop_without_a_standard_error_is_not_judged_and_named(
    pytester: pytest.Pytester, ports: str
) -> None:
    # Once, acc 1.0 -> 0.0 at limit 1 was `unchanged`, passed.
    baseline(pytester, ports, one_sample(1.0), regression="[acc]", limit=1)
    result = session(pytester, ports, one_sample(0.0), "--profllm-baseline=base/results.db",
                     regression="[acc]", limit=1)
    result.assert_outcomes(passed=1)
    shown = verdicts(pytester)["acc"]
    assert shown["decision"] == "not-judged" and shown["change"] == -1.0
    assert "standard error" in shown["reason"]
    result.stdout.fnmatch_lines(
        ["profllm: not judged (1): bench_acc.yaml::*: acc (*standard error*)"]
    )
    summary = (pytester.path / "results" / "summary.md").read_text()
    assert "Not judged (1)" in summary and "not-judged" in summary
    assert "unchanged" not in summary

    required = session(pytester, ports, one_sample(0.0), "--profllm-baseline=base/results.db",
                       "--profllm-require-baseline", regression="[acc]", limit=1)
    required.assert_outcomes(failed=1)
    required.stdout.fnmatch_lines(["*not judged (--profllm-require-baseline): acc not judged*"])


# --- the fingerprint carries what changes what is measured ---------------------------------


def accuracy_record(task_hash: str, lm_eval: str = "0.4.13") -> dict[str, Any]:
    return {
        "engine": {"name": "sim", "version": "0.1.0"},
        "config": {"server": {"model": "m"}, "benchmark": {"kind": "accuracy", "task": "t"}},
        "system": {}, "runtime": {"gpus": ["0"]},
        "accuracy": {"task": "gsm8k", "task_hash": task_hash, "lm_eval_version": lm_eval},
    }


def test_the_fingerprint_carries_the_task_and_lm_evals_version() -> None:
    same = digests(accuracy_record("t1"))
    assert digests(accuracy_record("t1")) == same
    other_task = digests(accuracy_record("t2"))
    assert other_task[0] != same[0] and other_task[1] != same[1]
    # Another lm-eval is another version: --profllm-baseline-any-version leaves it out.
    other_lm_eval = digests(accuracy_record("t1", lm_eval="0.4.14"))
    assert other_lm_eval[0] != same[0] and other_lm_eval[1] == same[1]
    # A run without an accuracy block keeps the parts (and digests) it had.
    serve = {key: value for key, value in accuracy_record("t1").items() if key != "accuracy"}
    assert set(fingerprint(serve)) == {
        "server", "benchmark", "engine", "device_model", "device_count", "engine_version",
        "engine_args_version"}


def test_a_changed_task_is_not_compared_with_the_old_tasks_baseline(
    pytester: pytest.Pytester, ports: str, gsm8k_baseline: Path
) -> None:
    # Once, the task's data changed under the same name; the case was judged `acc
    # regressed -72.5%` on an unchanged server.
    copy_baseline(pytester, gsm8k_baseline)
    changed = {**gsm8k(0.30, 0.31), "task_hash": "t2"}
    result = session(pytester, ports, changed, "--profllm-baseline=base/results.db")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # a baseline that matches nothing
    assert {v["decision"] for v in verdicts(pytester).values()} == {"no-baseline"}
    result.stdout.fnmatch_lines(["*matches no run of this session's 1 gated case(s)*"])


def _as_stored_before_the_task_part(db: Path) -> None:
    """The baseline database as an older version stored it: each fingerprint without the
    accuracy parts."""
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        rows = connection.execute(
            "SELECT g.run_id, f.parts FROM gate_runs g "
            "JOIN gate_fingerprints f ON f.fingerprint = g.fingerprint").fetchall()
        assert rows
        for run_id, stored in rows:
            parts = json.loads(stored)
            for key in ("accuracy_task_hash", "lm_eval_version"):
                del parts[key]
            any_version = {k: v for k, v in parts.items() if not k.endswith("_version")}
            connection.execute(
                "UPDATE gate_runs SET fingerprint = ?, fingerprint_any_version = ? "
                "WHERE run_id = ?", (digest(parts), digest(any_version), run_id))
            connection.execute("INSERT OR REPLACE INTO gate_fingerprints VALUES (?, ?)",
                               (digest(parts), json.dumps(parts)))


def test_an_older_database_stays_the_baseline_of_the_same_task_only(
    pytester: pytest.Pytester, ports: str, gsm8k_baseline: Path
) -> None:
    copy_baseline(pytester, gsm8k_baseline)
    _as_stored_before_the_task_part(pytester.path / "base" / "results.db")
    same_task = session(pytester, ports, gsm8k(0.50, 0.82), "--profllm-baseline=base/results.db")
    same_task.assert_outcomes(failed=1)
    assert verdicts(pytester)["exact_match_strict_match"]["decision"] == "regressed"
    for path in (pytester.path / "results").glob("*.json"):
        path.unlink()
    other = session(pytester, ports, {**gsm8k(0.50, 0.82), "task_hash": "t2"},
                    "--profllm-baseline=base/results.db")
    assert other.ret == pytest.ExitCode.USAGE_ERROR
    assert {v["decision"] for v in verdicts(pytester).values()} == {"no-baseline"}


def test_resume_runs_an_accuracy_case_again(pytester: pytest.Pytester, ports: str) -> None:
    # Once, --profllm-resume matched by the same fingerprint, so a case whose task
    # changed would have been skipped, its old task's record standing for it.
    first = session(pytester, ports, gsm8k(0.80, 0.82))
    first.assert_outcomes(passed=1)
    again = session(pytester, ports, {**gsm8k(0.30, 0.31), "task_hash": "t2"},
                    "--profllm-resume")
    again.assert_outcomes(passed=1)
    hashes = sorted(record["accuracy"]["task_hash"] for record in run_records(pytester))
    assert hashes == ["t1", "t2"]


def test_a_threshold_takes_a_filtered_metric_as_its_record_names_it(
    pytester: pytest.Pytester, ports: str
) -> None:
    # The other gate, alike: `thresholds: {exact_match_strict_match: {min: 0.6}}` was an
    # unknown metric.
    path = pytester.path / "answer.json"
    path.write_text(json.dumps(gsm8k(0.50, 0.82)))
    pytester.makeconftest(CONFTEST.format(path=str(path)))
    suite = SUITE.format(limit=200, regression="{}") + (
        "thresholds:\n  exact_match_strict_match: {min: 0.6}\n"
        "  exact_match_flexible_extract_stderr: {max: 0.05}\n"
    )
    pytester.makefile(".yaml", bench_acc=suite)
    result = run_suites(pytester, ports, gpus=None, cache=False)
    result.assert_outcomes(failed=1)
    [record] = run_records(pytester)
    assert [(v["metric"], v["passed"]) for v in record["threshold_results"]] == [
        ("exact_match_strict_match", False), ("exact_match_flexible_extract_stderr", True)]
