"""The serve workload (`kind: serve`, the default): `vllm bench serve`'s flags in snake_case,
and the rules across them that vLLM's client would refuse, checked before any server starts."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    field_serializer,
    field_validator,
    model_validator,
)

from pytest_profllm.limits import MAX_REPLAY_S, MAX_REQUEST_TOKENS
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite.until import Until, until_problem

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
    # Ours: who waits for whom (load/trace.py `_Links`). A line follows the line before it in
    # its session (AIPerf's `session_id`), or the line whose request id its parent id names
    # (Bailian's `chat_id`, `parent_chat_id`; -1: none), after a delay (AIPerf's `delay`, in
    # the timestamps' unit).
    timed_trace_label_session_id: str = "session_id"
    timed_trace_label_request_id: str = "chat_id"
    timed_trace_label_parent_id: str = "parent_chat_id"
    timed_trace_label_delay: str = "delay"
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
    # Ours, not vLLM's: spread the client over processes when one event loop cannot keep up;
    # `auto`: one per load core the host pool leased the case's client (at least one).
    client_processes: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    # Ours: keep what earlier cases left in the server's prefix cache (default: each case,
    # repeat and capacity probe starts from an emptied cache, load/server_state.py).
    warm_cache: bool = False
    # Ours: a LoRA adapter mix (load/lora_mix.py). Each request asks for one of these models
    # (adapters of the server's lora_modules, or its base model's name), by weight; weighted:
    # drawn at random from the seed; round_robin: in turn, in proportion to the weights. A
    # conversation keeps its model for all its turns.
    lora_mix: dict[str, FiniteFloat] | None = None
    lora_assignment: Literal["weighted", "round_robin"] = "weighted"

    @field_validator("lora_mix")
    @classmethod
    def _mix(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("lora_mix names no model; give adapter names with weights")
        for name, weight in value.items():
            if not name.strip():
                raise ValueError("lora_mix has an empty model name")
            if not weight > 0:
                raise ValueError(
                    f"lora_mix weight of {name!r} is {weight:g}; weights must be positive"
                )
        return value
    # Ours: send the load in rounds until a latency statistic's interval is as narrow as asked
    # (plan/suite/until.py, load/rounds.py); None: num_prompts once.
    until: Until | None = None

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
        most = max(self.num_prompts, self.until.max_prompts if self.until else 0)
        lasts_s = most / self.request_rate
        if lasts_s > MAX_REPLAY_S:
            raise ValueError(
                f"request_rate: {most:,} requests at {self.request_rate:g} req/s "
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
            if self.client_processes != 1:
                raise ValueError("dataset_name 'conversation' runs in one client process")
        if "lora_assignment" in self.model_fields_set and not self.lora_mix:
            raise ValueError("lora_assignment needs lora_mix (the adapters and their weights)")
        if self.lora_mix and self.is_pooling:
            raise ValueError("lora_mix applies to generating backends (openai, openai-chat)")
        self._check_until()
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

    def _check_until(self) -> None:
        if self.until is None:
            return
        # Rounds are more requests of one arrival process: a conversation's turns and a
        # trace's recorded requests are a workload of their own, not more of the same.
        if self.dataset_name in ("conversation", "timed_trace"):
            raise ValueError(
                f"until: dataset_name {self.dataset_name!r} is a whole workload, not one to "
                "send more rounds of; until takes the other datasets"
            )
        if self.ramp_up_strategy is not None:
            raise ValueError(
                "until: a ramp-up's rate changes over the load; rounds repeat one rate"
            )
        problem = until_problem(self.until, self.num_prompts, self.latency_metrics)
        if problem is not None:
            raise ValueError(problem)

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
        # The client's overhead over the server's own TTFT and E2E: a pooling load has no TTFT.
        overhead = [] if self.is_pooling else list(metric_names.CLIENT_OVERHEAD_RESULTS)
        return (names + list(metric_names.CLIENT_QUEUE_RESULTS)
                + list(metric_names.CLIENT_HEALTH_KEYS) + overhead)
