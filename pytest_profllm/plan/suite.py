"""Suite files: the typed form of `bench_*.yaml` and of the `profllm` marker's arguments.

A suite declares `server:` (vLLM engine arguments, snake_case) and `benchmark:` (the workload,
`vllm bench serve` flags in snake_case); a list value is an axis, except for an engine argument
that takes a list, whose axis is a list of lists. Every error of a suite is reported at once,
one line each, naming the file, the line, the key and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.registry import bundled
from pytest_profllm.engine.secrets import ENV_SECRETS, REDACTED, RedactedDict, is_secret
from pytest_profllm.limits import (
    MAX_PROBE_REQUESTS,
    MAX_REPLAY_S,
    MAX_REQUEST_TOKENS,
    MIN_SEARCH_RATE,
)
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.metric_names import LATENCY_RESULTS, THROUGHPUT_RESULTS
from pytest_profllm.plan.regression import (
    BRACKETED_METRICS,
    PER_REPEAT_METRICS,
    parse_regression,
    regression_problems,
)

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry

# An engine argument, or a field inside a JSON one (`compilation_config.mode`).
_ARG_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_]+)*$")
# Set by the lease, never by a suite: two servers must not be told the same port.
LEASED_SERVER_ARGS = frozenset({"host", "port"})


class SuiteError(Exception):
    """A suite that cannot be run; the message has one line per problem, each naming file,
    line and key."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class _Problems:
    """The problems of one suite, reported together in line order."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[tuple[int, str]] = []

    def add(self, line: int | None, text: str) -> None:
        entry = (line or 0, f"{at_line(self.where, line)}: {text}")
        if entry not in self.found:
            self.found.append(entry)

    def error(self) -> SuiteError:
        return SuiteError([text for _, text in sorted(self.found, key=lambda e: e[0])])


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A bound that is not a number can hold nothing to it: refused, with its line.
    min: FiniteFloat | None = None
    max: FiniteFloat | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs 'min', 'max' or both")
        return self


class Exclusion(BaseModel):
    """Cases whose server and benchmark values match all of these are left out."""

    model_config = ConfigDict(extra="forbid")

    server: dict[str, Any] = Field(default_factory=dict)
    benchmark: dict[str, Any] = Field(default_factory=dict)


POOLING_BACKENDS = ("openai-embeddings", "vllm-rerank")
# The datasets that read a local file (speed_bench: a folder of them).
_FILE_DATASETS = (
    "sharegpt", "custom", "timed_trace", "burstgpt", "spec_bench", "speed_bench",
    "custom_image", "custom_audio",
)
# `vllm bench serve --num-prompts`'s default (vllm/benchmarks/datasets: DEFAULT_NUM_PROMPTS).
VLLM_DEFAULT_NUM_PROMPTS = 1000
# Datasets whose requests carry media: they go to the chat endpoint, as vLLM's do.
MEDIA_DATASETS = ("random-mm", "custom_image", "custom_audio")


def bucket_shape(key: str) -> tuple[int, int, int]:
    """A random-mm bucket key, "(height, width, frames)" as vLLM writes it, as numbers."""
    numbers = re.fullmatch(r"\s*\(?\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)?\s*", key)
    if numbers is None:
        raise ValueError(f"bucket key {key!r} is not \"(height, width, frames)\"")
    height, width, frames = (int(n) for n in numbers.groups())
    if min(height, width, frames) < 1:
        raise ValueError(f"bucket key {key!r}: height, width and frames are at least 1")
    return height, width, frames


class BenchmarkConfig(BaseModel):
    """One workload, with the names of `vllm bench serve`'s flags in snake_case."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["serve"] = "serve"
    # openai-embeddings and vllm-rerank are pooling backends (/v1/embeddings, /v1/rerank), as
    # vLLM's: a request is one response, with E2EL only.
    backend: Literal["openai", "openai-chat", "openai-embeddings", "vllm-rerank"] = "openai"
    dataset_name: Literal[
        "random",
        "prefix_repetition",
        "sharegpt",
        "custom",
        "timed_trace",
        "conversation",
        "random-mm",
        "random-rerank",
        "burstgpt",
        "spec_bench",
        "speed_bench",
        "custom_image",
        "custom_audio",
    ] = "random"
    # sharegpt: a ShareGPT JSON file; custom: JSON lines with a "prompt" (and "output_tokens");
    # timed_trace: JSON lines with a timestamp, lengths and hash_ids, or a CSV (load/trace.py);
    # conversation: a ShareGPT JSON file of whole conversations (none: synthetic ones);
    # burstgpt: a BurstGPT CSV; spec_bench: Spec-Bench's question.jsonl; speed_bench: the
    # folder SPEED-Bench's prepare script writes; custom_image: JSON lines with a "prompt" and
    # "image_files", or interleaved "content"; custom_audio: JSON lines with a "prompt" and
    # an "audio" WAV file. Relative media paths are from the dataset file's folder.
    dataset_path: str | None = None
    num_prompts: int = Field(100, gt=0)
    random_input_len: int = Field(1024, gt=0, le=MAX_REQUEST_TOKENS)
    random_output_len: int = Field(128, gt=0, le=MAX_REQUEST_TOKENS)
    random_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    random_prefix_len: int = Field(0, ge=0, le=MAX_REQUEST_TOKENS)
    # Pooling backends: prompts per request (openai-embeddings: a list input; random-rerank:
    # documents per query). vLLM's --random-batch-size.
    random_batch_size: int = Field(1, gt=0)
    # random-mm (load/multimodal.py): images per request drawn on [floor(n(1-r)), ceil(n(1+r))]
    # within the per-modality limits, each of a (height, width, frames) bucket drawn with its
    # probability. Keys as vLLM writes them: "(720, 1280, 1)".
    random_mm_base_items_per_request: int = Field(1, ge=0)
    random_mm_num_mm_items_range_ratio: float = Field(0.0, ge=0.0, le=1.0)
    random_mm_limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=lambda: {"image": 255, "video": 1}
    )
    random_mm_bucket_config: dict[str, FiniteFloat] = Field(
        default_factory=lambda: {
            "(256, 256, 1)": 0.5, "(720, 1280, 1)": 0.5, "(720, 1280, 16)": 0.0
        }
    )
    prefix_repetition_prefix_len: int = Field(256, gt=0, le=MAX_REQUEST_TOKENS)
    prefix_repetition_suffix_len: int = Field(256, gt=0, le=MAX_REQUEST_TOKENS)
    prefix_repetition_num_prefixes: int = Field(10, gt=0)
    prefix_repetition_output_len: int = Field(128, gt=0, le=MAX_REQUEST_TOKENS)
    sharegpt_output_len: int | None = Field(None, gt=0, le=MAX_REQUEST_TOKENS)
    # -1: each line's own "output_tokens"
    custom_output_len: int = Field(256, le=MAX_REQUEST_TOKENS)
    spec_bench_output_len: int = Field(256, gt=0, le=MAX_REQUEST_TOKENS)
    spec_bench_category: str | None = None  # None: every category
    speed_bench_dataset_subset: Literal[
        "qualitative",
        "throughput_1k",
        "throughput_2k",
        "throughput_8k",
        "throughput_16k",
        "throughput_32k",
    ] = "qualitative"
    speed_bench_output_len: int = Field(4096, gt=0, le=MAX_REQUEST_TOKENS)
    speed_bench_category: str | None = None  # None: every category
    timed_trace_chunk_hash_size: int = Field(16, gt=0)  # tokens per hash id (Mooncake: 512)
    timed_trace_sec_multiplier: FiniteFloat = Field(1.0, gt=0)  # timestamp x this = seconds
    timed_trace_label_timestamp: str = "timestamp"
    timed_trace_label_input_length: str = "input_length"
    timed_trace_label_output_length: str = "output_length"
    timed_trace_label_hash_ids: str = "hash_ids"
    # Send a trace's requests at their recorded times (None: on for timed_trace, as vLLM).
    self_timed: bool | None = None
    # Ours, not vLLM's: which part of a trace to replay, and how fast.
    trace_speedup: FiniteFloat = Field(1.0, gt=0)  # 10: ten times the trace's rate
    trace_target_rate: FiniteFloat | None = Field(None, gt=0)  # a mean rate instead, req/s
    trace_start_s: FiniteFloat = Field(0.0, ge=0)  # from the trace's first request
    trace_duration_s: FiniteFloat | None = Field(None, gt=0)
    # Ours, not vLLM's: multi-turn conversations (load/conversation.py). `num_prompts` is the
    # number of conversations, `request_rate` conversations started per second and
    # `max_concurrency` conversations in flight. Synthetic turns (no dataset_path): so many
    # turns, user-message and answer lengths in tokens, each drawn within +-range_ratio.
    conversation_turns: int = Field(4, gt=0)
    conversation_input_len: int = Field(128, gt=0, le=MAX_REQUEST_TOKENS)
    conversation_output_len: int = Field(64, gt=0, le=MAX_REQUEST_TOKENS)
    conversation_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    # The user's pause between an answer's end and the next turn: its mean, and its
    # distribution (fixed: always the mean; exponential; uniform: on [0, 2 x mean]).
    conversation_think_time_s: FiniteFloat = Field(0.0, ge=0.0)
    conversation_think_time_distribution: Literal["fixed", "exponential", "uniform"] = (
        "exponential"
    )
    request_rate: float = Field(math.inf, gt=0)
    burstiness: float = Field(1.0, gt=0)
    max_concurrency: int | None = Field(None, gt=0)
    ramp_up_strategy: Literal["linear", "exponential"] | None = None
    ramp_up_start_rps: FiniteFloat | None = Field(None, ge=0)
    ramp_up_end_rps: FiniteFloat | None = Field(None, gt=0)
    seed: int = 0
    # vLLM's own client forces ignore_eos for the random dataset, so lengths are exact.
    ignore_eos: bool = True
    temperature: FiniteFloat | None = Field(0.0, ge=0.0)  # None: the server's default
    tokenizer: str | None = None
    num_warmups: int = Field(0, ge=0)
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "50,90,95,99"
    # Only request_rate and burstiness may be infinite (all at once; evenly spaced).
    goodput: dict[Literal["ttft", "tpot", "e2el"], FiniteFloat] | None = None
    request_timeout_s: FiniteFloat = Field(600.0, gt=0)
    # Ours, not vLLM's: spread the client over processes when one event loop cannot keep up.
    client_processes: int = Field(1, ge=1)
    # Ours: keep what earlier cases left in the server's prefix cache (default: each case,
    # repeat and capacity probe starts from an emptied cache, load/server_state.py).
    warm_cache: bool = False

    @field_validator("percentile_metrics")
    @classmethod
    def _known_metrics(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in metric_names.LATENCY_METRICS]
        if unknown or not names:
            raise ValueError(
                f"unknown latency metric {unknown or value!r}; "
                f"allowed: {', '.join(metric_names.LATENCY_METRICS)}"
            )
        return ",".join(names)

    @field_validator("metric_percentiles")
    @classmethod
    def _percentiles(cls, value: str) -> str:
        try:
            numbers = [float(p) for p in value.split(",") if p.strip()]
        except ValueError:
            raise ValueError("metric_percentiles takes numbers like '50,90,99'") from None
        if not numbers or not all(0 < p < 100 for p in numbers):
            raise ValueError("metric_percentiles must lie strictly between 0 and 100")
        return value

    @field_validator("dataset_name", mode="before")
    @classmethod
    def _dataset_we_lack(cls, value: object) -> object:
        if value == "hf":
            raise ValueError(
                "dataset_name 'hf' downloads from the Hugging Face hub, which profllm never "
                "uses: save the dataset locally and use custom or sharegpt with dataset_path"
            )
        return value

    @field_validator("random_mm_bucket_config")
    @classmethod
    def _buckets(cls, value: dict[str, float]) -> dict[str, float]:
        for key, probability in value.items():
            bucket_shape(key)  # raises with the key's problem
            if probability < 0:
                raise ValueError(f"bucket {key!r} has a negative probability {probability:g}")
        total = sum(value.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"the bucket probabilities sum to {total:g}, not 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _trace_replays_whole(cls, data: Any) -> Any:
        # A trace's count is its own: left out, num_prompts is vLLM's default (1000), so a
        # trace of fewer requests is replayed whole, as `vllm bench serve` replays it, not cut
        # at the 100 of the other datasets.
        if (
            isinstance(data, dict)
            and data.get("dataset_name") == "timed_trace"
            and "num_prompts" not in data
        ):
            return {**data, "num_prompts": VLLM_DEFAULT_NUM_PROMPTS}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> BenchmarkConfig:
        # The same checks as vllm bench serve, before any server starts.
        if self.ramp_up_strategy is not None:
            if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
                raise ValueError("ramp_up_strategy needs ramp_up_start_rps and ramp_up_end_rps")
            if not math.isinf(self.request_rate):
                raise ValueError("with ramp_up_strategy, leave request_rate out (the ramp sets it)")
            if self.ramp_up_start_rps > self.ramp_up_end_rps:
                raise ValueError("ramp_up_start_rps must not exceed ramp_up_end_rps")
            if self.ramp_up_strategy == "exponential" and self.ramp_up_start_rps == 0:
                raise ValueError("an exponential ramp-up cannot start at 0 requests/s")
        # Ours: a rate so low that the schedule's gaps run past a day is a unit mistaken, and
        # its arithmetic (1 / rate) overflows near zero; refused before any server starts.
        lasts_s = self.num_prompts / self.request_rate
        if lasts_s > MAX_REPLAY_S:
            raise ValueError(
                f"request_rate: {self.num_prompts:,} requests at {self.request_rate:g} req/s "
                f"would take about {lasts_s / 3600:.3g} h, past "
                f"the {MAX_REPLAY_S / 3600:g} h a load may last"
            )
        if self.dataset_name in _FILE_DATASETS and not self.dataset_path:
            place = "folder" if self.dataset_name == "speed_bench" else "file"
            raise ValueError(
                f"dataset_name {self.dataset_name!r} needs dataset_path (a local {place})"
            )
        for prefix in ("spec_bench_", "speed_bench_"):
            named = [n for n in self.model_fields_set if n.startswith(prefix)]
            if named and self.dataset_name != prefix.rstrip("_"):
                raise ValueError(
                    f"{', '.join(sorted(named))} only apply to dataset_name "
                    f"{prefix.rstrip('_')!r}"
                )
        if self.dataset_name == "conversation":
            if self.backend != "openai-chat":
                raise ValueError(
                    "dataset_name 'conversation' sends each turn's history as chat messages: "
                    "it needs backend: openai-chat"
                )
            if self.client_processes > 1:
                raise ValueError("dataset_name 'conversation' runs in one client process")
        self._check_trace()
        self._check_multimodal()
        self._check_pooling()
        return self

    def _check_multimodal(self) -> None:
        mm_only = [
            name
            for name in BenchmarkConfig.model_fields
            if name.startswith("random_mm_") and name in self.model_fields_set
        ]
        if self.dataset_name in MEDIA_DATASETS and self.backend != "openai-chat":
            raise ValueError(
                f"dataset_name {self.dataset_name!r} sends images, video or audio in chat "
                "messages: it needs backend: openai-chat"
            )
        if self.dataset_name != "random-mm":
            if mm_only:
                raise ValueError(f"{', '.join(mm_only)} only apply to dataset_name 'random-mm'")
            return
        unknown = sorted(set(self.random_mm_limit_mm_per_prompt) - {"image", "video"})
        if unknown:
            raise ValueError(
                f"random_mm_limit_mm_per_prompt: unknown modality {unknown[0]!r}; allowed: "
                "image, video"
            )
        for key in self.random_mm_bucket_config:
            frames = bucket_shape(key)[2]
            if self.random_mm_limit_mm_per_prompt.get("image" if frames == 1 else "video") is None:
                raise ValueError(
                    f"random_mm_bucket_config: {key}'s modality has no limit in "
                    "random_mm_limit_mm_per_prompt"
                )

    @property
    def is_pooling(self) -> bool:
        """Whether the backend is a pooling model's (embeddings, rerank): no tokens stream."""
        return self.backend in POOLING_BACKENDS

    def _check_pooling(self) -> None:
        if self.dataset_name == "random-rerank" and self.backend != "vllm-rerank":
            raise ValueError("dataset_name 'random-rerank' needs backend: vllm-rerank")
        if self.backend == "vllm-rerank" and self.dataset_name != "random-rerank":
            raise ValueError("backend 'vllm-rerank' takes dataset_name: random-rerank")
        if "random_batch_size" in self.model_fields_set and not self.is_pooling:
            raise ValueError(
                "random_batch_size batches prompts for a pooling backend (openai-embeddings, "
                "vllm-rerank)"
            )
        if not self.is_pooling:
            return
        if self.dataset_name not in ("random", "random-rerank"):
            raise ValueError(
                f"backend {self.backend!r} takes dataset_name random or random-rerank, "
                f"not {self.dataset_name!r}"
            )
        if "percentile_metrics" not in self.model_fields_set:
            self.percentile_metrics = "e2el"  # as vLLM's client for pooling models
        elif self.percentile_metrics != "e2el":
            raise ValueError(
                "a pooling backend's requests have no first token or decode: "
                "percentile_metrics is e2el"
            )
        if self.goodput and set(self.goodput) != {"e2el"}:
            raise ValueError("a pooling backend's goodput may bound e2el only")

    def _check_trace(self) -> None:
        trace_only = [
            name
            for name in BenchmarkConfig.model_fields
            if name.startswith(("timed_trace_", "trace_", "self_timed"))
            and name in self.model_fields_set
        ]
        if self.dataset_name != "timed_trace":
            if trace_only:
                raise ValueError(
                    f"{', '.join(trace_only)} only apply to dataset_name 'timed_trace'"
                )
            return
        if self.backend != "openai":
            raise ValueError(
                "a timed_trace sends token ids as prompts: it needs backend 'openai' (the "
                "completions endpoint), as vLLM's"
            )
        if self.trace_target_rate is not None and "trace_speedup" in self.model_fields_set:
            raise ValueError("give trace_speedup or trace_target_rate, not both")
        if self.is_self_timed and (
            not math.isinf(self.request_rate) or self.ramp_up_strategy is not None
        ):
            raise ValueError(
                "a self-timed trace sends its requests at their recorded times: leave "
                "request_rate and ramp_up_* out, or set self_timed: false to use them"
            )
        if not self.is_self_timed and (
            "trace_speedup" in self.model_fields_set or self.trace_target_rate is not None
        ):
            raise ValueError(
                "trace_speedup and trace_target_rate pace a self-timed trace; with "
                "self_timed: false, request_rate sets the pace"
            )

    @property
    def is_self_timed(self) -> bool:
        """Whether requests go at the times the workload recorded (a timed trace's)."""
        if self.dataset_name != "timed_trace":
            return False
        return self.self_timed is not False

    @field_serializer("request_rate")
    def _rate_json(self, rate: float) -> float | str:
        # JSON has no infinity; vLLM's result files write "inf" too.
        return "inf" if math.isinf(rate) else rate

    @property
    def percentiles(self) -> list[float]:
        return [float(p) for p in self.metric_percentiles.split(",") if p.strip()]

    @property
    def latency_metrics(self) -> list[str]:
        return self.percentile_metrics.split(",")

    def result_names(self) -> list[str]:
        # The client's health figures can be gated on too (say, p99_schedule_lag_ms).
        names = metric_names.result_names(self.latency_metrics, self.percentiles)
        if self.is_pooling:  # no output tokens, so no output figures to hold it to
            names = [n for n in names if n not in ("total_output_tokens", "output_throughput")]
        if self.dataset_name in MEDIA_DATASETS:
            names += metric_names.MULTIMODAL_RESULTS
        if self.max_concurrency:  # a closed loop has a steady state
            names += [n for n in metric_names.STEADY_RESULTS
                      if not (self.is_pooling and n.endswith(("_ttft_ms", "_tpot_ms")))]
        return names + list(metric_names.CLIENT_HEALTH_KEYS)


# What an SLO may bound: a latency statistic in ms (`p99_ttft_ms`, `median_tpot_ms`, ...), or
# the fraction of requests that meet the workload's `goodput` bounds.
_SLO_LATENCY = re.compile(
    r"^(mean|median|p(\d+(?:\.\d+)?))_(" + "|".join(metric_names.LATENCY_METRICS) + r")_ms$"
)
GOODPUT_SLO = "goodput_ratio"


def slo_problem(name: str, target: float) -> str | None:
    """Why `name: target` is not an SLO a capacity search can hold a probe to, or None."""
    match = _SLO_LATENCY.match(name)
    if name == GOODPUT_SLO:
        if not 0 < target <= 1:
            return f"slo.{name}: a fraction of requests in (0, 1], got {target!r}"
        return None
    if match is None:
        return (
            f"slo.{name}: unknown SLO metric; allowed: mean_/median_/pNN_ of "
            f"{', '.join(metric_names.LATENCY_METRICS)} in ms (e.g. p99_ttft_ms), "
            f"and {GOODPUT_SLO}"
        )
    if match.group(2) is not None and not 0 < float(match.group(2)) < 100:
        return f"slo.{name}: a percentile lies strictly between 0 and 100"
    if target <= 0:
        return f"slo.{name}: a latency bound in ms above 0, got {target!r}"
    return None


class CapacitySearch(BaseModel):
    """How a capacity case searches: over which load, in what range, to what precision, and
    within what budget (load/capacity/)."""

    model_config = ConfigDict(extra="forbid")

    over: Literal["request_rate", "max_concurrency"] = "request_rate"
    low: FiniteFloat = Field(1.0, gt=0)
    high: FiniteFloat = Field(200.0, gt=0)
    # The bracket [meets, misses] is narrowed until misses / meets <= 1 + precision.
    precision: float = 0.05
    max_probes: int = Field(12, ge=2)
    max_time_s: FiniteFloat = Field(1800.0, gt=0)
    # A rate probe sends at least this long (a burst shorter than the queue's build-up meets
    # SLOs the server cannot hold); a concurrency probe passes through each slot ten times.
    min_duration_s: FiniteFloat = Field(10.0, gt=0)
    # Two-sided confidence of each SLO's interval: "meets" only when the whole interval of
    # the percentile lies under its bound (benchmarks/perf/capacity_search.py chose it).
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    # An unsure probe is extended with more requests, up to this many times its first count.
    max_extension: int = Field(4, ge=1)
    # Independent runs whose pooled samples a load must meet on to count as meeting
    # (load/capacity/: near the capacity one run's tail varies from run to run more than
    # its own interval says).
    confirm: int = Field(2, ge=1)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, value: object) -> float:
        # `5%`, or a fraction (0.05).
        text = str(value).strip()
        try:
            number = float(text.removesuffix("%"))
        except ValueError:
            raise ValueError(f"a precision is a percentage like '5%', got {value!r}") from None
        fraction = number / 100 if text.endswith("%") else number
        if isinstance(value, bool) or not (0 < fraction < 1 and math.isfinite(fraction)):
            raise ValueError(f"a precision lies between 0% and 100%, got {value!r}")
        return fraction

    @model_validator(mode="after")
    def _bounds(self) -> CapacitySearch:
        # Every problem at once, in one line (pydantic reports one per validator).
        problems = []
        if self.low >= self.high:
            problems.append(
                f"search.low ({self.low:g}) must lie below search.high ({self.high:g})"
            )
        whole = self.over == "max_concurrency"
        if whole and (self.low != int(self.low) or self.high != int(self.high)):
            problems.append("a max_concurrency search takes whole numbers for low and high")
        if not whole and self.low < MIN_SEARCH_RATE:
            problems.append(
                f"search.low: a request_rate search starts at {MIN_SEARCH_RATE:g} req/s or "
                f"more (one request every {1 / MIN_SEARCH_RATE:g} s), got {self.low:g}"
            )
        requests = 10 * self.high if whole else self.high * self.min_duration_s
        if requests > MAX_PROBE_REQUESTS:
            how = "10 x search.high" if whole else "search.high x search.min_duration_s"
            problems.append(
                f"a probe at search.high would send {requests:.3g} requests ({how}), over the "
                f"limit of {MAX_PROBE_REQUESTS:,}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


class CapacityConfig(BenchmarkConfig):
    """A capacity case: the serve workload, probed at rising loads on one server until the
    highest load that meets every SLO is bracketed (load/capacity/)."""

    kind: Literal["capacity"] = "capacity"  # type: ignore[assignment]
    slo: dict[str, FiniteFloat]
    search: CapacitySearch = Field(default_factory=CapacitySearch)

    @field_validator("slo")
    @classmethod
    def _known_slos(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("a capacity case needs at least one SLO, e.g. {p99_ttft_ms: 500}")
        for name, target in value.items():
            if (problem := slo_problem(name, target)) is not None:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _goodput_bounds(self) -> CapacityConfig:
        if self.dataset_name == "conversation":
            raise ValueError("a capacity case cannot run dataset_name 'conversation' yet")
        if self.is_pooling:
            raise ValueError(
                f"a capacity case cannot search a pooling backend yet ({self.backend})"
            )
        if GOODPUT_SLO in self.slo and not self.goodput:
            raise ValueError(
                f"slo.{GOODPUT_SLO} counts the requests within `goodput` "
                "(e.g. goodput: {ttft: 500, tpot: 50}): set it"
            )
        if self.is_self_timed:
            raise ValueError(
                "a capacity search sets the load itself: a timed_trace case needs "
                "self_timed: false (the trace's requests, sent at the searched load)"
            )
        return self

    def result_names(self) -> list[str]:
        return super().result_names() + list(metric_names.CAPACITY_RESULTS)


class ThroughputConfig(BaseModel):
    """An offline throughput run: `vllm bench throughput`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["throughput"]
    backend: Literal["vllm", "vllm-chat"] = "vllm"
    dataset_name: Literal["random", "sharegpt", "prefix_repetition"] = "random"
    dataset_path: str | None = None  # sharegpt: a local ShareGPT JSON file
    # vLLM's own default of --input-len is unset, which means 1024 for the random dataset.
    input_len: int = Field(1024, gt=0)
    output_len: int | None = Field(None, gt=0)  # None: the dataset's (random: 128)
    num_prompts: int = Field(1000, gt=0)
    n: int = Field(1, gt=0)
    prefix_len: int = Field(0, ge=0)
    random_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    prefix_repetition_prefix_len: int | None = Field(None, gt=0)
    prefix_repetition_suffix_len: int | None = Field(None, gt=0)
    prefix_repetition_num_prefixes: int | None = Field(None, gt=0)
    prefix_repetition_output_len: int | None = Field(None, gt=0)
    async_engine: bool = False
    disable_detokenize: bool = False
    # Ours, not vLLM's: the whole command (engine start included) must end within this.
    timeout_s: FiniteFloat = Field(1800.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> ThroughputConfig:
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_name 'sharegpt' needs dataset_path (a local file)")
        if self.dataset_name == "prefix_repetition":
            needed = [
                f"prefix_repetition_{name}"
                for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len")
                if getattr(self, f"prefix_repetition_{name}") is None
            ]
            if needed:
                raise ValueError(f"dataset_name 'prefix_repetition' needs {', '.join(needed)}")
        return self

    def result_names(self) -> list[str]:
        return list(THROUGHPUT_RESULTS)


class LatencyConfig(BaseModel):
    """An offline latency run: `vllm bench latency`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["latency"]
    batch_size: int = Field(8, gt=0)
    input_len: int = Field(32, gt=0)
    output_len: int = Field(128, gt=0)
    n: int = Field(1, gt=0)
    num_iters_warmup: int = Field(10, ge=0)
    num_iters: int = Field(30, gt=0)
    use_beam_search: bool = False
    disable_detokenize: bool = False
    timeout_s: FiniteFloat = Field(1800.0, gt=0)  # ours: the whole command's limit

    def result_names(self) -> list[str]:
        return list(LATENCY_RESULTS)


class AccuracyConfig(BaseModel):
    """An accuracy case: lm-evaluation-harness scores one task against the configuration's
    server (its API models, `local-completions` or `local-chat-completions`), as the serve
    cases of the configuration measure it (run/accuracy.py). A list of tasks is an axis."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["accuracy"]
    # An lm-eval task name, one the package ships (load/accuracy_task.py), or a task YAML file
    # (which reads local data: nothing is downloaded while a case runs).
    task: str = Field(min_length=1)
    # lm-eval's --limit: the first N samples (an integer), or a fraction of them (under 1).
    limit: int | FiniteFloat | None = Field(None, gt=0)
    num_fewshot: int | None = Field(None, ge=0)
    # Requests in flight at once (lm-eval's num_concurrent; each request carries one prompt).
    batch_size: int = Field(1, gt=0)
    # lm-eval's API model: completions scores answers by loglikelihood (multiple choice) and
    # generates; chat-completions only generates.
    api: Literal["completions", "chat-completions"] = "completions"
    # Ours: the whole evaluation must end within this.
    timeout_s: FiniteFloat = Field(1800.0, gt=0)

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float) and not value < 1:
            raise ValueError("a fractional limit lies under 1 (a count is an integer)")
        return value

    def result_names(self) -> list[str]:
        return list(metric_names.ACCURACY_RESULTS)


def measures(workload: Any, name: str) -> bool:
    """Whether a workload's case can record the result `name`: one of its names, or, for an
    accuracy case, any metric under an lm-eval filter as its record names it."""
    if isinstance(workload, AccuracyConfig) and metric_names.is_accuracy_result(name):
        return True
    return name in workload.result_names()


# What `benchmark:` describes, by its `kind` (serve when absent).
OfflineConfig = ThroughputConfig | LatencyConfig
WorkloadConfig = BenchmarkConfig | ThroughputConfig | LatencyConfig | AccuracyConfig
BENCHMARK_KINDS: dict[str, type[BaseModel]] = {
    "serve": BenchmarkConfig,
    "capacity": CapacityConfig,
    "throughput": ThroughputConfig,
    "latency": LatencyConfig,
    "accuracy": AccuracyConfig,
}


class Suite(BaseModel):
    """A whole suite file before expansion; list values in server/benchmark are axes."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    server: dict[str, Any]
    benchmark: dict[str, Any] = Field(default_factory=dict)
    thresholds: dict[str, Threshold] = Field(default_factory=dict)
    repeat: int = Field(1, gt=0)
    exclude: list[Exclusion] = Field(default_factory=list)
    # Each case ends with a short run under vLLM's profiler (`/start_profile`, `/stop_profile`).
    profile: bool = False
    # The regression gate: metric -> tolerance (a fraction), against --profllm-baseline.
    regression: dict[str, float] = Field(default_factory=dict)

    @field_validator("regression", mode="before")
    @classmethod
    def _regression(cls, value: object) -> dict[str, float]:
        return parse_regression(value)

    def __repr_args__(self) -> Any:
        # pytest prints reprs (-l, JUnit XML): `server:` shows a secret (api_key) as ***.
        for name, value in super().__repr_args__():
            server = name == "server" and isinstance(value, dict)
            yield name, RedactedDict(value) if server else value

    @model_validator(mode="after")
    def _repeats_for_throughputs(self) -> Suite:
        per_repeat = [
            name for name in self.regression
            if name in PER_REPEAT_METRICS and name not in BRACKETED_METRICS
        ]
        if per_repeat and self.repeat < 2:
            raise ValueError(
                f"regression: {per_repeat[0]} is compared on one value per repeat: "
                "set 'repeat: 2' or more"
            )
        return self

    @field_validator("server")
    @classmethod
    def _has_model(cls, server: dict[str, Any]) -> dict[str, Any]:
        if "model" not in server:
            raise ValueError("'model' is required (the model name or path vLLM serves)")
        return server


def _server_key_problem(key: object, registry: Registry) -> str | None:
    if not isinstance(key, str) or not _ARG_NAME.match(key):
        return f"{key!r} is not an engine argument name (snake_case, as in vLLM's EngineArgs)"
    name = key.split(".")[0]
    if name in LEASED_SERVER_ARGS:
        return f"'{name}' is set by profllm's port lease; remove it"
    if name not in registry.options:
        hint = did_you_mean(name, list(registry.options))
        return f"unknown engine argument of vLLM {registry.vllm_version}{hint or _NO_MATCH}"
    return None


_NO_MATCH = " (see `profllm engine-args --list` for all of them)"


def load_suite_file(
    path: Path, registry: Registry | None = None
) -> tuple[Suite, dict[tuple[Any, ...], int]]:
    """Read and validate a YAML suite; returns the suite and each key path's line (1-based)."""
    try:
        text = path.read_text()
        # Composing shares an alias's node (cheap even for a "billion laughs"); its size and
        # its keys are checked before anything expands it.
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_node(node, str(path))
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        raise SuiteError(_yaml_problem(error, str(path), text)) from None
    except (OSError, yaml.YAMLError) as error:
        raise SuiteError(f"{path}: cannot read suite: {error}") from None
    lines = _key_lines(node) if node is not None else {}
    if not isinstance(data, dict):
        raise SuiteError(f"{path}:1: a suite is a mapping with 'server:' and 'benchmark:' blocks")
    _paths_from(path.parent, data.get("benchmark"))
    return validate_suite(data, str(path), lines, registry), lines


# `dataset_path: profllm:trace_example.jsonl` names a file the package ships (load/data/),
# so an example suite works wherever it is copied.
SHIPPED_PREFIX = "profllm:"
SHIPPED_DATA = Path(__file__).resolve().parents[1] / "load" / "data"


def _paths_from(folder: Path, benchmark: object) -> None:
    """A relative `dataset_path` names a file beside the suite, wherever pytest runs from."""
    if not isinstance(benchmark, dict) or "dataset_path" not in benchmark:
        return
    value = benchmark["dataset_path"]

    def resolved(item: object) -> object:
        if isinstance(item, str) and item.startswith(SHIPPED_PREFIX):
            return str(SHIPPED_DATA / item.removeprefix(SHIPPED_PREFIX))
        if isinstance(item, str) and item and not Path(item).expanduser().is_absolute():
            return str(folder / item)
        return item

    benchmark["dataset_path"] = (
        [resolved(item) for item in value] if isinstance(value, list) else resolved(value)
    )


# A suite of this many values, aliases expanded, is no suite anyone wrote by hand.
MAX_SUITE_VALUES = 100_000


def _check_node(root: yaml.Node, where: str) -> None:
    """SuiteError for a suite whose aliases expand past MAX_SUITE_VALUES, or with a key given
    twice in one mapping (YAML keeps the last silently; a suite must not)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # an alias of an enclosing node (a cycle) counts once
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key, value in node.value:
                line = key.start_mark.line + 1
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise SuiteError(
                            f"{where}:{line}: key {key.value!r} appears twice in one mapping "
                            f"(first at line {seen[key.value]}): YAML would keep the last alone"
                        )
                    seen[key.value] = line
                total += size(key) + size(value)
                if total > MAX_SUITE_VALUES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_SUITE_VALUES:
                    break
        sizes[id(node)] = total
        if total > MAX_SUITE_VALUES:
            raise SuiteError(
                f"{at_line(where, node.start_mark.line + 1)}: the suite expands to more than "
                f"{MAX_SUITE_VALUES:,} values through YAML aliases; refused"
            )
        return total

    size(root)


def _yaml_problem(error: yaml.MarkedYAMLError, where: str, text: str) -> str:
    """`file:line: invalid YAML: ...` at the line of the mistake, saying what YAML expected.

    PyYAML marks where it gave up (problem_mark); for an unclosed bracket or quote, or a key
    without its colon, that is a later line, and the mistake is where the construct began
    (context_mark)."""
    problem = error.problem or "cannot parse"
    context = error.context or ""
    mark = error.problem_mark
    if problem == "mapping values are not allowed here" and mark is not None:
        # `model m` above `max_num_seqs: 4`: YAML reads the first line's text on into the
        # second and stops at its colon; the mistake is the line without one.
        source = text.splitlines()
        above = next((n for n in range(mark.line - 1, -1, -1) if source[n].strip()), None)
        line_above = source[above].strip() if above is not None else ""
        plain_text = ":" not in line_above and not line_above.startswith(("-", "#"))
        if above is not None and plain_text:
            return (
                f"{at_line(where, above + 1)}: invalid YAML: expected 'key: value', found "
                f"no ':' on this line (YAML read it on into line {mark.line + 1})"
            )
    starts = context.startswith(("while scanning", "while parsing a flow"))
    mark = error.context_mark if starts and error.context_mark else error.problem_mark
    line = mark.line + 1 if mark is not None else None
    message = f"invalid YAML: {problem}"
    if context and error.context_mark is not None:
        message += f" ({context} that began at line {error.context_mark.line + 1}"
        if error.problem_mark is not None:
            message += f"; YAML stopped at line {error.problem_mark.line + 1}"
        message += ")"
    return f"{at_line(where, line)}: {message}"


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
        _check_exclusions(suite, registry, lines, problems)
    if suite is None or problems.found:
        raise problems.error()
    return suite


def _check_server(
    server: dict[str, Any],
    registry: Registry,
    lines: dict[tuple[Any, ...], int],
    problems: _Problems,
) -> dict[str, Any]:
    """Each key and each value of each axis once (not every combination: the cross product
    can be large); the block with values as vLLM reads them, every list an axis."""
    checked: dict[str, Any] = {}
    for key, value in server.items():
        problem = _server_key_problem(key, registry)
        if problem is not None:
            problems.add(lines.get(("server", key)), f"server.{key}: {problem}")
            continue
        resolved = registry.resolve(key)
        if resolved is None:
            continue  # not reached: _server_key_problem knows every name
        option, path = resolved
        axis = option.axis(value, path)
        values = []
        for index, item in enumerate(axis if axis is not None else [value]):
            loc: tuple[Any, ...] = ("server", key, index) if axis is not None else ("server", key)
            try:
                values.append(option.check_field(path, item) if path else option.check(item))
                value_ = values[-1]
                if key in ENV_SECRETS and isinstance(value_, list) and len(value_) > 1:
                    raise ValueError(
                        "more than one value would go on the server's command line, which any "
                        f"local user reads (/proc/PID/cmdline); give one (it travels as "
                        f"{ENV_SECRETS[key]})"
                    )
            except ValueError as error:
                shown = f"server.{key}" + (f"[{index}]" if axis is not None else "")
                # A place inside a list value reads as an index of the key: `key[1]: ...`.
                sep = "" if str(error).startswith("[") else ": "
                problems.add(
                    _nearest_line(lines, loc), f"{shown}{sep}{error}{_shown_input(loc, item)}"
                )
        if axis is not None:
            checked[key] = values
        elif values:
            # One value that is a list: an axis of one, so that every list here is an axis.
            checked[key] = [values[0]] if isinstance(values[0], list) else values[0]
    return checked


def combinations(block: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of a block's axes (a list value is an axis)."""
    keys = list(block)
    choices = [block[key] if isinstance(block[key], list) else [block[key]] for key in keys]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*choices)]


