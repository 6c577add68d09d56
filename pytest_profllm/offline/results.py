"""The JSON files `vllm bench throughput|latency --output-json` write (vLLM 0.33.0,
`vllm/benchmarks/throughput.py` and `latency.py`), read into a record's `results`.

throughput: `{model_id, elapsed_time, num_requests, total_num_tokens, requests_per_second,
tokens_per_second}`; latency: `{model_id, avg_latency, latencies, percentiles}` in seconds,
`percentiles` keyed by 10, 25, 50, 75, 90 and 99 (strings once in JSON). Latencies also go in
milliseconds (`avg_latency_ms`, `p99_latency_ms`), as the serving metrics do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pytest_profllm.plan.metric_names import LATENCY_PERCENTILES, THROUGHPUT_RESULTS


class OfflineResultError(ValueError):
    """The benchmark's JSON is missing or is not what vLLM writes; one line says what."""


Results = dict[str, float | int | None]


def read_results(kind: str, path: Path) -> tuple[Results, list[dict[str, Any]]]:
    """The record's `results` and per-iteration rows (latency) from an --output-json file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OfflineResultError(f"{path}: vllm bench {kind} wrote no --output-json file") from None
    except (OSError, ValueError) as error:
        raise OfflineResultError(f"{path}: not JSON: {error}") from None
    if not isinstance(data, dict):
        raise OfflineResultError(f"{path}: a vllm bench {kind} result is a JSON object")
    try:
        if kind == "throughput":
            return throughput_results(data), []
        if kind == "latency":
            return latency_results(data), latency_rows(data)
    except (KeyError, TypeError, ValueError) as error:
        raise OfflineResultError(f"{path}: not a vllm bench {kind} result: {error}") from None
    raise OfflineResultError(f"{path}: unknown offline benchmark kind {kind!r}")


def throughput_results(data: dict[str, Any]) -> Results:
    missing = [name for name in THROUGHPUT_RESULTS if name not in data]
    if missing:
        raise KeyError(f"missing {', '.join(missing)}")
    return {
        "elapsed_time": _number(data, "elapsed_time"),
        "num_requests": int(_number(data, "num_requests")),
        "total_num_tokens": int(_number(data, "total_num_tokens")),
        "requests_per_second": _number(data, "requests_per_second"),
        "tokens_per_second": _number(data, "tokens_per_second"),
    }


def latency_results(data: dict[str, Any]) -> Results:
    missing = [name for name in ("avg_latency", "latencies", "percentiles") if name not in data]
    if missing:
        raise KeyError(f"missing {', '.join(missing)}")
    # JSON turned vLLM's integer keys into strings: "10", "99" (or "99.0" from other writers).
    percentiles = {int(float(key)): float(value) for key, value in data["percentiles"].items()}
    absent = [str(p) for p in LATENCY_PERCENTILES if p not in percentiles]
    if absent:
        raise KeyError(f"percentiles lack {', '.join(absent)}")
    avg = _number(data, "avg_latency")
    results: Results = {"avg_latency": avg, "avg_latency_ms": avg * 1000}
    for p in LATENCY_PERCENTILES:
        results[f"p{p}_latency_ms"] = percentiles[p] * 1000
    results["num_iters"] = len(data["latencies"])
    return results


def latency_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured iteration, for the per-request file beside the record."""
    return [
        {"index": index, "latency_s": float(latency)}
        for index, latency in enumerate(data["latencies"])
    ]


def _number(data: dict[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} is {value!r}, not a finite number")
    return float(value)
