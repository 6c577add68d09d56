"""Running one serve case: its server, prompts, load, metrics and verdicts, top to bottom.

The runner never prints and never raises for a missed threshold: it returns the outcome, and
the pytest item decides how to fail. The record is finished after the item's teardown, when
it is known whether its server stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.secrets import Secret
from pytest_profllm.hosts.cores import CoreLease, client_processes
from pytest_profllm.hosts.foreign_cpu import ForeignCpu
from pytest_profllm.load import loops, metrics, stages
from pytest_profllm.load.attempts import Attempts
from pytest_profllm.load.bench import (
    load_settings,
    measure,
    run_load,
    workload_own_hits,
)
from pytest_profllm.load.conversation import Conversations, Workload, by_turn, make_workload
from pytest_profllm.load.dataset import (
    Codec,
    PromptRequest,
    ServerCodec,
    TokenizerCodec,
    make_prompts,
)
from pytest_profllm.load.lora_mix import by_adapter
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.rounds import MorePrompts, run_rounds
from pytest_profllm.load.schedule import LoadResult, LoadSettings
from pytest_profllm.load.server_state import empty_caches
from pytest_profllm.load.server_view import OVERHEAD_KEYS, load_view
from pytest_profllm.load.trace import prefix_hit_figures
from pytest_profllm.load.trace_join import JOINED_SHARE, Joined, take_spans
from pytest_profllm.load.validity import (
    DEFAULT_RULES,
    Judgement,
    LoadFacts,
    Rules,
    ServerWindow,
    judge,
)
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import MEDIA_DATASETS, BenchmarkConfig
from pytest_profllm.run.outcome import (
    CaseFailed,
    CaseOutcome,
    check_thresholds,
    dataset_refusals,
    request_row,
)
from pytest_profllm.run.profiling import (
    PROFILE_PROMPTS,
    ProfilingFailed,
    profile_prefix,
    run_profiled,
)
from pytest_profllm.run.telemetry import Sampler
from pytest_profllm.server.process import ServerExited, ServerProcess
from pytest_profllm.server.workers import WorkerServers
from pytest_profllm.sim.model_files import MODEL_DIR

T = TypeVar("T")


def run_case(
    case: Case,
    servers: WorkerServers,
    outcome: CaseOutcome,
    rules: Rules = DEFAULT_RULES,
    remeasure: int = 0,
    budget: RemeasureBudget | None = None,
) -> CaseOutcome:
    """Start or reuse the server, send the workload from an emptied prefix cache (again, up to
    `remeasure` times and within the session's `budget`, while the host makes the measurement
    invalid), compute metrics and verdicts."""
    bench = case.benchmark
    assert isinstance(bench, BenchmarkConfig), "offline kinds run in offline.runner"
    attempts = Attempts(remeasure, budget or RemeasureBudget())
    with servers.serving(case) as server:
        outcome.server = server
        receiver, untraced = servers.spans_of(server)
        stages.enter("loading")
        codec = codec_for(case, servers.engine, server.base_url)
        # The host's load cores are held from drawing the prompts (the client's own work, kept
        # off another case's load) to the last attempt; waiting for them comes first, outside
        # every measurement.
        with servers.load_cores(server, bench.client_processes) as outcome.load_cores:
            with dataset_refusals(case):
                prompts = make_workload(bench, codec, context_of(case))
            settings = load_settings(
                bench, server.base_url, served_name(case.server), api_key=api_key_of(case.server),
                client_processes=client_processes(bench.client_processes, outcome.load_cores),
            )
            own_hits = workload_own_hits(prompts, bench, codec)
            while True:
                started_at = time.time()
                outcome.prefix_cache = empty_caches(
                    server.base_url, bench, api_key_of(case.server)
                ).describe()
                foreign = ForeignCpu(load_cores_of(server, outcome.load_cores))
                key = receiver.expect() if receiver is not None else ""
                counted = receiver.snapshot() if receiver is not None else None
                traced = dataclasses.replace(settings, trace_key=key)
                load, sent = _load(server, traced, prompts, outcome, more_prompts(case, codec))
                share = foreign.share()
                spans = take_spans(
                    receiver, key, load.outcomes, before=counted, not_traced=untraced
                )
                judged = judge_attempt(
                    load, bench, codec, outcome.server_window,
                    own_hits if sent is prompts else workload_own_hits(sent, bench, codec),
                    share, rules, spans,
                )
                results, outcome.server_view = judged.results, judged.server_view
                with_spans(outcome, spans)
                if outcome.server_view is not None and judged.judgement.outside_client:
                    outcome.server_view["overhead_outside_client"] = (
                        judged.judgement.outside_client)
                outcome.telemetry.update(judged.view)
                outcome.telemetry["host_foreign_cpu_share"] = share
                reasons = judged.judgement.reasons
                attempts.add(
                    started_at, reasons, results, outcome.telemetry, outcome.prefix_cache
                )
                # Requests the server failed fail the case whatever the host does: such a
                # load is not measured again.
                failing = metrics.served_problem(load.outcomes, results, allowed_failures(case))
                if failing is not None or not attempts.again(reasons):
                    break
                stages.enter("remeasuring", f"attempt {len(attempts.kept) + 1}")
    if bench.dataset_name == "timed_trace" and isinstance(prompts, list):
        telemetry = outcome.telemetry
        telemetry.update(prefix_hit_figures(
            prompts, telemetry.get("server_kv_block_size"),
            telemetry.get("server_prefix_cache_hit_rate"),
        ))
    # The server lived through the load on its own port (serving checked): the figures count.
    outcome.results = results
    outcome.attempts = attempts.kept
    outcome.threshold_results = check_thresholds(case, outcome.results)
    outcome.invalid_reason = attempts.invalid_reason(reasons)
    outcome.request_failures = metrics.request_failures(load.outcomes)
    outcome.by_turn = by_turn(load.outcomes)
    outcome.by_adapter = by_adapter(load.outcomes, load.duration)
    check_modality(case, load.outcomes)
    check_served(load.outcomes, outcome.results, allowed_failures(case))
    if case.profile and server.profile_dir is not None:
        stages.enter("profiling")
        outcome.profiling = _profile(server, settings, prompts, outcome.run_id)
    outcome.finished_at = time.time()
    return outcome


@dataclasses.dataclass
class JudgedAttempt:
    results: dict[str, Any]  # vLLM's metrics, the client's health and what it added
    view: dict[str, Any]  # the server's own figures (system figures)
    server_view: dict[str, Any]  # the record's `server_view` block
    judgement: Judgement


def judge_attempt(
    load: LoadResult,
    bench: BenchmarkConfig,
    codec: Codec,
    window: ServerWindow,
    own_hits: int,
    foreign_share: float | None,
    rules: Rules,
    spans: Joined | None = None,
) -> JudgedAttempt:
    """One attempt's figures and the judge's answer on them, as a case keeps them; with the
    requests' joined server `spans` (load/trace_join.py), what the client added to each
    request at p50, p90, p99 is in `results` and judged too."""
    results, health = measure(load, bench, codec)
    results.update(health)
    figures = dict(spans.figures) if spans is not None else {}
    joined_share = figures.pop(JOINED_SHARE, None)
    results.update(figures)
    view, server_view = load_view(*window, results)
    # The server's figures are system figures (`system_server_*` columns, beside its
    # cache's); what the client added is a metric a threshold may name. Only where there is
    # one: a pooling load has no TTFT, hence no TTFT overhead.
    overheads = {key: view.pop(key) for key in OVERHEAD_KEYS}
    results.update({k: v for k, v in overheads.items() if v is not None})
    facts = LoadFacts(load, bench, health, results, own_hits, foreign_share,
                      joined_share, spans.problem if spans is not None else None,
                      spans.server_ttft_p99_ms if spans is not None else None)
    judgement = judge(facts, window, rules)
    return JudgedAttempt(results, view, server_view, judgement)


def with_spans(outcome: CaseOutcome, spans: Joined) -> None:
    """Each request row with its server span's figures; the share joined and why none was in
    the server view (load/trace_join.py). What the client added is in the results already
    (`judge_attempt`)."""
    for row, joined in zip(outcome.requests, spans.rows, strict=True):
        row.update(joined)
    if outcome.server_view is not None:
        outcome.server_view[JOINED_SHARE] = spans.figures[JOINED_SHARE]
        outcome.server_view["spans_problem"] = spans.problem
        outcome.server_view["span_receiver"] = spans.receiver


def context_of(case: Case) -> int | None:
    """The server's max_model_len where the suite sets one (`32k` read as vLLM reads it)."""
    value = case.server.get("max_model_len")
    if isinstance(value, str):
        value = human_int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def codec_for(case: Case, engine: str, base_url: str) -> Codec:
    """The tokenizer that sizes the prompts: a local one, else the server's own."""
    tokenizer = _tokenizer_for(case, engine)
    if tokenizer is not None:
        return TokenizerCodec.load(tokenizer)
    return ServerCodec(base_url, served_name(case.server), api_key_of(case.server))


