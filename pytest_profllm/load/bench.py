"""One benchmark against a running server, as `vllm bench serve` runs it: prompts, load,
metrics, and a result with vLLM's keys. `profllm bench` is a thin wrapper over `run_bench`.

Unlike vLLM's client, a benchmark of nothing is an error (`BenchFailed`), and a load that is
no measurement (load/validity.py, as a suite's case is judged) says so in `validity` and
`invalid_reason`, with the rules that could not be applied here in `rules_not_applied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import secrets
import socket
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pytest_profllm.engine.secrets import bearer
from pytest_profllm.hosts.descriptors import ClientCap, raise_open_file_limit
from pytest_profllm.load import client_watch, loops, metrics
from pytest_profllm.load.bench_result import DETAILED_KEYS, result_json
from pytest_profllm.load.client import open_pool, run_share, run_warmups
from pytest_profllm.load.conversation import (
    Conversations,
    Workload,
    make_workload,
    run_conversations,
)
from pytest_profllm.load.dataset import (
    Codec,
    PromptRequest,
    ServerCodec,
    TokenizerCodec,
)
from pytest_profllm.load.processes import run_in_processes
from pytest_profllm.load.schedule import (
    LoadResult,
    LoadSettings,
    client_cores,
    load_offsets,
)
from pytest_profllm.load.server_state import (
    CacheState,
    empty_caches,
    own_prefix_hits,
    scrape_metrics,
    shared_on_purpose,
)
from pytest_profllm.load.server_view import (
    DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
    load_view,
)
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.load.steady_state import steady_figures
from pytest_profllm.load.trace_join import JOINED_SHARE, Joined, take_spans
from pytest_profllm.load.validity import (
    Judgement,
    LoadFacts,
    Rules,
    ServerWindow,
    judge,
    on_this_host,
)
from pytest_profllm.plan.suite import BenchmarkConfig

# How long `profllm bench --spans-port` waits for a load's spans after its last response: the
# server is the user's, and vLLM's exporter sends every OTEL_BSP_SCHEDULE_DELAY, 5 s unless
# set (a server started with OTEL_BSP_SCHEDULE_DELAY=200 has them in within a fifth of a
# second). The wait ends as soon as every span is in.
BENCH_SPAN_WAIT_S = 10.0


C = TypeVar("C", bound=BenchmarkConfig)


class BenchFailed(Exception):
    """The benchmark measured nothing worth a number; the message quotes the first errors."""


class ServerUnreachable(Exception):
    """Nothing accepts connections at the server's address; the message is one line."""


