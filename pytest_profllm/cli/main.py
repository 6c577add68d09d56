"""The `profllm` command: thin wrappers over the library, one clean error line at the edge."""

from __future__ import annotations

import argparse
import ast
import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from pytest_profllm.cli import keeping, rerun
from pytest_profllm.cli.calibrate import (
    CalibrationError,
    calibrate,
    report_lines,
    write_profile,
)
from pytest_profllm.cli.plan_preview import plan_document, plan_lines, shown_id
from pytest_profllm.engine.choice import ENGINE_CHOICES, EngineUnavailable, choose_engine
from pytest_profllm.engine.registry import DATA_FILE, Registry, RegistryError, bundled, generate
from pytest_profllm.gates import history
from pytest_profllm.hosts.files import write_atomic
from pytest_profllm.hosts.nvml import discover
from pytest_profllm.load.bench import (
    BenchFailed,
    ServerUnreachable,
    result_path,
    run_bench,
    summary_lines,
)
from pytest_profllm.load.capacity import Probe, describe_probe, search_server
from pytest_profllm.load.dataset import DatasetError
from pytest_profllm.options import DEFAULT_SUITE_GLOB
from pytest_profllm.plan.regression import parse_tolerance
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig, CapacitySearch
from pytest_profllm.results import store
from pytest_profllm.results.ingest import IngestError, ingest, record_files
from pytest_profllm.results.record import json_schema, write_requests
from pytest_profllm.results.schema_version import NewerSchema, refuse_newer_file
from pytest_profllm.run.outcome import request_row
from pytest_profllm.session.collect import CollectionFailed, collect_cases
from pytest_profllm.sim.cli import main as sim_main