def more_prompts(case: Case, codec: Codec) -> MorePrompts:
    """A later round's prompts (`until:`): the workload's, so many, from that seed."""
    bench = case.benchmark
    assert isinstance(bench, BenchmarkConfig)

    def more(count: int, seed: int) -> list[PromptRequest]:
        config = bench.model_copy(update={"num_prompts": count, "seed": seed})
        with dataset_refusals(case):
            return make_prompts(config, codec, context_of(case))

    return more


def _load(
    server: ServerProcess, settings: LoadSettings, prompts: Workload, outcome: CaseOutcome,
    more: MorePrompts,
) -> tuple[LoadResult, Workload]:
    """The workload sent with telemetry sampled (in rounds, with `until:`); the per-request
    rows and the telemetry go into the outcome, also when the server turns out lost
    afterwards. Returns the load and every prompt it sent."""
    gpu_ids = server.lease.gpus if server.device == "gpu" else ()
    until = getattr(outcome.case.benchmark, "until", None)
    sent: Workload = prompts
    with Sampler(server.pid, gpu_ids, f"{server.base_url}/metrics") as sampler:
        if until is None or isinstance(prompts, Conversations):
            load = loops.run(load_while_alive(server, run_load(settings, prompts)))
        else:
            load, stop, sent = loops.run(
                load_while_alive(server, run_rounds(settings, prompts, more, until))
            )
            outcome.until = stop.as_record()
    outcome.telemetry = sampler.record()
    # On the load's own time axis, the one its requests' times use.
    outcome.series = sampler.series(origin=load.clock_start)
    outcome.server_window = (sampler.metrics_before, sampler.metrics_after)
    outcome.client_limit = load.client_limit
    outcome.requests = [
        request_row(index, o, load.clock_start) for index, o in enumerate(load.outcomes)
    ]
    return load, sent