def fold_dotted_keys(server: dict[str, Any]) -> dict[str, Any]:
    """One server's values with each `name.field: value` merged into the JSON value of
    `name`, as vLLM merges `--name.field value` into `--name`."""
    folded = {key: value for key, value in server.items() if "." not in key}
    for key, value in server.items():
        if "." not in key:
            continue
        name, *path = key.split(".")
        base = folded.get(name)
        merged = json.loads(base) if isinstance(base, str) else copy.deepcopy(base)
        if not isinstance(merged, dict):
            merged = {}  # as in vLLM, where the dotted form then replaces the value
        inner = merged
        for part in path[:-1]:
            inner = inner.setdefault(part, {})
        inner[path[-1]] = value
        folded[name] = merged
    return folded


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


def _check_rules(
    server: dict[str, Any], lines: dict[tuple[Any, ...], int], problems: _Problems
) -> None:
    for combination in _rule_combinations(server):
        problem = cross_field_problem(combination)
        if problem is not None:
            key, message = problem
            problems.add(lines.get(("server", key)), f"server: {message}")


def _rule_combinations(server: dict[str, Any]) -> list[dict[str, Any]]:
    return combinations({key: server[key] for key in _RULE_KEYS if key in server})


_RULE_KEYS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "max_num_active_seqs",
    "data_parallel_size",
    "data_parallel_size_local",
)


