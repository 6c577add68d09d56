"""`profllm bench`: a running server benchmarked as `vllm bench serve` does, with its flags and
result keys (load/bench.py), or searched for its capacity under SLOs (load/capacity.py)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, get_args

from pydantic import ValidationError

from pytest_profllm.cli.errors import (
    EXIT_INVALID,
    EXIT_NOTHING_MEASURED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    CliError,
)
from pytest_profllm.hosts.files import write_atomic
from pytest_profllm.load.bench import BenchFailed, ServerUnreachable, run_bench
from pytest_profllm.load.bench_result import result_path, summary_lines
from pytest_profllm.load.capacity import Probe, describe_probe, search_server
from pytest_profllm.load.dataset import DatasetError
from pytest_profllm.load.metrics import MAX_CLIENT_RUNQUEUE_WAIT_SHARE
from pytest_profllm.load.server_view import (
    DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
)
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig, CapacitySearch
from pytest_profllm.results.record_files import write_requests
from pytest_profllm.run.outcome import request_row


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "requests later than this after their scheduled times (p99), whose event loop ran "
        "this late (p99), or whose simulated engine fell this far behind, is invalid; raise "
        "it on a busy host (not a vLLM flag; default: 10)")
    add("--max-client-overhead", type=float, metavar="MS", default=DEFAULT_MAX_CLIENT_OVERHEAD_MS,
        help="a load to which the client added more than this to the server's own mean TTFT "
        "is invalid, where the server is on this host (not a vLLM flag; default: "
        f"{DEFAULT_MAX_CLIENT_OVERHEAD_MS:g}, or 15%% of the server's mean TTFT where larger, "
        "as --profllm-max-client-overhead)")
    add("--max-client-overhead-tail", type=float, metavar="MS",
        default=DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
        help="with --spans-port, a load to which the client added more than this to a "
        "request's TTFT at p99 (over its server span's) is invalid, where the server is on "
        f"this host (not a vLLM flag; default: {DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS:g}, or 15%% "
        "of the server's p99 TTFT where larger, as --profllm-max-client-overhead-tail)")
    add("--max-client-wait", type=float, metavar="SHARE",
        default=MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
        help="a load whose client waited for a core more than this share of it is invalid "
        f"(not a vLLM flag; default: {MAX_CLIENT_RUNQUEUE_WAIT_SHARE:g}, as "
        "--profllm-max-client-wait)")
    add("--spans-port", type=_port, metavar="PORT",
        help="receive the server's per-request trace spans on 127.0.0.1:PORT (start it with "
        "--otlp-traces-endpoint http://127.0.0.1:PORT/v1/traces; vLLM also with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf): each request's span is joined to "
        "it, what the client added is reported at p50, p90, p99 and its tail judged (not a "
        "vLLM flag)")
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
        if args.spans_port is not None:
            raise CliError("--spans-port: a capacity search (--slo) joins no spans; leave "
                           "one of them out")
        return _bench_capacity(config, base_url, args)
    with _receiver(args.spans_port) as receiver:
        try:
            done = run_bench(config, base_url, args.model, save_detailed=args.save_detailed,
                             receiver=receiver,
                             max_client_overhead_p99_ms=args.max_client_overhead_tail,
                             **_target(args))
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
        if done.spans is not None:  # each row with its server span's figures, as a case's
            for row, joined in zip(rows, done.spans.rows, strict=True):
                row.update(joined)
        write_requests(path.parent, path.stem, rows)
        print(f"result: {path}")
    if done.invalid_reason:
        print(f"profllm bench: invalid measurement: {done.invalid_reason}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return port


@contextlib.contextmanager
def _receiver(port: int | None) -> Iterator[SpanReceiver | None]:
    """The span receiver on 127.0.0.1:`port` for the benchmark's time; None without a port.
    A port it cannot bind is one line."""
    if port is None:
        yield None
        return
    try:
        receiver = SpanReceiver(port=port)
    except OSError as error:
        raise CliError(
            f"--spans-port {port}: cannot receive spans on 127.0.0.1:{port}: "
            f"{(error.strerror or str(error)).lower()}"
        ) from None
    try:
        yield receiver
    finally:
        receiver.close()


def _target(args: argparse.Namespace) -> dict[str, Any]:
    """What a load and a search both take of the command line: the server's names, the
    tokenizer, the key, the endpoint, the label and the lag bound."""
    return {
        "served_model_name": args.served_model_name,
        "tokenizer": args.tokenizer,
        "api_key": os.environ.get("OPENAI_API_KEY"),
        "endpoint": args.endpoint,
        "label": args.label,
        "max_schedule_lag_ms": args.max_schedule_lag,
        "max_client_overhead_ms": args.max_client_overhead,
        "max_client_wait": args.max_client_wait,
    }


def _bench_capacity(config: CapacityConfig, base_url: str, args: argparse.Namespace) -> int:
    def show(probe: Probe) -> None:
        print(describe_probe(probe, config.search.over), flush=True)

    try:
        done = search_server(
            config,
            base_url,
            args.model,
            on_probe=show,
            **_target(args),
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
    if (invalid := done.result["invalid_reason"]) is not None:
        # Its capacity is no measurement of the server (judged as a capacity case is): exit
        # as any invalid measurement does.
        print(f"profllm bench: invalid measurement: {invalid}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK if done.found.capacity is not None else EXIT_NOTHING_MEASURED


def _pairs(pairs: list[str], separator: str, flag: str, form: str) -> dict[str, float]:
    """`--slo NAME=VALUE` and `--goodput KEY:MS`, repeated, as a mapping; a bad pair is one
    line naming the flag and the form it takes."""
    read = {}
    for pair in pairs:
        key, _, value = pair.partition(separator)
        try:
            read[key.strip()] = float(value)
        except ValueError:
            raise CliError(f"{flag}: {pair!r} is not {form}") from None
    return read


def _slos(pairs: list[str]) -> dict[str, float]:
    return _pairs(pairs, "=", "--slo", "NAME=VALUE (e.g. p99_ttft_ms=500)")


def _goodput(pairs: list[str]) -> dict[str, float]:
    return _pairs(pairs, ":", "--goodput", "KEY:MILLISECONDS")
