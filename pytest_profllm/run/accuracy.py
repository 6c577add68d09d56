"""Running one accuracy case: the configuration's server (the one its serve cases measure),
its prefix cache emptied as before any case, lm-eval's evaluation of the task against it
(load/accuracy.py), and a record whose results are lm-eval's metrics with their standard errors.
On the simulated engine the figure is a plumbing check: the record says so.
"""

from __future__ import annotations

import time
from typing import Any

from pytest_profllm.load.accuracy import (
    API_MODELS,
    AccuracyError,
    Evaluation,
    evaluate,
    results_of,
)
from pytest_profllm.load.server_state import empty_prefix_cache
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import AccuracyConfig
from pytest_profllm.results.record import AccuracyResult
from pytest_profllm.run.outcome import CaseFailed, CaseOutcome, check_thresholds
from pytest_profllm.run.serve import api_key_of, served_name
from pytest_profllm.server.launch import safe_name, server_name
from pytest_profllm.server.workers import WorkerServers


def run_accuracy(case: Case, servers: WorkerServers, outcome: CaseOutcome) -> CaseOutcome:
    """Start or reuse the server, evaluate the task on it, and keep lm-eval's figures."""
    bench = case.benchmark
    assert isinstance(bench, AccuracyConfig)
    api_key = api_key_of(case.server)
    log = servers.log_path(f"{server_name(case)}-{safe_name(case.workload_label)}.lm-eval")
    with servers.serving(case) as server:
        outcome.server = server
        # A cold server, as for every case: the evaluation's prompts find nothing cached.
        outcome.prefix_cache = empty_prefix_cache(server.base_url, api_key).describe()
        evaluation = Evaluation(
            base_url=server.base_url,
            model=served_name(case.server),
            task=bench.task,
            api=bench.api,
            limit=bench.limit,
            num_fewshot=bench.num_fewshot,
            concurrency=bench.batch_size,
            timeout_s=bench.timeout_s,
        )
        try:
            answer = evaluate(evaluation, api_key, log)
        except AccuracyError as error:
            raise CaseFailed(str(error)) from None
    outcome.results = results_of(answer)
    outcome.accuracy = accuracy_record(answer, bench, simulated=servers.engine == "sim")
    outcome.threshold_results = check_thresholds(case, outcome.results)
    outcome.finished_at = time.time()
    return outcome


def accuracy_record(
    answer: dict[str, Any], bench: AccuracyConfig, simulated: bool
) -> dict[str, Any]:
    """The record's `accuracy` block from lm-eval's answer (load/accuracy.py `_run`)."""
    results = results_of(answer)
    better = answer.get("higher_is_better") or {}
    metrics = [
        {
            "name": name,
            "value": value,
            "stderr": results.get(f"{name}_stderr"),
            # lm-eval says it of the metric, whatever filter its value went through.
            "higher_is_better": better.get(name, better.get(_metric_of(name, better))),
        }
        for name, value in results.items()
        if not name.endswith("_stderr") and name != "accuracy_samples"
    ]
    version = answer.get("task_version")
    return AccuracyResult(
        task=answer["task"],
        metrics=metrics,
        samples=answer.get("samples"),
        samples_available=answer.get("samples_available"),
        num_fewshot=answer.get("num_fewshot"),
        task_version=None if version is None else str(version),
        task_hash=answer.get("task_hash"),
        lm_eval_version=answer.get("lm_eval_version"),
        api=API_MODELS[bench.api],
        plumbing_check=simulated,
    ).model_dump(mode="json")


def _metric_of(name: str, known: dict[str, Any]) -> str | None:
    """The lm-eval metric a result is named after (`exact_match_strict_match`: exact_match)."""
    return max((metric for metric in known if name.startswith(f"{metric}_")), key=len, default=None)