def cross_field_problem(server: dict[str, Any]) -> tuple[str, str] | None:
    """The first rule across engine arguments that vLLM 0.33.0 would refuse at start-up, as
    (key, message); only rules that need no model or device to decide, on values given."""

    def number(key: str) -> int | None:
        value = server.get(key)
        if isinstance(value, str):
            value = human_int(value, allow_auto=True)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return value

    tokens, seqs, length = (
        number("max_num_batched_tokens"), number("max_num_seqs"), number("max_model_len")
    )
    active, dp, dp_local = (
        number("max_num_active_seqs"),
        number("data_parallel_size"),
        number("data_parallel_size_local"),
    )
    if tokens is not None and seqs is not None and tokens < seqs:
        return "max_num_batched_tokens", (
            f"max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({seqs})"
        )
    if (
        tokens is not None
        and length is not None
        and tokens < length
        and server.get("enable_chunked_prefill") is False
    ):
        return "max_num_batched_tokens", (
            f"max_num_batched_tokens ({tokens}) is below max_model_len ({length}) with "
            "enable_chunked_prefill false: prompts longer than it could never be scheduled"
        )
    if active is not None and seqs is not None and active > seqs:
        return "max_num_active_seqs", (
            f"max_num_active_seqs ({active}) must not exceed max_num_seqs ({seqs})"
        )
    if dp is not None and dp_local is not None and dp_local > dp:
        return "data_parallel_size_local", (
            f"data_parallel_size_local ({dp_local}) must not exceed data_parallel_size ({dp})"
        )
    return None


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


