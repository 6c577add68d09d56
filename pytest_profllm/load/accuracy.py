"""One lm-evaluation-harness evaluation against a running server: lm-eval's API model
(`local-completions` or `local-chat-completions`) through its Python API (`simple_evaluate`),
in a process of its own, so that its imports (datasets, pyarrow), its logging and its memory
stay out of the pytest worker and a timeout can end it.

`python -m pytest_profllm.load.accuracy REQUEST RESULT` is that process: it reads the request
(JSON) and writes what the record needs of lm-eval's answer (JSON). The API key travels in the
environment (lm-eval reads `OPENAI_API_KEY`), never in a file or an argument.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_profllm.load.accuracy_task import SHIPPED_TASKS, task_config
from pytest_profllm.plan.metric_names import ACCURACY_SAMPLES

INSTALL_HINT = "lm-eval is not installed: pip install -e '.[accuracy]' in the pytest-profllm clone"
API_MODELS = {"completions": "local-completions", "chat-completions": "local-chat-completions"}
_ENDPOINTS = {"completions": "/v1/completions", "chat-completions": "/v1/chat/completions"}


class AccuracyError(Exception):
    """The evaluation did not give a result; the message says why in one line."""


def lm_eval_missing() -> str | None:
    """One line saying how to install lm-eval where it is missing; None where it is there."""
    return None if importlib.util.find_spec("lm_eval") is not None else INSTALL_HINT


@dataclass(frozen=True)
class Evaluation:
    """What to evaluate, against which server."""

    base_url: str
    model: str  # the served model name
    task: str
    api: str = "completions"
    limit: int | float | None = None
    num_fewshot: int | None = None
    concurrency: int = 1
    timeout_s: float = 1800.0

    def request(self) -> dict[str, Any]:
        tokenized = self.api == "completions"
        return {
            "model": API_MODELS[self.api],
            "model_args": {
                "base_url": self.base_url.rstrip("/") + _ENDPOINTS[self.api],
                "model": self.model,
                # The server's own tokenizer (/tokenizer_info, /tokenize): the prompt's tokens
                # are the server's, and nothing is downloaded. Chat needs none.
                "tokenizer_backend": "remote" if tokenized else None,
                "tokenized_requests": tokenized,
                "num_concurrent": self.concurrency,
                "max_retries": 1,
            },
            "task": task_config(self.task) if self.task in SHIPPED_TASKS else self.task,
            "limit": self.limit,
            "num_fewshot": self.num_fewshot,
            # lm-eval's chat model takes messages, which its chat template option makes.
            "apply_chat_template": self.api == "chat-completions",
        }


def evaluate(evaluation: Evaluation, api_key: str | None, log_path: Path) -> dict[str, Any]:
    """lm-eval's answer for the task, as `summarize` gives it; lm-eval's output goes to
    `log_path`. Raises AccuracyError with its last line where it fails or runs too long."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OPENAI_API_KEY", None)
    if api_key:
        env["OPENAI_API_KEY"] = str(api_key)
    with tempfile.TemporaryDirectory(prefix="profllm-accuracy-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps(evaluation.request()))
        argv = [sys.executable, "-m", "pytest_profllm.load.accuracy", str(request), str(result)]
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: a timeout ends its children too
            )
            try:
                code = process.wait(evaluation.timeout_s)
            except subprocess.TimeoutExpired:
                _end(process)
                raise AccuracyError(
                    f"lm-eval did not finish within timeout_s={evaluation.timeout_s:g} s "
                    f"(its log: {log_path})"
                ) from None
            except BaseException:  # interrupted: the evaluation goes with the case
                _end(process)
                raise
        if code != 0 or not result.is_file():
            raise AccuracyError(f"lm-eval failed: {_last_error(log_path)} (its log: {log_path})")
        answer: dict[str, Any] = json.loads(result.read_text())
        return answer


def _end(process: subprocess.Popen[bytes]) -> None:
    for signum, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def _last_error(log_path: Path) -> str:
    """The line of lm-eval's log that says what went wrong: its last exception's, else its
    last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("File ", "^", "~"))]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:500]


def results_of(answer: dict[str, Any]) -> dict[str, float | int | None]:
    """The case's results: each metric under its name (`<metric>_<filter>` where lm-eval's
    filter is not "none"), its standard error as `<name>_stderr`, and the samples scored."""
    results: dict[str, float | int | None] = {}
    for key, value in answer["metrics"].items():
        metric, _, kept = key.partition(",")
        if metric.endswith("_stderr"):
            continue
        name = metric if kept in ("", "none") else f"{metric}_{_slug(kept)}"
        results[name] = _number(value)
        results[f"{name}_stderr"] = _number(answer["metrics"].get(f"{metric}_stderr,{kept}"))
    results[ACCURACY_SAMPLES] = answer["samples"]
    return results


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _number(value: object) -> float | None:
    # lm-eval writes "N/A" for a standard error it could not compute.
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def task_hash(config: dict[str, Any]) -> str:
    """A digest of the task as lm-eval ran it: its configuration, each local data file by its
    content (so the same task hashes alike wherever the package is installed)."""

    def by_content(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: by_content(item) for key, item in value.items()}
        if isinstance(value, list):
            return [by_content(item) for item in value]
        if isinstance(value, str) and value.endswith((".json", ".jsonl", ".csv", ".parquet")):
            path = Path(value)
            if path.is_file():
                return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        return value

    canonical = json.dumps(by_content(config), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _run(request: dict[str, Any]) -> dict[str, Any]:
    """In the child: lm-eval's evaluation, and what the record needs of its answer."""
    # Deferred: lm-eval (an optional extra) imports datasets and pyarrow, about 2 s.
    import lm_eval
    from lm_eval.tasks import TaskManager

    task = request["task"]
    # lm-eval's own tasks only where one is named (indexing them takes a while).
    with_defaults = isinstance(task, str) and not task.endswith((".yaml", ".yml"))
    answer = lm_eval.simple_evaluate(
        model=request["model"],
        model_args=request["model_args"],
        tasks=[task],
        limit=request["limit"],
        num_fewshot=request["num_fewshot"],
        apply_chat_template=request["apply_chat_template"],
        log_samples=False,
        task_manager=TaskManager(include_defaults=with_defaults),
    )
    if answer is None:
        raise RuntimeError("lm-eval returned no results")
    (name,) = answer["results"]
    metrics = {
        key: value
        for key, value in answer["results"][name].items()
        if "," in key  # `metric,filter`; the rest are names and counts
    }
    counts = answer.get("n-samples", {}).get(name, {})
    config = answer.get("configs", {}).get(name, {})
    return {
        "task": name,
        "metrics": metrics,
        "higher_is_better": answer.get("higher_is_better", {}).get(name, {}),
        "samples": counts.get("effective"),
        "samples_available": counts.get("original"),
        "num_fewshot": answer.get("n-shot", {}).get(name),
        "task_version": answer.get("versions", {}).get(name),
        "task_hash": task_hash(config),
        "lm_eval_version": importlib.metadata.version("lm-eval"),
    }


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = argv or sys.argv[1:]
    answer = _run(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(answer, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
