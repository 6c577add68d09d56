"""`profllm plan PATH...`: the servers and cases `pytest PATH...` would run, starting nothing
(the preview itself is plan_preview.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pytest_profllm.cli.errors import CliError
from pytest_profllm.cli.plan_preview import plan_document, plan_lines, shown_id
from pytest_profllm.engine.choice import ENGINE_CHOICES, EngineUnavailable, choose_engine
from pytest_profllm.hosts.nvml import discover
from pytest_profllm.options import DEFAULT_SUITE_GLOB
from pytest_profllm.session.collect import CollectionFailed, collect_cases


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        "plan",
        help="print the servers (argv, environment) and cases pytest would run, starting nothing",
        description="Collect the benchmark cases `pytest PATH...` would run, as pytest collects "
        f"them (suite files named {DEFAULT_SUITE_GLOB}, and tests marked "
        "@pytest.mark.profllm), and print each server's command line and its cases, without "
        "starting anything. Axis values are shown beside each server and case.",
    )
    plan.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="suite files, test files, or folders searched as pytest searches them",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a listing")
    plan.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        help="whose command line to print (default: the engine a run would pick: "
        "--profllm-engine's ini value, else auto)",
    )
    plan.add_argument(
        "--profllm-out",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="the --profllm-out of the run, for the trace folders of profiling servers "
        "(default: results)",
    )
    plan.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    for path in args.paths:
        if not path.exists():
            raise CliError(f"{path}: no such file or folder")
    pytest_args = [str(path) for path in args.paths]
    engine, reason = args.engine, "--engine " + str(args.engine)
    if engine is not None:
        # A plan of vLLM's command lines is useful where vLLM cannot run (a laptop): the
        # collection then checks suites as a simulated run would.
        runnable = engine != "vllm" or _can_run_vllm()
        pytest_args.append(f"--profllm-engine={engine if runnable else 'sim'}")
    try:
        collected = collect_cases(pytest_args)
    except CollectionFailed as error:
        hint = ""
        if str(error).startswith("not found:"):
            hint = f" (pytest collects suite files named {DEFAULT_SUITE_GLOB}, or as the ini "
            hint += "option profllm_suite_glob says)"
        raise CliError(f"{error}{hint}") from None
    if collected.errors:
        raise CliError("\n".join(collected.errors))
    for path in args.paths:
        if path.suffix in (".yaml", ".yml") and path.name not in collected.suite_files:
            raise CliError(
                f"{path}: pytest does not collect it as a suite (suite files are named "
                f"{collected.suite_glob}, ini option profllm_suite_glob)"
            )
    if engine is None or engine == "auto":
        choice = collected.engine
        engine, reason = (choice.name, choice.reason) if choice else ("sim", "no cases")
    cases = [
        (shown_id(nodeid, collected.paths.get(nodeid)), case) for nodeid, case in collected.cases
    ]
    document = plan_document(cases, engine, reason, args.profllm_out / "profiles")
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(plan_lines(document)))
    return 0


def _can_run_vllm() -> bool:
    try:
        choose_engine("vllm", len(discover().gpus))
    except EngineUnavailable:
        return False
    return True