@contextlib.contextmanager
def _objects_frozen() -> Iterator[None]:
    """What the process holds before the load, collected once and frozen out of the garbage
    collector's reach for the load, as `vllm bench serve` does before its run: a collection
    during the load then walks the load's own objects only, not, in a pytest worker, every
    earlier case's request rows (a pause the send loop would show as schedule lag)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def run_load(
    settings: LoadSettings, requests: Sequence[PromptRequest] | Conversations
) -> LoadResult:
    """Send `requests` on vLLM's arrival schedule and time every response (conversations:
    each conversation's turns in turn, load/conversation.py).

    With `client_processes` > 1 the requests are dealt round-robin to that many processes,
    which share the schedule's clock (the host's monotonic clock) and each own a share of
    `max_concurrency`: for servers faster than one event loop can read.
    """
    raise_open_file_limit()
    # Each connection is a descriptor: a load that would open more than this process may
    # hold runs at the most it may (as under max_concurrency), and says so, rather than
    # failing requests in the client that would read as the server's failures.
    cap = ClientCap.now()
    wanted = settings.max_concurrency or len(requests)  # conversations: one connection each
    note = None
    if cap.limits(wanted):
        settings = dataclasses.replace(settings, max_concurrency=cap.connections)
        note = cap.describe()
    with _objects_frozen():
        load = await _run_load(settings, requests)
    load.open_file_limit = cap.open_file_limit
    load.client_limit = note
    return load


async def _run_load(
    settings: LoadSettings, requests: Sequence[PromptRequest] | Conversations
) -> LoadResult:
    if isinstance(requests, Conversations):
        return await run_conversations(settings, requests)
    offsets = (
        [request.timestamp or 0.0 for request in requests]
        if settings.self_timed
        else load_offsets(settings, len(requests))
    )
    if settings.client_processes > 1 and len(requests) > 1:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, run_in_processes, settings, requests, offsets)
    if settings.num_warmups and requests:
        await run_warmups(settings, requests[0])
    pool = await open_pool(settings, offsets)
    started_at = time.time()
    # The event loop's own thread: other threads of the process (a pytest worker's) are not
    # the client.
    cpu_start = time.thread_time()
    start = time.perf_counter()
    async with client_watch.watching() as watch:
        outcomes = await run_share(settings, requests, offsets, range(len(requests)), start,
                                   client=pool)
    duration = time.perf_counter() - start
    cpu_seconds = time.thread_time() - cpu_start
    if any(request.after is not None for request in requests):
        # A request that waited for another was due at the later of its time and that one's
        # end plus the delay (load/client.py `run_share`).
        offsets = [outcome.intended_start - start for outcome in outcomes]
    return LoadResult(
        outcomes, duration, started_at, start, cpu_seconds=cpu_seconds, intended_offsets=offsets,
        watch=watch, cores=client_cores(),
    )


def check_reachable(base_url: str, timeout_s: float = 10.0) -> None:
    """ServerUnreachable unless a TCP connection to `base_url` opens: a server that is down
    is one line, not every request failing or a traceback from the tokenizer's first call."""
    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        raise ServerUnreachable(f"cannot connect to {base_url}: connection refused") from None
    except TimeoutError:
        raise ServerUnreachable(
            f"cannot connect to {base_url}: no answer in {timeout_s:g} s"
        ) from None
    except OSError as error:
        why = (error.strerror or str(error)).lower()
        raise ServerUnreachable(f"cannot connect to {base_url}: {why}") from None


@dataclass
class BenchResult:
    result: dict[str, Any]  # vLLM's result JSON, plus the client's health and verdict
    load: LoadResult
    invalid_reason: str | None
    # Each request's server span joined to it (with a receiver: --spans-port); None: none.
    spans: Joined | None = None


def measure(
    load: LoadResult, config: BenchmarkConfig, codec: Codec
) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's metrics of a finished load, and the client's health (how well it kept to its
    schedule): the same figures for `profllm bench` and for a suite's case."""
    summary = metrics.compute(
        load.outcomes,
        load.duration,
        latency_metrics=config.latency_metrics,
        percentiles=config.percentiles,
        goodput_ms={str(k): v for k, v in (config.goodput or {}).items()},
        count_tokens=lambda text: len(codec.encode(text)),
        pooling=config.is_pooling,
    )
    summary.update(metrics.multimodal_summary(load.outcomes))
    summary.update(metrics.client_queue_summary(load.outcomes))
    if config.max_concurrency:
        steady = steady_figures(load.outcomes, config.max_concurrency)
        # A pooling request is one response: no token stream, so no TTFT or TPOT (as above).
        summary.update({k: v for k, v in steady.items()
                        if not (config.is_pooling and k.endswith(("_ttft_ms", "_tpot_ms")))})
    health = metrics.client_health(
        load.outcomes,
        load.intended_offsets,
        load.clock_start,
        load.duration,
        load.cpu_seconds,
        load.processes,
        load.watch,
        load.cores,
    )
    return summary, health


# The simulator says so in this header of every answer (sim/app.py).
_ENGINE_HEADER = "X-Profllm-Engine"


