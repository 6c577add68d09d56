"""The `profllm` command: thin wrappers over the library, one clean error line at the edge."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_profllm.options import DEFAULT_SUITE_GLOB


class CliError(Exception):
    """A problem to report as one line and exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profllm", description="vLLM serving benchmarks as pytest tests: tools around them."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = commands.add_parser(
        "plan",
        help="print the servers (argv, environment) and cases of suites, starting nothing",
        description="Expand suite files into servers and cases without starting anything.",
    )
    plan.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help=f"suite files, or folders searched for {DEFAULT_SUITE_GLOB}",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a listing")
    plan.add_argument(
        "--engine",
        choices=("vllm", "sim"),
        default="vllm",
        help="whose command line to print (default: vllm)",
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

    ingest = commands.add_parser(
        "ingest",
        help="load record files into a results database",
        description="Load JSON records (files, or folders of them) into the benchmark_runs table. "
        "Loading a record again changes nothing.",
    )
    ingest.add_argument("db", type=Path, metavar="DB", help="SQLite file (created if missing)")
    ingest.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="record files or folders holding them"
    )
    ingest.set_defaults(handler=_ingest)

    schema = commands.add_parser(
        "schema",
        help="print the JSON Schema of the record",
        description="Print the JSON Schema of a benchmark record (schema version 1).",
    )
    schema.set_defaults(handler=_schema)

    engine_args = commands.add_parser(
        "engine-args",
        help="the registry of vLLM engine arguments: list it, or regenerate it from a vLLM",
        description="Without --python: summarise (or --list) the registry shipped with the "
        "package. With --python: read every `vllm serve` option from the parser of the vLLM "
        "that Python imports (VLLM_TARGET_DEVICE=cpu unless set), and write the registry file.",
    )
    engine_args.add_argument(
        "--python",
        metavar="PY",
        help="a Python that imports vLLM, e.g. /path/to/venv/bin/python (default: none; "
        "the bundled registry is shown)",
    )
    engine_args.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="PATH",
        help="where --python writes the registry (default: the package's own "
        "pytest_profllm/data/engine_args.json)",
    )
    engine_args.add_argument(
        "--list", action="store_true", help="print one line per option instead"
    )
    engine_args.set_defaults(handler=_engine_args)

    sim = commands.add_parser(
        "sim",
        help="run the simulated engine: profllm sim MODEL [vllm serve arguments]",
        description="Run the simulated engine with `vllm serve` arguments.",
        add_help=False,
    )
    sim.add_argument("args", nargs=argparse.REMAINDER)
    sim.set_defaults(handler=_sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.handler(args)
        return result
    except CliError as error:
        print(f"profllm {args.command}: {error}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from pytest_profllm.plan import plan_document, plan_lines
    from pytest_profllm.suite import SuiteError

    try:
        document = plan_document(args.paths, args.engine, args.profllm_out / "profiles")
    except (SuiteError, FileNotFoundError) as error:
        raise CliError(str(error)) from None
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(plan_lines(document)))
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from pytest_profllm.store import load_records, read_record_files, record_files

    files = record_files(args.paths)
    missing = [str(path) for path in files if not path.exists()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}")
    try:
        records = read_record_files(files)
    except ValueError as error:
        raise CliError(str(error)) from None
    count = load_records(args.db, records)
    print(f"loaded {count} record(s) into {args.db} (table benchmark_runs)")
    return 0


def _schema(args: argparse.Namespace) -> int:
    from pytest_profllm.record import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _engine_args(args: argparse.Namespace) -> int:
    import os

    from pytest_profllm.engine_args import DATA_FILE, Registry, RegistryError, bundled, generate

    try:
        if args.python is None:
            if args.output is not None:
                raise CliError("--output needs --python (the vLLM to read the options from)")
            registry = bundled()
            where = f"bundled: {DATA_FILE}"
        else:
            env = {} if "VLLM_TARGET_DEVICE" in os.environ else {"VLLM_TARGET_DEVICE": "cpu"}
            data = generate(args.python, with_help=True, env=env)
            registry = Registry.from_json(data, "live")
            where = str(args.output or DATA_FILE)
            if not args.list:
                from pytest_profllm.record import write_atomic

                write_atomic(Path(where), (json.dumps(data, indent=1) + "\n").encode())
    except RegistryError as error:
        raise CliError(str(error)) from None
    if args.list:
        for option in registry.options.values():
            default = json.dumps(option.default)
            default = default if len(default) <= 40 else default[:37] + "..."
            print(f"{option.name}\t{option.kind}\t{option.group}\t{default}")
        return 0
    verb = "wrote" if args.python else "has"
    print(f"{len(registry)} engine arguments of vLLM {registry.vllm_version} ({verb} {where})")
    return 0


def _sim(args: argparse.Namespace) -> Any:
    from pytest_profllm.sim.__main__ import main as sim_main

    return sim_main(args.args)


if __name__ == "__main__":
    sys.exit(main())