def _profile(
    server: ServerProcess, settings: LoadSettings, prompts: Workload, run_id: str
) -> dict[str, Any]:
    """A short run of the workload under vLLM's profiler, after the measured one."""
    assert server.profile_dir is not None
    short: Workload = (
        prompts.first(PROFILE_PROMPTS)
        if isinstance(prompts, Conversations)
        else prompts[:PROFILE_PROMPTS]
    )
    profiled = dataclasses.replace(settings, num_warmups=0)
    try:
        return run_profiled(
            server.base_url,
            server.profile_dir,
            profile_prefix(run_id),
            len(short),
            lambda: loops.run(run_load(profiled, short)),
        )
    except ProfilingFailed as error:
        raise CaseFailed(f"profiling: {error}") from None


_ALIVE_POLL_S = 0.5


async def load_while_alive(server: ServerProcess, load: Coroutine[Any, Any, T]) -> T:
    """The load's result; ServerExited when the server exits first: the rest of the schedule is
    not sent (each request would fail at once, spaced by the arrival schedule)."""
    task = asyncio.ensure_future(load)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_ALIVE_POLL_S)
        if done:
            return task.result()
        if not server.alive():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ServerExited(server.exit_description())


def check_served(
    outcomes: list[metrics.RequestOutcome], results: dict[str, Any], allowed: int = 0
) -> None:
    if (problem := metrics.served_problem(outcomes, results, allowed)) is not None:
        raise CaseFailed(problem)


