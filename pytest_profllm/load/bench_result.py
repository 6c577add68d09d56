"""`profllm bench`'s result: vLLM's keys of a finished load (`result_json`), the file name it
is saved under (`result_path`) and the summary printed after it (`summary_lines`), as
`vllm bench serve` writes and prints them, with what this tool adds (validity, the server's
view, the client's health). load/bench.py runs the load and judges it."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from pytest_profllm.load import loops
from pytest_profllm.load.conversation import (
    by_turn,
)
from pytest_profllm.load.dataset import (
    Codec,
)
from pytest_profllm.load.lora_mix import by_adapter
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import (
    LoadResult,
)
from pytest_profllm.load.trace_join import JOINED_SHARE
from pytest_profllm.plan.suite import BenchmarkConfig

# Lists vLLM keeps only with --save-detailed (one entry per request).
DETAILED_KEYS = (
    "input_lens",
    "output_lens",
    "start_times",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "server_spans",  # with --spans-port: each request's server span (load/trace_join.py)
)


def result_json(
    config: BenchmarkConfig,
    model: str,
    tokenizer: str | None,
    label: str | None,
    load: LoadResult,
    summary: dict[str, float | int | None],
    health: dict[str, float | int | None],
    codec: Codec,
) -> dict[str, Any]:
    """The keys `vllm bench serve --save-result` writes, in its order, then the client's."""
    outcomes = load.outcomes
    output_lens = []
    for outcome in outcomes:
        length = outcome.output_tokens or (
            len(codec.encode(outcome.generated_text)) if outcome.success else 0
        )
        output_lens.append(length if outcome.success else 0)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": config.backend,
        "backend": config.backend,
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer or model,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    if config.ramp_up_strategy is not None:
        result["ramp_up_strategy"] = config.ramp_up_strategy
        result["ramp_up_start_rps"] = config.ramp_up_start_rps
        result["ramp_up_end_rps"] = config.ramp_up_end_rps
    result.update(
        {
            "duration": summary["duration"],
            "completed": summary["completed"],
            "failed": summary["failed"],
            "total_input_tokens": summary["total_input_tokens"],
            "total_output_tokens": summary["total_output_tokens"],
            "request_throughput": summary["request_throughput"],
            "request_goodput": summary["request_goodput"],
            "output_throughput": summary["output_throughput"],
            "total_token_throughput": summary["total_token_throughput"],
            "input_lens": [outcome.prompt_len for outcome in outcomes],
            "output_lens": output_lens,
            "ttfts": [outcome.ttft for outcome in outcomes],
            "itls": [outcome.itl for outcome in outcomes],
            "start_times": [outcome.start_time for outcome in outcomes],
            "generated_texts": [outcome.generated_text for outcome in outcomes],
            "errors": [outcome.error for outcome in outcomes],
            "latencies": [outcome.latency for outcome in outcomes],
            "queue_times": [outcome.start_time - outcome.dispatch_time for outcome in outcomes],
            "rtfx": 0.0,
        }
    )
    result.update(peaks(outcomes))
    for key, value in summary.items():
        if key.endswith("_ms"):
            result[key] = value
    result.update(health)
    result["client_loop"] = loops.name()  # the event loop the client ran on (load/loops.py)
    if (turns := by_turn(outcomes)) is not None:
        result["by_turn"] = turns
    if (adapters := by_adapter(outcomes, load.duration)) is not None:
        result["by_adapter"] = adapters
    return result


def peaks(outcomes: list[RequestOutcome]) -> dict[str, float | int]:
    """vLLM's peak figures: the most content messages and the most requests in flight in any
    whole second since the first successful request started."""

    done = [outcome for outcome in outcomes if outcome.success]
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    first = min(outcome.start_time for outcome in done)
    last = max(outcome.start_time + outcome.latency for outcome in done)
    seconds = int(np.ceil(last - first)) + 1
    tokens = np.zeros(seconds)
    in_flight = np.zeros(seconds)
    for outcome in done:
        for moment in outcome.message_times:
            bucket = int(moment - first)
            if 0 <= bucket < seconds:
                tokens[bucket] += 1
        begin = int(outcome.start_time - first)
        end = int(outcome.start_time + outcome.latency - first)
        in_flight[begin : end + 1] += 1
    return {
        "max_output_tokens_per_s": float(tokens.max()),
        "max_concurrent_requests": int(in_flight.max()),
    }


