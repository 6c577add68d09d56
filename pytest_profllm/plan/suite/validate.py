"""A suite as data (a file's or a marker's) checked whole: every block, the thresholds
against what the workloads record, and the exclusions against the blocks; every problem
found at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from pytest_profllm.engine.registry import bundled
from pytest_profllm.plan.regression import regression_problems
from pytest_profllm.plan.suite.accuracy import AccuracyConfig
from pytest_profllm.plan.suite.axes import combinations
from pytest_profllm.plan.suite.kinds import BENCHMARK_KINDS, WorkloadConfig, measures
from pytest_profllm.plan.suite.lora import mix_problems
from pytest_profllm.plan.suite.model import Suite
from pytest_profllm.plan.suite.problems import (
    _nearest_line,
    _Problems,
    _shown_input,
    describe_errors,
    did_you_mean,
)
from pytest_profllm.plan.suite.serve import BenchmarkConfig
from pytest_profllm.plan.suite.server import _check_rules, _check_server

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry


def validate_suite(
    data: dict[str, Any],
    where: str,
    lines: dict[tuple[Any, ...], int] | None = None,
    registry: Registry | None = None,
) -> Suite:
    """The typed suite; `server:` is checked against vLLM's engine arguments (`registry`,
    the bundled one by default): names, types, choices and a few rules across them. Every
    problem is reported, in one SuiteError. In the suite returned, `server:` values are as
    vLLM's parser reads them (`"16"` is 16), and every value of an argument that takes a
    list is written as an axis (`[1, 2]` becomes `[[1, 2]]`): a list there is an axis."""

    lines = lines or {}
    registry = registry or bundled()
    problems = _Problems(where)
    server = data.get("server")
    checked = _check_server(server, registry, lines, problems) if isinstance(server, dict) else None
    # Every bad tolerance or metric of the gate, each at its line (pydantic would stop at the
    # first); the block is then left out of the model, so none is reported twice.
    gate_problems = regression_problems(data.get("regression"))
    for name, text in gate_problems:
        path = ("regression",) if name is None else ("regression", name)
        problems.add(_nearest_line(lines, path), f"regression: {text}")
    if gate_problems:
        data = {key: value for key, value in data.items() if key != "regression"}
    try:
        suite: Suite | None = Suite.model_validate(data)
    except ValidationError as error:
        for line, text in describe_errors(error, lines, Suite):
            problems.add(line, text)
        suite = None
    benchmark = data.get("benchmark", {})
    thresholds = data.get("thresholds")
    if isinstance(benchmark, dict):
        metrics_named = thresholds if isinstance(thresholds, dict) else {}
        _check_benchmark(benchmark, metrics_named, lines, problems)
    if suite is not None and checked is not None and not problems.found:
        suite.server = checked
        _check_rules(suite.server, lines, problems)
        for text in mix_problems(suite.server, suite.benchmark):
            problems.add(_nearest_line(lines, ("benchmark", "lora_mix")), text)
        _check_exclusions(suite, registry, lines, problems)
    if suite is None or problems.found:
        raise problems.error()
    return suite


def _check_benchmark(
    block: dict[str, Any],
    thresholds: dict[str, Any],
    lines: dict[tuple[Any, ...], int],
    problems: _Problems,
) -> None:
    # Every combination: its rules span keys (ramp-up needs an infinite request_rate).
    workloads: list[WorkloadConfig] = []
    for values in combinations(block):
        kind = values.get("kind", "serve")
        model = BENCHMARK_KINDS.get(kind) if isinstance(kind, str) else None
        if model is None:
            problems.add(
                lines.get(("benchmark", "kind")),
                f"benchmark.kind: {kind!r} is not a benchmark kind; "
                f"allowed: {', '.join(BENCHMARK_KINDS)}",
            )
            continue
        try:
            workloads.append(model.model_validate(values))  # type: ignore[arg-type]
        except ValidationError as error:
            for line, text in describe_errors(error, lines, model, ("benchmark",)):
                problems.add(line, text)
    # With no valid workload, metric names are checked against the default one's (an
    # accuracy case's, where the kind is that: its names do not depend on its keys).
    kinds = {values.get("kind") for values in combinations(block)}
    fallback: list[Any] = [
        AccuracyConfig(kind="accuracy", task="-") if kinds == {"accuracy"} else BenchmarkConfig()
    ]
    for workload in workloads or fallback:
        allowed = workload.result_names()
        for metric in thresholds:
            if not measures(workload, str(metric)):
                problems.add(
                    lines.get(("thresholds", metric)),
                    f"unknown metric 'thresholds.{metric}'{did_you_mean(str(metric), allowed)}; "
                    f"allowed: {', '.join(allowed)}",
                )


def _check_exclusions(
    suite: Suite, registry: Registry, lines: dict[tuple[Any, ...], int], problems: _Problems
) -> None:
    # A rule naming a key its block lacks (a typo) would silently exclude nothing. A rule's
    # server values are read as the block's are ("16" is 16), so that they compare equal.
    for index, rule in enumerate(suite.exclude):
        for block_name, rule_block, block in (
            ("server", rule.server, suite.server),
            ("benchmark", rule.benchmark, suite.benchmark),
        ):
            for key, value in rule_block.items():
                loc = ("exclude", index, block_name, key)
                if key not in block:
                    problems.add(
                        _nearest_line(lines, loc),
                        f"exclude[{index}].{block_name}.{key} is not a key of '{block_name}'"
                        f"{did_you_mean(key, list(block))}; the rule would exclude nothing",
                    )
                    continue
                resolved = registry.resolve(key) if block_name == "server" else None
                if resolved is not None and value is not None:
                    option, path = resolved
                    try:
                        rule_block[key] = (
                            option.check_field(path, value) if path else option.check(value)
                        )
                    except ValueError as error:
                        problems.add(
                            _nearest_line(lines, loc),
                            f"exclude[{index}].server.{key}: {error}{_shown_input(loc, value)}",
                        )