class CliError(Exception):
    """A problem to report (one line per problem) with an exit status, 2 unless given."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# The exit statuses of every command, listed in `profllm --help`.
EXIT_OK = 0
EXIT_NOTHING_MEASURED = 1
EXIT_USAGE = 2
EXIT_INVALID = 3
EXIT_UNREACHABLE = 4
_EXIT_CODES = f"""exit status:
  {EXIT_OK}  success
  {EXIT_NOTHING_MEASURED}  bench: nothing was measured, or a request failed (a non-200 status, an
     error in its stream, a stream cut or stalled), or no output token;
     calibrate: the runs are too few or too alike to fit (the line says which would help)
     ingest, rebuild: a file was refused; check: a problem (the summary names the runs)
  {EXIT_USAGE}  a usage error: a bad flag, a bad suite, a file that cannot be read
  {EXIT_INVALID}  bench: an invalid measurement (the client fell behind its schedule, or the
     server's token counts cannot be believed)
  {EXIT_UNREACHABLE}  bench: cannot connect to the server
  sim exits as a server does: 0 after SIGTERM or SIGINT, 1 or 2 when it cannot start"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profllm",
        description="vLLM serving benchmarks as pytest tests: tools around them.",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    ingest = commands.add_parser(
        "ingest",
        help="load record files into a results database",
        description="Load JSON records (files, or folders of them), and `profllm bench "
        "--save-result` files (as records of suite `bench`), into the benchmark_runs table. "
        "Every good file is loaded and every bad one refused whole, named with its reason; "
        "a record already there is counted as unchanged. Exit status 1 when a file was "
        "refused, 2 when a path does not exist or the database cannot be written (locked by "
        "another process, a full disk): then nothing is loaded.",
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
        "pytest_profllm/engine/data/engine_args.json)",
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
        "token came back exits 1, a client that fell behind its schedule exits 3, and a "
        "server that cannot be reached exits 4 (one line: cannot connect to URL: why).",
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=_bench)

    history = commands.add_parser(
        "history",
        help="find where a metric shifted in a results database's history (change points)",
        description="For every fingerprint (server configuration, workload, engine and "
        "version, devices) in DB, find the sessions after which a metric's mean shifted "
        "(ruptures' PELT over per-session means), print them and store them in the "
        "change_points table, which Datasette shows.",
    )
    history.add_argument("db", type=Path, metavar="DB", help="a results.db written by a run")
    history.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="a result metric, repeatable (default: output_throughput, median_ttft_ms, "
        "median_tpot_ms)",
    )
    history.add_argument(
        "--case", metavar="PATTERN", help="only case ids LIKE this SQL pattern (default: all)"
    )
    history.add_argument(
        "--min-change",
        default="5%",
        metavar="PERCENT",
        help="smallest shift of the mean reported (default: 5%%)",
    )
    history.add_argument(
        "--any-version",
        action="store_true",
        help="one history across engine versions (the version left out of the fingerprint)",
    )
    history.set_defaults(handler=_history)

    calibrate_ = commands.add_parser(
        "calibrate",
        help="fit the simulated engine's device profile to one host's own vLLM runs",
        description="Fit the simulator's overheads (matmul rate and bandwidth shares, cost "
        "per step, per running sequence and per streamed token, the API server's latency) "
        "to the valid vLLM runs in DB of one device, vLLM version and model, replaying each "
        "on the simulator's virtual clock. Prints every run's leave-one-configuration-out "
        "error on throughput, median TTFT, TPOT and ITL; refuses (exit status 1, one line) "
        "runs too few or too alike to fit, saying which runs would help. Use the profile "
        "with --profllm-sim-profile.",
    )
    calibrate_.add_argument("db", type=Path, metavar="DB", help="a results.db written by a run")
    calibrate_.add_argument(
        "--where",
        metavar="SQL",
        help="an SQL condition on benchmark_runs' columns that picks the runs (default: all "
        "valid vLLM runs)",
    )
    calibrate_.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="PROFILE.toml",
        help="write the fitted profile there (default: print the errors only)",
    )
    calibrate_.add_argument(
        "--base",
        metavar="NAME",
        help="the shipped profile to start from (default: the one the runs' GPU name matches)",
    )
    calibrate_.add_argument(
        "--hold-out",
        metavar="SQL",
        help="an SQL condition that picks runs to leave out of the fit and predict by it "
        "(say, the configurations you have not planned on), instead of leaving each "
        "configuration out in turn",
    )
    calibrate_.set_defaults(handler=_calibrate)
    keeping.add_commands(commands)

    rerun_ = commands.add_parser(
        "rerun",
        help="re-run one past case from its record, gated against it",
        description="Write the suite that reproduces one run's case from its record (server, "
        "workload with its seed, thresholds, regression, engine and simulated device), name "
        "each way this host differs from the record's, then run it with pytest, gated "
        "against the run's database (or records). Exit status 0 where the new run has the "
        "same fingerprint and every gated metric is unchanged, 1 where not, 2 where the run "
        "cannot be re-run (one line says why).",
    )
    rerun.add_arguments(rerun_)
    rerun_.set_defaults(handler=_rerun)

    # `profllm sim ...` is handed to the simulator's own parser before this one (see main);
    # listed here for `profllm --help`.
    commands.add_parser(
        "sim",
        help="run the simulated engine: profllm sim MODEL [vllm serve arguments] "
        "(profllm sim --help lists them)",
        add_help=False,
    )
    return parser


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s flags that profllm implements, with vLLM's defaults."""
    add = parser.add_argument
    add("--backend", choices=_choices("backend"), default="openai",
        help="openai-chat for the media datasets (random-mm, custom_image, custom_audio); "
        "openai-embeddings and vllm-rerank (with --dataset-name random-rerank) for pooling")
    add("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", help="API path (default: the backend's, /v1/completions or "
        "/v1/chat/completions)")
    add("--model", required=True, help="the model the server serves")
    add("--served-model-name", help="the name to send (default: --model)")
    add("--tokenizer", help="local tokenizer folder (default: the server's /tokenize)")
    # Every dataset a suite takes (plan/suite.py), so the two never drift apart.
    add("--dataset-name", choices=_choices("dataset_name"), default="random",
        help="conversation (not a vLLM dataset): multi-turn sessions on --backend "
        "openai-chat, --num-prompts of them")
    add("--dataset-path", help="a local file: sharegpt (JSON), custom (JSON lines), "
        "timed_trace (JSON lines, or a CSV of timestamp,input_len,output_len), conversation "
        "(a ShareGPT JSON file; default: synthetic turns), burstgpt (CSV), spec_bench "
        "(question.jsonl), speed_bench (the folder of its prepare script), custom_image and "
        "custom_audio (JSON lines)")
    add("--num-prompts", type=int, default=1000)
    add(
        "--seed", type=int, default=None,
        help="the prompts' seed (default: 0 where the server's prefix cache can be emptied, "
        "else a fresh one each run, printed)",
    )
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0)
    add("--random-prefix-len", type=int, default=0)
    # Left out, a dataset's own flags are not sent on: the workload refuses them elsewhere.
    add("--random-batch-size", type=int,
        help="pooling: inputs per request (random-rerank: documents per query; default: 1)")
    add("--random-mm-base-items-per-request", type=int, help="default: 1")
    add("--random-mm-num-mm-items-range-ratio", type=float, help="default: 0")
    add("--random-mm-limit-mm-per-prompt", metavar="JSON",
        help='e.g. \'{"image": 3, "video": 0}\' (default: {"image": 255, "video": 1})')
    add("--random-mm-bucket-config", metavar="DICT",
        help="(height, width, frames) -> probability, as vLLM's: '{(256, 256, 1): 0.5, "
        "(720, 1280, 1): 0.5}' (default: those two and (720, 1280, 16): 0)")
    add("--prefix-repetition-prefix-len", type=int, default=256)
    add("--prefix-repetition-suffix-len", type=int, default=256)
    add("--prefix-repetition-num-prefixes", type=int, default=10)
    add("--prefix-repetition-output-len", type=int, default=128)
    add("--sharegpt-output-len", type=int)
    add("--custom-output-len", type=int, default=256)
    add("--spec-bench-output-len", type=int, help="default: 256")
    add("--spec-bench-category", help="default: every category")
    add("--speed-bench-dataset-subset", choices=_choices("speed_bench_dataset_subset"),
        help="default: qualitative")
    add("--speed-bench-output-len", type=int, help="default: 4096")
    add("--speed-bench-category", help="default: every category")
    add("--timed-trace-chunk-hash-size", type=int, help="tokens per hash id (default: 16)")
    add("--timed-trace-sec-multiplier", type=float,
        help="timestamp x this = seconds (default: 1; 0.001 for milliseconds)")
    add("--timed-trace-label-timestamp", help="the timestamp's field (default: timestamp)")
    add("--timed-trace-label-input-length", help="default: input_length")
    add("--timed-trace-label-output-length", help="default: output_length")
    add("--timed-trace-label-hash-ids", help="default: hash_ids")
    add("--self-timed", action=argparse.BooleanOptionalAction, default=None,
        help="send a trace's requests at their recorded times (default: on for timed_trace)")
    add("--trace-speedup", type=float, help="replay a self-timed trace this many times as "
        "fast (not a vLLM flag; default: 1)")
    add("--trace-target-rate", type=float, help="replay a self-timed trace at this mean "
        "rate, req/s (not a vLLM flag)")
    add("--trace-start-s", type=float, help="start this many seconds into the trace (not a "
        "vLLM flag)")
    add("--trace-duration-s", type=float, help="replay this many seconds of the trace (not "
        "a vLLM flag)")
    add("--conversation-turns", type=int, help="synthetic conversations' turns (default: 4)")
    add("--conversation-input-len", type=int,
        help="a synthetic turn's user message in tokens (default: 128)")
    add("--conversation-output-len", type=int,
        help="a synthetic turn's answer in tokens (default: 64)")
    add("--conversation-range-ratio", type=float,
        help="synthetic lengths drawn within +-this fraction (default: 0)")
    add("--conversation-think-time-s", type=float,
        help="mean pause between an answer and the next turn (default: 0)")
    add("--conversation-think-time-distribution", choices=("fixed", "exponential", "uniform"),
        help="of the pause; uniform is on [0, 2 x mean] (default: exponential)")
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
    add("--max-schedule-lag", type=float, metavar="MS", help="a load whose client sent its "
        "requests later than this after their scheduled times (p99), or whose simulated "
        "engine fell this far behind, is invalid; raise it on a busy host (not a vLLM flag; "
        "default: 10)")
    add("--label")
    add("--save-result", action="store_true", help="write the result JSON (and per-request "
        "records beside it, .requests.jsonl.gz)")
    add("--save-detailed", action="store_true", help="keep the per-request lists in the JSON")
    add("--result-dir")
    add("--result-filename")
    search = parser.add_argument_group(
        "capacity search", "with --slo, search the highest load that meets every SLO (not "
        "vLLM flags): one line per probe, then the capacity and its bracket")
    search.add_argument("--slo", action="append", metavar="NAME=VALUE",
                        help="an SLO, repeatable: p99_ttft_ms=500, median_tpot_ms=50, "
                        "goodput_ratio=0.9 (of requests within --goodput)")
    defaults = CapacitySearch()
    search.add_argument("--search-over", choices=("request_rate", "max_concurrency"),
                        default=defaults.over)
    search.add_argument("--search-low", type=float, default=defaults.low)
    search.add_argument("--search-high", type=float, default=defaults.high)
    search.add_argument("--search-precision", default="5%",
                        help="stop when the bracket is this narrow (default: 5%%)")
    search.add_argument("--search-max-probes", type=int, default=defaults.max_probes)
    search.add_argument("--search-max-time-s", type=float, default=defaults.max_time_s)
    search.add_argument("--search-min-duration-s", type=float, default=defaults.min_duration_s,
                        help="a rate probe sends for at least this long (default: %(default)s)")
    search.add_argument("--search-confirm", type=int, default=defaults.confirm,
                        help="independent runs a load must meet on (default: %(default)s)")


