"""What the simulated engine counts for `/metrics`: vLLM 0.33.0's request histograms and
counters (`vllm/v1/metrics/loggers.py`, bucket bounds from `vllm/v1/metrics/buckets.py`).

Plain counts kept by the scheduler as it steps; `instruments.py` renders them at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the context length (`build_1_2_5_buckets`)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last: +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """`value`, seen `times` times (a decode step's tokens share their gap)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, as Prometheus writes them."""
        cumulative = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        return out


# (name, documentation, bucket family) in vLLM 0.33.0's order.
HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     "iteration"),
    ("vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "tokens"),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    ("vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", "itl"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     "latency"),
    ("vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", "latency"),
    ("vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", "latency"),
    ("vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", "latency"),
    ("vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", "latency"),
    ("vllm:request_num_preemptions",
     "Histogram of the number of times a request was preempted.", "preemptions"),
    ("vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "tokens"),
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass
class EngineStats:
    max_model_len: int = 32768
    histograms: dict[str, Histogram] = field(default_factory=dict)
    request_success: dict[str, int] = field(default_factory=dict)  # by finished_reason

    def __post_init__(self) -> None:
        families = {
            "tokens": request_tokens_buckets(self.max_model_len),
            "iteration": ITERATION_TOKENS_BUCKETS,
            "n": REQUEST_PARAMS_N_BUCKETS,
            "ttft": TIME_TO_FIRST_TOKEN_BUCKETS,
            "itl": INTER_TOKEN_LATENCY_BUCKETS,
            "latency": REQUEST_LATENCY_BUCKETS,
            "preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
        }
        self.histograms = {
            name: Histogram(tuple(families[family])) for name, _, family in HISTOGRAMS
        }
        self.request_success = dict.fromkeys(FINISHED_REASONS, 0)

    def observe(self, name: str, value: float, times: int = 1) -> None:
        self.histograms[name].observe(value, times)