def describe_error(
    error: ValidationError,
    where: str,
    lines: dict[tuple[Any, ...], int],
    model: type[BaseModel],
    prefix: tuple[Any, ...] = (),
) -> str:
    """The first validation error as one line: `file:line: key: what is wrong; what is allowed`."""
    line, text = describe_errors(error, lines, model, prefix)[0]
    return f"{at_line(where, line)}: {text}"


def describe_errors(
    error: ValidationError,
    lines: dict[tuple[Any, ...], int],
    model: type[BaseModel],
    prefix: tuple[Any, ...] = (),
) -> list[tuple[int | None, str]]:
    """Every validation error as (line, `key: what is wrong; what is allowed`)."""
    described = []
    for each in error.errors():
        loc = prefix + tuple(each["loc"])
        line = _nearest_line(lines, loc)
        key = ".".join(str(part) for part in loc) or "(top level)"
        if each["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, loc[len(prefix) :])
            hint = did_you_mean(str(loc[-1]), allowed)
            described.append((line, f"unknown key '{key}'{hint}; allowed: {', '.join(allowed)}"))
            continue
        message = each["msg"].removeprefix("Value error, ")
        described.append((line, f"{key}: {message}{_shown_input(loc, each.get('input'))}"))
    return described


def _shown_input(loc: tuple[Any, ...], value: Any) -> str:
    # A whole block is too long to quote, and may hold an api_key; a secret is never shown.

    if isinstance(value, dict | list):
        return ""
    if any(isinstance(part, str) and is_secret(part) for part in loc):
        return f" (got {REDACTED})"
    return f" (got {value!r})"


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed where an error points, walking nested models along its location."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        else:
            # Inside a dict[str, Model] or list[Model]: the key or index leads to the Model.
            args = get_args(current)
            current = args[-1] if args else None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return list(model.model_fields)


def did_you_mean(name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def at_line(where: str, line: int | None) -> str:
    """`file:line`, or just `file` where the line is unknown (a marker's dict)."""
    return f"{where}:{line}" if line else where


def _nearest_line(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _key_lines(node: yaml.Node, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    lines: dict[tuple[Any, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key_path = (*path, key_node.value)
            lines[key_path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, key_path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            lines.update(_key_lines(item, (*path, index)))
    return lines