def result_path(
    config: BenchmarkConfig,
    model: str,
    label: str | None,
    result_dir: str | None,
    result_filename: str | None,
) -> Path:
    """Where vLLM would write the result: its file name pattern, in `result_dir`."""
    if result_filename:
        name = result_filename
    else:
        base = model.rstrip("/").split("/")[-1]
        concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        label = label or config.backend
        if config.ramp_up_strategy is not None:
            rate = (
                f"ramp-up-{config.ramp_up_strategy}-{config.ramp_up_start_rps}qps-"
                f"{config.ramp_up_end_rps}qps"
            )
        else:
            rate = f"{config.request_rate}qps"
        name = f"{label}-{rate}{concurrency}-{base}-{date}.json"
    return Path(result_dir or ".") / name


def _server_view_rows(result: dict[str, Any]) -> list[tuple[str, Any]]:
    """The server's own means and what the client added to them, or why there are none."""
    view = result.get("server_view") or {}
    if view.get("problem") and result.get("server_ttft_mean_ms") is None:
        return [("Server's view:", view["problem"])]
    return [
        (f"Server {title} (ms):", result.get(key))
        for title, key in (
            ("mean TTFT", "server_ttft_mean_ms"), ("mean queue", "server_queue_mean_ms"),
            ("mean prefill", "server_prefill_mean_ms"), ("mean E2E", "server_e2el_mean_ms"),
            ("client overhead, TTFT", "client_overhead_ttft_ms"),
            ("client overhead, E2E", "client_overhead_e2el_ms"),
        )
        if result.get(key) is not None
    ]


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The result as the table `vllm bench serve` prints, plus the client's health."""
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Benchmark duration (s):", result["duration"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", result["request_throughput"]),
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", result["request_goodput"]))
    for key, value in result.items():
        if key.endswith("_ms") and "schedule_lag" not in key and not key.startswith(
            ("std_", "server_", "client_overhead_", "client_loop_lag_")
        ):
            rows.append((f"{key}:", value))
    rows += _server_view_rows(result)
    if result.get(JOINED_SHARE) is not None:  # --spans-port: each request's own span
        rows += [
            ("Server spans joined (share):", result[JOINED_SHARE]),
            ("Client overhead, TTFT p50 (ms):", result.get("client_overhead_ttft_p50_ms")),
            ("Client overhead, TTFT p99 (ms):", result.get("client_overhead_ttft_p99_ms")),
        ]
    rows += [
        ("Schedule lag p99 (ms):", result["p99_schedule_lag_ms"]),
        ("Achieved request rate (req/s):", result["achieved_request_rate"]),
        ("Client CPU (% of a core):", result["client_cpu_percent"]),
        ("Client event loop lag p99 (ms):", result.get("client_loop_lag_p99_ms")),
        ("Client run-queue wait (share):", result.get("client_runqueue_wait_share")),
        ("Validity:", result["validity"]),
    ]
    if result.get("prefix_cache"):
        rows.append(("Prefix cache:", result["prefix_cache"]))
    if result.get("prompt_seed") is not None:
        rows.append(("Prompt seed:", result["prompt_seed"]))
    if result.get("client_limit"):
        rows.append(("Connections:", result["client_limit"]))
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    for title, value in rows:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{title:<40} {shown}")
    for turn in result.get("by_turn") or []:
        ttft, rate = turn["median_ttft_ms"], turn["prefix_cache_hit_rate"]
        shown = "-" if ttft is None else f"{ttft:.2f}"
        hits = "not reported" if rate is None else f"{rate:.1%}"
        title = f"Turn {turn['turn']} median TTFT (ms), cache hits:"
        lines.append(f"{title:<40} {shown}, {hits} ({turn['completed']}/{turn['requests']})")
    for adapter in result.get("by_adapter") or []:
        ttft = adapter["median_ttft_ms"]
        shown = "-" if ttft is None else f"{ttft:.2f}"
        title = f"Model {adapter['model']} median TTFT (ms):"
        lines.append(f"{title:<40} {shown} ({adapter['completed']}/{adapter['requests']})")
    if result.get("invalid_reason"):
        lines.append(f"invalid: {result['invalid_reason']}")
    lines.append("=" * 50)
    return lines
