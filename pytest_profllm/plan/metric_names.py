"""The names of a case's results, as suites name them in `thresholds:` and `regression:`:
vLLM's serving metric keys (`vllm bench serve`: counts, throughputs, and mean/median/std/pNN of
TTFT, TPOT, ITL and E2EL in ms), the client's health figures, and the keys of the offline
benchmarks' results (`vllm bench throughput|latency`). The measuring code fills them in."""

from __future__ import annotations

import re
from collections.abc import Sequence

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
COUNT_METRICS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "duration",
)
# The names the original ProfLLM record used; kept so old dashboards and thresholds still work.
PROFLLM_ALIASES = {"completed_requests": "completed", "failed_requests": "failed"}
# ProfLLM's record always had these, whatever percentiles a suite asks for.
ALWAYS_PERCENTILES = {"ttft": (95.0,), "tpot": (95.0,)}


def percentile_key(percentile: float) -> str:
    # vLLM writes p99 for 99 and p99.9 for 99.9.
    word = str(int(percentile)) if int(percentile) == percentile else str(percentile)
    return f"p{word}"


def result_names(latency_metrics: Sequence[str], percentiles: Sequence[float]) -> list[str]:
    """Every key `compute` returns for these settings, in the order it returns them."""
    names = list(COUNT_METRICS) + list(PROFLLM_ALIASES)
    for metric in latency_metrics:
        names += [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms"]
        for percentile in percentiles_for(metric, percentiles):
            names.append(f"{percentile_key(percentile)}_{metric}_ms")
    return names


def percentiles_for(metric: str, percentiles: Sequence[float]) -> list[float]:
    wanted = list(percentiles) + [
        p for p in ALWAYS_PERCENTILES.get(metric, ()) if p not in percentiles
    ]
    return sorted(wanted)


# A capacity case's result (load/capacity/): the highest load that met every SLO, and its
# bracket [the highest load that met, the lowest that missed].
CAPACITY_RESULTS = ("capacity", "capacity_low", "capacity_high")

# A multimodal workload's items (load/metrics.py `multimodal_summary`).
MULTIMODAL_RESULTS = (
    "total_mm_items",
    "mean_mm_items_per_request",
    "mean_mm_bytes_per_request",
    "mean_mm_pixels_per_item",
    "mean_mm_tokens_per_request",
    "mean_mm_audio_s_per_request",
)

# A closed-loop load's steady state (load/steady_state.py): from the ramp-up's end (95 % of
# max_concurrency in flight) to the drain's start, its length, requests and figures.
STEADY_RESULTS = (
    "steady_duration_s",
    "steady_completed",
    "steady_request_throughput",
    "steady_output_throughput",
    "steady_median_ttft_ms",
    "steady_p99_ttft_ms",
    "steady_median_tpot_ms",
    "steady_p99_tpot_ms",
)

# The client's own queue (load/metrics.py `client_queue_summary`): how long a request waited
# for a free slot under max_concurrency before it was sent, and E2EL with that wait in it;
# vLLM's TTFT and E2EL start at the send.
CLIENT_QUEUE_RESULTS = (
    "mean_client_queue_ms",
    "median_client_queue_ms",
    "p99_client_queue_ms",
    "mean_e2el_with_queue_ms",
    "median_e2el_with_queue_ms",
    "p99_e2el_with_queue_ms",
)
# What the client and the HTTP path added to the server's own mean TTFT and E2E (its /metrics
# histograms over the load's window: load/server_view.py): a serve load's, where measured.
CLIENT_OVERHEAD_RESULTS = ("client_overhead_ttft_ms", "client_overhead_e2el_ms")

CLIENT_HEALTH_KEYS = (
    "mean_schedule_lag_ms",
    "median_schedule_lag_ms",
    "p99_schedule_lag_ms",
    "max_schedule_lag_ms",
    "target_request_rate",
    "achieved_request_rate",
    "client_cpu_percent",
    # The client watching itself (load/client_watch.py): its event loop's lag, and its share
    # of the load's wall time on a core and waiting for one.
    "client_loop_lag_p50_ms",
    "client_loop_lag_p99_ms",
    "client_loop_lag_max_ms",
    "client_cpu_share",
    "client_runqueue_wait_share",
    # How many processes the load was spread over (load/processes.py) and how many host
    # cores they could run on (the load cores the case held, else the client's affinity).
    "client_processes",
    "client_cores",
)

# `vllm bench throughput|latency --output-json` (vLLM 0.33.0): offline/results.py reads them.
THROUGHPUT_RESULTS = (
    "elapsed_time",
    "num_requests",
    "total_num_tokens",
    "requests_per_second",
    "tokens_per_second",
)
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # what vLLM's latency.py computes
LATENCY_RESULTS = (
    "avg_latency",
    "avg_latency_ms",
    *(f"p{p}_latency_ms" for p in LATENCY_PERCENTILES),
    "num_iters",
)

# An accuracy case's results (`kind: accuracy`, run/accuracy.py): lm-eval's metrics of its task
# under lm-eval's own names (a metric under a filter other than lm-eval's "none" is
# `<metric>_<filter>`), each with its standard error as `<metric>_stderr`, and the number of
# samples scored. The value: whether a higher figure is the better one.
ACCURACY_METRICS = {
    "acc": True,
    "acc_norm": True,
    "exact_match": True,
    "f1": True,
    "mcc": True,
    "bleu": True,
    "chrf": True,
    "ter": False,
    "perplexity": False,
    "word_perplexity": False,
    "byte_perplexity": False,
    "bits_per_byte": False,
}
ACCURACY_SAMPLES = "accuracy_samples"
ACCURACY_RESULTS = (
    *(name for metric in ACCURACY_METRICS for name in (metric, f"{metric}_stderr")),
    ACCURACY_SAMPLES,
)


def is_accuracy_result(name: str) -> bool:
    """Whether an accuracy case can record `name`: a metric (under a filter or not), its
    standard error, or the samples scored."""
    return name == ACCURACY_SAMPLES or accuracy_metric_of(name.removesuffix("_stderr")) is not None


def accuracy_metric_of(name: str) -> str | None:
    """The lm-eval metric a result is named after: itself, or the longest metric it extends by
    a filter's name (`exact_match_strict_match`: exact_match); None for any other result,
    a standard error included."""
    if name in ACCURACY_METRICS:
        return name
    if name.endswith("_stderr") or not re.fullmatch(r"[a-z0-9_]+", name):
        return None
    return max((m for m in ACCURACY_METRICS if name.startswith(f"{m}_")), key=len, default=None)