def check_modality(case: Case, outcomes: list[metrics.RequestOutcome]) -> None:
    """A server that refused every request of a kind its model does not take (images to a
    text-only model; a pooling request to a generating one, or the reverse) is the suite's
    mistake: one line naming the suite, the key and the server's own reason."""
    bench = case.benchmark
    assert isinstance(bench, BenchmarkConfig)
    if not outcomes or any(o.status != 400 and o.status != 404 for o in outcomes):
        return
    reason = outcomes[0].error.split(": ", 1)[-1][:200]
    model = served_name(case.server)
    if bench.dataset_name in MEDIA_DATASETS:
        media = {"custom_audio": "audio"}.get(bench.dataset_name, "images")
        raise CaseFailed(
            f"{case.source}: benchmark.dataset_name {bench.dataset_name!r} sends {media} and "
            f"{model} refused every request: {reason}"
        )
    if bench.is_pooling:
        raise CaseFailed(
            f"{case.source}: benchmark.backend {bench.backend!r} needs a pooling model "
            f"(server.runner: pooling); {model} refused every request: {reason}"
        )
    if case.server.get("runner") == "pooling":
        raise CaseFailed(
            f"{case.source}: server.runner is pooling, so {model} makes no tokens for "
            f"benchmark.backend {bench.backend!r}: use openai-embeddings or vllm-rerank "
            f"({reason})"
        )


def allowed_failures(case: Case) -> int:
    """How many failed requests the suite allows: its `failed` (or `failed_requests`)
    threshold's max; none by default."""
    for name in ("failed", "failed_requests"):
        threshold = case.thresholds.get(name)
        if threshold is not None and threshold.max is not None:
            return max(0, int(threshold.max))
    return 0


def _tokenizer_for(case: Case, engine: str) -> str | None:
    """A local tokenizer folder or file, or None to ask the server (no model download)."""
    tokenizer = getattr(case.benchmark, "tokenizer", None)
    if tokenizer:
        return str(tokenizer)
    model = str(case.server["model"])
    if engine == "sim":
        # The simulator serves its bundled tokenizer unless the model folder has one.
        return model if os.path.isfile(os.path.join(model, "tokenizer.json")) else str(MODEL_DIR)
    local = str(case.server.get("tokenizer") or model)
    return local if os.path.isfile(os.path.join(local, "tokenizer.json")) else None


def api_key_of(server: dict[str, Any]) -> str | None:
    # vLLM takes one key or several (any of them is accepted): the client sends the first.
    key = server.get("api_key")
    if isinstance(key, list):
        key = key[0] if key else None
    # A Secret: the frames it passes through show it as *** (pytest -l, JUnit XML).
    return None if key is None else Secret(str(key))


def served_name(server: dict[str, Any]) -> str:
    names = server.get("served_model_name")
    if isinstance(names, list) and names:
        return str(names[0])
    return str(names or server["model"])


def load_cores_of(server: ServerProcess, cores: CoreLease | None) -> frozenset[int]:
    """The cores a load's measurement ran on: its client's, and its server's where it holds
    cores (a simulator's for the load, vLLM's core sets on CPU); none without load cores (the
    client ran anywhere: nothing to watch)."""
    if cores is None or not cores.client:
        return frozenset()
    return frozenset(cores.client) | frozenset(cores.server) | server.launch_cores()