# The commands whose DB argument is a results database they read or write.
_READS_DB = frozenset(("ingest", "history", "calibrate", "check", "backup"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        # Everything after `sim` is the simulator's (its own -h/--help included): argparse's
        # REMAINDER would refuse an option first.

        return sim_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in _READS_DB:
            # A database a newer plugin wrote: one line, before any command reads it.
            refuse_newer_file(args.db)
        result: int = args.handler(args)
        return result
    except NewerSchema as error:
        print(f"profllm {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (CliError, keeping.KeepingError) as error:
        prefix = f"profllm {args.command}: "
        print(prefix + str(error).replace("\n", "\n" + prefix), file=sys.stderr)
        return error.code


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


def _ingest(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for ingest's progress bar.
    from tqdm import tqdm

    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}")
    files = record_files(args.paths)
    # A bar on a terminal only (tqdm's disable=None), for loads long enough to need one.
    with tqdm(total=len(files), unit="file", disable=None if len(files) > 200 else True,
              leave=False) as bar:

        def advance(count: int) -> None:
            bar.update(count)

        try:
            report = ingest(args.db, files, advance)
        except IngestError as error:
            raise CliError(f"{error}: nothing loaded") from None
        except NewerSchema as error:
            raise CliError(str(error)) from None
        except (sqlite3.Error, OSError) as error:
            what = (f"still locked by another process after {store.BUSY_TIMEOUT_MS / 1000:g} s"
                    if "locked" in str(error)
                    else getattr(error, "strerror", None) or str(error))
            raise CliError(f"{args.db}: {what}: nothing loaded") from None
    for path, reason in report.refused:
        print(f"profllm ingest: refused {path}: {reason}", file=sys.stderr)
    print(report.summary(args.db))
    return 1 if report.refused else 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.output is not None:
        _check_output(args.output)  # before the fit, which takes minutes
    try:
        calibration = calibrate(args.db, args.where, args.base, hold_out=args.hold_out)
    except CalibrationError as error:
        raise CliError(str(error), error.code) from None
    for line in report_lines(calibration):
        print(line)
    if args.output is not None:
        write_profile(calibration, args.output)
        print(f"profile written to {args.output}: --profllm-sim-profile {args.output}")
    return 0


def _check_output(path: Path) -> None:
    """A profile file may be written at `path`: not a folder, in a folder that exists (made
    by nobody but the user: a mistyped path must not become folders)."""
    if path.is_dir():
        raise CliError(f"-o {path}: is a folder; name the profile file to write")
    if not path.parent.is_dir():
        raise CliError(f"-o {path}: no such folder {path.parent}")


def _history(args: argparse.Namespace) -> int:
    if not args.db.is_file():
        raise CliError(f"{args.db}: no such database")
    try:
        min_change = parse_tolerance(args.min_change)
    except ValueError as error:
        raise CliError(f"--min-change: {error}") from None
    found: list[history.Finding] = []
    for metric in args.metric or ["output_throughput", "median_ttft_ms", "median_tpot_ms"]:
        try:
            count, findings = history.analyse(
                args.db, metric, args.case, min_change, args.any_version
            )
        except ValueError as error:
            raise CliError(str(error)) from None
        for finding in findings:
            point = finding.change.point
            print(
                f"{finding.case_id} [{finding.fingerprint}] {metric}: "
                f"{finding.change.before:.4g} -> {finding.change.after:.4g} "
                f"({finding.change.change:+.1%}) from session {point.key} (run {point.run_id})"
            )
        print(f"{metric}: {len(findings)} change point(s) in {count} history(ies)")
        found += findings
    history.save(args.db, found)
    return 0


def _rerun(args: argparse.Namespace) -> int:
    try:
        return rerun.command(args)
    except rerun.RerunError as error:
        raise CliError(str(error)) from None


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


def _engine_args(args: argparse.Namespace) -> int:
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


def _choices(field: str) -> tuple[str, ...]:
    """The values a suite takes for one of the workload's Literal fields."""
    return tuple(str(value) for value in get_args(BenchmarkConfig.model_fields[field].annotation))


def _json_object(flag: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: {text[:80]!r} is not a JSON object such as "
                       '\'{"image": 1, "video": 0}\'')
    return value


def _bucket_config(flag: str, text: str) -> dict[str, Any]:
    """vLLM's Python literal with (height, width, frames) keys, as the suite's "(h, w, f)"
    strings (plan/suite.py checks them)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise CliError(f"{flag}: {text[:80]!r} is not a dict such as "
                       "'{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}'")
    return {
        "(" + ", ".join(str(part) for part in key) + ")" if isinstance(key, tuple) else str(key):
        probability for key, probability in value.items()
    }


def _bench(args: argparse.Namespace) -> int:
    values = {
        key: value
        for key, value in vars(args).items()
        if key in BenchmarkConfig.model_fields and value is not None
    }
    if args.goodput:
        values["goodput"] = _goodput(args.goodput)
    if args.random_mm_limit_mm_per_prompt is not None:
        values["random_mm_limit_mm_per_prompt"] = _json_object(
            "--random-mm-limit-mm-per-prompt", args.random_mm_limit_mm_per_prompt
        )
    if args.random_mm_bucket_config is not None:
        values["random_mm_bucket_config"] = _bucket_config(
            "--random-mm-bucket-config", args.random_mm_bucket_config
        )
    if args.slo:
        values.update(kind="capacity", slo=_slos(args.slo), search={
            key.removeprefix("search_"): value for key, value in vars(args).items()
            if key.startswith("search_")})
    model = CapacityConfig if args.slo else BenchmarkConfig
    try:
        config = model.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if first["loc"]:
            # The flag (--search-low is search.low), then where inside its value (a dict's
            # key), and what was given.
            parts = [str(part) for part in first["loc"]]
            flag, *inside = ["_".join(parts[:2]), *parts[2:]] if parts[0] == "search" else parts
            where = "--" + flag.replace("_", "-") + "".join(f"[{part}]" for part in inside)
            message = f"{where}: {message} (got {repr(first.get('input'))[:80]})"
        raise CliError(message.replace("\n", " ")) from None
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    if isinstance(config, CapacityConfig):
        return _bench_capacity(config, base_url, args)
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
            max_schedule_lag_ms=args.max_schedule_lag,
        )
    except ServerUnreachable as error:
        raise CliError(str(error), EXIT_UNREACHABLE) from None
    except BenchFailed as error:
        raise CliError(str(error), EXIT_NOTHING_MEASURED) from None
    except DatasetError as error:
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
        return EXIT_INVALID
    return EXIT_OK


def _bench_capacity(config: CapacityConfig, base_url: str, args: argparse.Namespace) -> int:
    def show(probe: Probe) -> None:
        print(describe_probe(probe, config.search.over), flush=True)

    try:
        done = search_server(
            config,
            base_url,
            args.model,
            served_model_name=args.served_model_name,
            tokenizer=args.tokenizer,
            api_key=os.environ.get("OPENAI_API_KEY"),
            endpoint=args.endpoint,
            label=args.label,
            on_probe=show,
            max_schedule_lag_ms=args.max_schedule_lag,
        )
    except ServerUnreachable as error:
        raise CliError(str(error), EXIT_UNREACHABLE) from None
    except DatasetError as error:
        raise CliError(str(error)) from None
    print(done.found.describe())
    if args.save_result:
        path = result_path(config, args.model, args.label, args.result_dir, args.result_filename)
        write_atomic(path, json.dumps(done.result).encode())
        print(f"result: {path}")
    if (invalid := done.found.invalid_reason()) is not None:
        # Its capacity is no measurement of the server: exit as any invalid measurement does.
        print(f"profllm bench: invalid measurement: {invalid}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK if done.found.capacity is not None else EXIT_NOTHING_MEASURED


def _slos(pairs: list[str]) -> dict[str, float]:
    slos = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            slos[key.strip()] = float(value)
        except ValueError:
            raise CliError(f"--slo: {pair!r} is not NAME=VALUE (e.g. p99_ttft_ms=500)") from None
    return slos


def _goodput(pairs: list[str]) -> dict[str, float]:
    goodput = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        try:
            goodput[key.strip()] = float(value)
        except ValueError:
            raise CliError(f"--goodput: {pair!r} is not KEY:MILLISECONDS") from None
    return goodput


if __name__ == "__main__":
    sys.exit(main())