def server_engine(base_url: str, api_key: str | None = None) -> dict[str, str | None]:
    """Which engine answers at `base_url`, as the server itself says: the simulator by its
    header, vLLM by its /version; `unknown` where it says neither (never a guess)."""
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/version",
        headers=bearer(api_key),
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            said = response.headers.get(_ENGINE_HEADER)
            body = json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return {"name": "unknown", "version": None}
    if said:
        name, _, version = said.partition(" ")
        return {"name": name, "version": version or None}
    if isinstance(body, dict) and isinstance(body.get("version"), str):
        return {"name": "vllm", "version": body["version"]}
    return {"name": "unknown", "version": None}


def workload_own_hits(workload: Workload, config: BenchmarkConfig, codec: Codec) -> int:
    """What a cold cache could find of the workload's prompts in each other (none counted for
    a workload that shares prefixes on purpose: its cache figures are not judged)."""
    if shared_on_purpose(config) is not None or isinstance(workload, Conversations):
        return 0
    return own_prefix_hits(
        list(request.prompt_ids) if request.prompt_ids is not None
        else codec.encode(request.prompt)
        for request in workload
    )


def run_bench(
    config: BenchmarkConfig,
    base_url: str,
    model: str,
    *,
    served_model_name: str | None = None,
    tokenizer: str | None = None,
    api_key: str | None = None,
    endpoint: str | None = None,
    label: str | None = None,
    save_detailed: bool = False,
    max_failed: int = 0,
    max_schedule_lag_ms: float | None = None,
    max_client_overhead_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    max_client_wait: float | None = metrics.MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
    receiver: SpanReceiver | None = None,
    span_wait_s: float = BENCH_SPAN_WAIT_S,
    max_client_overhead_p99_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
) -> BenchResult:
    """Run `config` against the server at `base_url`; raises BenchFailed for a benchmark of
    nothing (every request failed, a non-200 status, no output tokens), ServerUnreachable
    when nothing listens at `base_url`. With `receiver`, where the server exports its
    `llm_request` spans, each request's span is awaited (`span_wait_s` at most), joined to
    it, and judged as a case's are (the client's tail)."""
    check_reachable(base_url)
    name = served_model_name or model
    codec: Codec = (
        TokenizerCodec.load(tokenizer) if tokenizer else ServerCodec(base_url, name, api_key)
    )
    cache = empty_caches(base_url, config, api_key)
    config = prompts_of_its_own(config, cache)
    workload: Workload = make_workload(config, codec)
    settings = load_settings(config, base_url, name, api_key=api_key, endpoint=endpoint)
    key = receiver.expect() if receiver is not None else ""
    counted = receiver.snapshot() if receiver is not None else None
    settings = dataclasses.replace(settings, trace_key=key)
    metrics_url = f"{base_url.rstrip('/')}/metrics"
    before = scrape_metrics(metrics_url)
    load = loops.run(run_load(settings, workload))
    window = (before, scrape_metrics(metrics_url))
    spans = (
        take_spans(receiver, key, load.outcomes, span_wait_s, before=counted)
        if receiver is not None else None
    )
    own = workload_own_hits(workload, config, codec)
    rules = dataclasses.replace(
        bench_rules(base_url, max_schedule_lag_ms, max_client_overhead_ms, max_client_wait),
        max_client_overhead_p99_ms=max_client_overhead_p99_ms,
    )
    result, judgement = judged_result(
        load, config, codec, window, own, rules, max_failed,
        model=model, tokenizer=tokenizer, label=label, spans=spans,
    )
    result["engine"] = server_engine(base_url, api_key)
    result["prefix_cache"] = cache.describe()
    result["prompt_seed"] = config.seed
    result["client_limit"] = load.client_limit
    invalid = judgement.line()
    if not save_detailed:
        for detailed in DETAILED_KEYS:
            result.pop(detailed, None)
    return BenchResult(result, load, invalid, spans)


