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
        description="Load JSON records (files, or folders of them), and `profllm bench "
        "--save-result` files (as records of suite `bench`), into the benchmark_runs table. "
        "Every good file is loaded and every bad one refused whole, named with its reason; "
        "a record already there is counted as unchanged. Exit status 1 when a file was "
        "refused, 2 when a path does not exist.",
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
    bench = commands.add_parser(
        "bench",
        help="benchmark a running server, as `vllm bench serve` (same flags, same result keys)",
        description="Send a workload to a running OpenAI-compatible server and report vLLM's "
        "serving metrics. Flags and defaults are those of `vllm bench serve`; unlike it, a "
        "benchmark where every request failed, any request got a non-200 status, or no output "
        "token came back exits 1, and a client that fell behind its schedule exits 3.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=_bench)

    sim = commands.add_parser(
        "sim",
        help="run the simulated engine: profllm sim MODEL [vllm serve arguments]",
        description="Run the simulated engine with `vllm serve` arguments.",
        add_help=False,
    )
    sim.add_argument("args", nargs=argparse.REMAINDER)
    sim.set_defaults(handler=_sim)
    return parser


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s flags that profllm implements, with vLLM's defaults."""
    add = parser.add_argument
    add("--backend", choices=("openai", "openai-chat"), default="openai")
    add("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", help="API path (default: the backend's, /v1/completions or "
        "/v1/chat/completions)")
    add("--model", required=True, help="the model the server serves")
    add("--served-model-name", help="the name to send (default: --model)")
    add("--tokenizer", help="local tokenizer folder (default: the server's /tokenize)")
    add("--dataset-name", choices=("random", "prefix_repetition", "sharegpt", "custom"),
        default="random")
    add("--dataset-path", help="local file for sharegpt (JSON) and custom (JSON lines)")
    add("--num-prompts", type=int, default=1000)
    add("--seed", type=int, default=0)
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0)
    add("--random-prefix-len", type=int, default=0)
    add("--prefix-repetition-prefix-len", type=int, default=256)
    add("--prefix-repetition-suffix-len", type=int, default=256)
    add("--prefix-repetition-num-prefixes", type=int, default=10)
    add("--prefix-repetition-output-len", type=int, default=128)
    add("--sharegpt-output-len", type=int)
    add("--custom-output-len", type=int, default=256)
    add("--request-rate", type=float, default=float("inf"))
    add("--burstiness", type=float, default=1.0)
    add("--max-concurrency", type=int)
    add("--ramp-up-strategy", choices=("linear", "exponential"))
    add("--ramp-up-start-rps", type=float)
    add("--ramp-up-end-rps", type=float)
    add("--num-warmups", type=int, default=0)
    add("--goodput", nargs="+", metavar="KEY:MS", help="service level objectives, e.g. ttft:500")
    add("--percentile-metrics", default="ttft,tpot,itl")
    add("--metric-percentiles", default="99")
    add("--ignore-eos", action="store_true")
    add("--temperature", type=float, help="(default: not sent; the server's default applies)")
    add("--request-timeout-s", type=float, default=6 * 60 * 60)
    add("--client-processes", type=int, default=1, help="spread the client over N processes "
        "when one event loop cannot keep up with the server (not a vLLM flag; default: 1)")
    add("--label")
    add("--save-result", action="store_true", help="write the result JSON (and per-request "
        "records beside it, .requests.jsonl.gz)")
    add("--save-detailed", action="store_true", help="keep the per-request lists in the JSON")
    add("--result-dir")
    add("--result-filename")


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
    from tqdm import tqdm

    from pytest_profllm.ingest import ingest, record_files

    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}")
    files = record_files(args.paths)
    # A bar on a terminal only (tqdm's disable=None), for loads long enough to need one.
    with tqdm(total=len(files), unit="file", disable=None if len(files) > 200 else True,
              leave=False) as bar:

        def advance(count: int) -> None:
            bar.update(count)

        report = ingest(args.db, files, advance)
    for path, reason in report.refused:
        print(f"profllm ingest: refused {path}: {reason}", file=sys.stderr)
    print(report.summary(args.db))
    return 1 if report.refused else 0


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


def _bench(args: argparse.Namespace) -> int:
    import os

    from pydantic import ValidationError

    from pytest_profllm.bench import BenchFailed, result_path, run_bench, summary_lines
    from pytest_profllm.dataset import DatasetError
    from pytest_profllm.record import write_atomic, write_requests
    from pytest_profllm.runner import request_row
    from pytest_profllm.suite import BenchmarkConfig

    values = {
        key: value
        for key, value in vars(args).items()
        if key in BenchmarkConfig.model_fields and value is not None
    }
    if args.goodput:
        values["goodput"] = _goodput(args.goodput)
    try:
        config = BenchmarkConfig.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if first["loc"]:
            flag = "--" + "-".join(str(part) for part in first["loc"]).replace("_", "-")
            message = f"{flag}: {message} (got {first.get('input')!r})"
        raise CliError(message) from None
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        done = run_bench(
            config,
            base_url,
            args.model,
            served_model_name=args.served_model_name,
            tokenizer=args.tokenizer,
            api_key=os.environ.get("OPENAI_API_KEY"),
            endpoint=args.endpoint,
            label=args.label,
            save_detailed=args.save_detailed,
        )
    except (BenchFailed, DatasetError) as error:
        raise CliError(str(error)) from None
    print("\n".join(summary_lines(done.result)))
    if args.save_result:
        path = result_path(config, args.model, args.label, args.result_dir, args.result_filename)
        write_atomic(path, json.dumps(done.result).encode())
        rows = [
            request_row(index, outcome, done.load.clock_start)
            for index, outcome in enumerate(done.load.outcomes)
        ]
        write_requests(path.parent, path.stem, rows)
        print(f"result: {path}")
    if done.invalid_reason:
        print(f"profllm bench: invalid measurement: {done.invalid_reason}", file=sys.stderr)
        return 3
    return 0


def _goodput(pairs: list[str]) -> dict[str, float]:
    goodput = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        try:
            goodput[key.strip()] = float(value)
        except ValueError:
            raise CliError(f"--goodput: {pair!r} is not KEY:MILLISECONDS") from None
    return goodput


def _sim(args: argparse.Namespace) -> Any:
    from pytest_profllm.sim.__main__ import main as sim_main

    return sim_main(args.args)


if __name__ == "__main__":
    sys.exit(main())