def judged_result(
    load: LoadResult,
    config: BenchmarkConfig,
    codec: Codec,
    window: ServerWindow,
    own_hits: int,
    rules: Rules,
    max_failed: int = 0,
    *,
    model: str,
    tokenizer: str | None = None,
    label: str | None = None,
    spans: Joined | None = None,
) -> tuple[dict[str, Any], Judgement]:
    """A finished load's result (vLLM's keys, the client's health, the server's view) and
    its judgement, judged as a suite's case is (load/validity.py) with the rules that apply
    here; BenchFailed for a benchmark of nothing. With the requests' joined server `spans`,
    what the client added to each request (p50, p90, p99) and the share joined are in the
    result, each request's span in `server_spans`, and the client's tail is judged."""
    summary, health = measure(load, config, codec)
    if (problem := metrics.served_problem(load.outcomes, summary, max_failed)) is not None:
        raise BenchFailed(problem)
    result = result_json(config, model, tokenizer, label, load, summary, health, codec)
    if spans is not None:
        result.update(spans.figures)
        result["server_spans"] = spans.rows
    facts = LoadFacts(
        load, config, health, result, own_hits,
        spans_joined_share=spans.figures[JOINED_SHARE] if spans is not None else None,
        spans_problem=spans.problem if spans is not None else None,
        spans_server_ttft_p99_ms=spans.server_ttft_p99_ms if spans is not None else None,
    )
    judgement = judge(facts, window, rules)
    result["validity"] = judgement.validity
    result["invalid_reason"] = judgement.line()
    result["rules_not_applied"] = judgement.not_applied
    result["overhead_outside_client"] = judgement.outside_client
    # The server's own view of the load (null, with the reason, where it keeps none), and what
    # the client added to it.
    view, result["server_view"] = load_view(*window, result)
    result.update(view)
    if spans is not None and result["server_view"] is not None:
        result["server_view"]["spans_problem"] = spans.problem
        result["server_view"]["span_receiver"] = spans.receiver
    return result, judgement


def bench_rules(
    base_url: str,
    max_schedule_lag_ms: float | None,
    max_client_overhead_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    max_client_wait: float | None = metrics.MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
) -> Rules:
    """`profllm bench`'s rules: a suite case's, with the bounds its flags set, except where
    they cannot apply (no load cores are leased apart from the server's; the client's overhead
    where the server is on another host), which its judgement names."""
    return Rules(max_schedule_lag_ms=max_schedule_lag_ms,
                 max_client_overhead_ms=max_client_overhead_ms,
                 max_client_wait=max_client_wait,
                 server_on_this_host=on_this_host(base_url))


def prompts_of_its_own(config: C, cache: CacheState) -> C:
    """Where the server's cache could not be emptied (a server the tool did not start) and
    no seed was given, the workload with a fresh seed: its prompts are then its own, not an
    earlier run's that the server may still hold."""
    if cache.state != "not emptied" or "seed" in config.model_fields_set:
        return config
    return config.model_copy(update={"seed": secrets.randbits(31)})


def load_settings(
    config: BenchmarkConfig,
    base_url: str,
    model: str,
    *,
    api_key: str | None = None,
    endpoint: str | None = None,
    client_processes: int | None = None,
) -> LoadSettings:
    """The load's settings; `client_processes` as resolved for the case (`auto`: by the load
    cores it holds, hosts/cores.py `client_processes`), else the config's (`auto`: one)."""
    if client_processes is None:
        wanted = config.client_processes
        client_processes = wanted if isinstance(wanted, int) else 1
    return LoadSettings(
        base_url=base_url,
        model=model,
        backend=config.backend,
        request_rate=config.request_rate,
        burstiness=config.burstiness,
        max_concurrency=config.max_concurrency,
        ramp_up_strategy=config.ramp_up_strategy,
        ramp_up_start_rps=config.ramp_up_start_rps,
        ramp_up_end_rps=config.ramp_up_end_rps,
        seed=config.seed,
        ignore_eos=config.ignore_eos,
        temperature=config.temperature,
        num_warmups=config.num_warmups,
        request_timeout_s=config.request_timeout_s,
        api_key=api_key,
        endpoint=endpoint,
        client_processes=client_processes,
        self_timed=config.is_self_timed,
    )
