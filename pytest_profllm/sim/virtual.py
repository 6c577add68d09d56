"""The simulated engine on a virtual clock: a whole benchmark in milliseconds of CPU.

The same scheduler and engine model as the server, stepped without sleeping: the clock jumps
by each step's duration. A client is modelled as `vllm bench serve` sends (arrival times from
its schedule, `max_concurrency` as a semaphore whose wait is not part of TTFT), and the figures
are computed with its definitions (TTFT, TPOT from E2EL, output throughput over the duration).
Used by the calibration and curve benchmarks, and by cases run on the virtual clock
(`--profllm-sim-clock virtual`, run/virtual.py), which take each request's times (`Served`)
and compute vLLM's metrics from them with the client's own code.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from collections.abc import Sequence as Ordered
from dataclasses import dataclass, field
from typing import Any

from pytest_profllm.sim.batching import BLOCK_SIZE, Scheduler, Sequence
from pytest_profllm.sim.cost import EngineModel, StepWork


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int
    prompt_ids: tuple[int, ...] | None = None  # for prefix caching
    adapter: str | None = None  # the LoRA adapter it asks for (sim/lora.py); None: the base


@dataclass(frozen=True)
class ServerSettings:
    max_num_seqs: int | None = None  # None: the device's vLLM default
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int | None = None  # None: from memory, weights and utilisation
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0: none (vLLM's default)
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's


@dataclass
class Served:
    """One request as the client would have seen it, in seconds from the start: when its
    schedule wanted it sent, when it was sent (after any max_concurrency wait), its first and
    last token, and the gaps between its tokens."""

    index: int  # its place in the requests given
    intended: float
    sent: float
    first_token: float
    finished: float
    generated: int
    prompt_len: int
    gaps: list[float]


@dataclass
class Outcome:
    """Per-request times (seconds from the start) and vLLM bench serve's summary figures."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2el: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    duration: float = 0.0
    output_tokens: int = 0
    input_tokens: int = 0
    preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    peak_kv_cache_usage: float = 0.0
    num_gpu_blocks: int = 0  # the KV cache the run had: its blocks, and their size in tokens
    block_size: int = 0
    # Every finished request (in finishing order), and the engine's counters over the run.
    served: list[Served] = field(default_factory=list)
    steps: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    # Speculative decoding's counters over the run (sim/speculation.py): drafts, draft
    # tokens, accepted tokens and accepted tokens per draft position. None: no speculation.
    spec_decode: tuple[int, int, int, list[int]] | None = None

    def summary(self) -> dict[str, float]:
        def median(values: list[float]) -> float:
            ordered = sorted(values)
            if not ordered:
                return math.nan
            middle = len(ordered) // 2
            if len(ordered) % 2:
                return ordered[middle]
            return (ordered[middle - 1] + ordered[middle]) / 2

        duration = self.duration or math.nan
        return {
            "completed": len(self.e2el),
            "request_throughput": len(self.e2el) / duration,
            "output_throughput": self.output_tokens / duration,
            "total_token_throughput": (self.output_tokens + self.input_tokens) / duration,
            "median_ttft_ms": median(self.ttft) * 1000,
            "median_tpot_ms": median(self.tpot) * 1000,
            "median_e2el_ms": median(self.e2el) * 1000,
            "median_itl_ms": median(self.itl) * 1000,
            "num_preemptions": self.preemptions,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "peak_kv_cache_usage": self.peak_kv_cache_usage,
        }


def arrival_times(
    count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """vLLM bench serve's schedule: all at 0 for an infinite rate, else gamma gaps."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.gammavariate(burstiness, theta)
    return times


def build_scheduler(engine: EngineModel, settings: ServerSettings) -> Scheduler:
    device = engine.device
    max_num_seqs = settings.max_num_seqs or device.default_max_num_seqs
    max_batched = settings.max_num_batched_tokens or device.default_max_num_batched_tokens
    max_batched = max(max_batched, max_num_seqs)
    if not settings.enable_chunked_prefill:  # as vLLM: one step must hold a whole prompt
        max_batched = max(
            max_batched, settings.max_model_len or engine.model.max_position_embeddings
        )
    blocks = settings.num_gpu_blocks or engine.num_gpu_blocks(
        settings.block_size, settings.gpu_memory_utilization, max_batched
    )
    return Scheduler(
        cost=engine,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        block_size=settings.block_size,
        num_gpu_blocks=max(blocks, 1),
        enable_prefix_caching=settings.enable_prefix_caching,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        stream_tokens=False,
    )


def simulate(
    engine: EngineModel,
    requests: list[Request],
    settings: ServerSettings | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    time_limit_s: float = 1e6,
    *,
    arrivals: Ordered[float] | None = None,
    scheduler: Scheduler | None = None,
    observe: Callable[[float, float, Scheduler, list[Sequence]], None] | None = None,
) -> Outcome:
    """Run `requests` through the engine on a virtual clock and measure as vllm bench serve.

    `arrivals` are the send times the client's own schedule chose (default: vLLM's schedule
    for `request_rate`, `burstiness` and `seed`); `scheduler` is the engine a server's
    arguments made (`sim/cli.py make_scheduler`), default one from `settings`.
    `observe(now, step_seconds, scheduler, finished)` is called after each step with the
    requests it finished (in the order of the outcome's lists): what a telemetry sampler of the
    server would see over the run (queues, KV cache, the token and request counters)."""
    if scheduler is None:
        scheduler = build_scheduler(engine, settings or ServerSettings())
    scheduler.stream_tokens = False
    now = 0.0
    scheduler.clock = lambda: now
    delay = engine.request_seconds()
    if arrivals is None:
        arrivals = arrival_times(len(requests), request_rate, burstiness, seed)
    # (time, index, request), the earliest last: pop() takes it. A trace's times may be out
    # of order; the sort is stable, so equal times keep their order.
    schedule = sorted(
        zip(arrivals, range(len(requests)), requests, strict=True),
        key=lambda entry: entry[0],
        reverse=True,
    )
    slots = max_concurrency or len(requests) or 1
    outcome = Outcome()
    # id(sequence) -> (index, intended, sent, sequence)
    in_flight: dict[int, tuple[int, float, float, Sequence]] = {}
    done: list[Sequence] = []
    scheduler.on_finish = done.append
    scheduler.itl_log = outcome.itl
    # (reaches the scheduler, index, intended, sent, request)
    entering: list[tuple[float, int, float, float, Request]] = []
    peak = 0.0

    def send_ready() -> None:
        while schedule and len(in_flight) + len(entering) < slots and schedule[-1][0] <= now:
            wanted, index, request = schedule.pop()
            sent = max(wanted, now) if max_concurrency else wanted
            heapq.heappush(entering, (sent + delay, index, wanted, sent, request))

    while schedule or entering or in_flight:
        send_ready()
        while entering and entering[0][0] <= now:
            _, index, wanted, sent, request = heapq.heappop(entering)
            ids = list(request.prompt_ids) if request.prompt_ids is not None else None
            sequence = scheduler.submit(
                request.prompt_len, request.output_len, ids, arrived=sent, adapter=request.adapter
            )
            sequence.gaps = []
            in_flight[id(sequence)] = (index, wanted, sent, sequence)
        step = scheduler.plan_step()
        if step is None:
            upcoming = [
                t
                for t in (
                    entering[0][0] if entering else None,
                    schedule[-1][0]
                    if schedule and len(in_flight) + len(entering) < slots
                    else None,
                )
                if t is not None
            ]
            if not upcoming:
                break  # nothing can move: a prompt bigger than the cache
            now = max(now, min(upcoming))
            continue
        seconds = scheduler.step_duration(step)
        now += seconds
        scheduler.finish_step(step, now)
        peak = max(peak, scheduler.kv_cache_usage)
        for sequence in done:
            index, wanted, sent, _ = in_flight.pop(id(sequence))
            first = sequence.first_token_at or now
            finished = sequence.finished_at or now
            outcome.served.append(
                Served(index, wanted, sent, first, finished, sequence.generated,
                       sequence.prompt_len, sequence.gaps or [])
            )
            outcome.ttft.append(first - sent)
            outcome.e2el.append(finished - sent)
            if sequence.generated > 1:
                outcome.tpot.append((finished - first) / (sequence.generated - 1))
            outcome.output_tokens += sequence.generated
            outcome.input_tokens += sequence.prompt_len
        if observe is not None:
            observe(now, seconds, scheduler, done)
        done.clear()
        if now > time_limit_s:
            break
    outcome.duration = now
    outcome.preemptions = scheduler.num_preemptions
    outcome.peak_kv_cache_usage = peak
    outcome.num_gpu_blocks, outcome.block_size = scheduler.num_gpu_blocks, scheduler.block_size
    outcome.steps = scheduler.steps
    outcome.prefix_cache_queries = scheduler.prefix_cache_queries
    outcome.prefix_cache_hits = scheduler.prefix_cache_hits
    if (spec := scheduler.speculation) is not None:
        outcome.spec_decode = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                               list(spec.accepted_per_position))
    if scheduler.prefix_cache_queries:
        outcome.prefix_cache_hit_rate = scheduler.prefix_cache_hits / scheduler.prefix_cache_queries
    return outcome


def roofline_throughput(
    engine: EngineModel,
    count: int,
    input_len: int,
    output_len: int,
    settings: ServerSettings | None = None,
) -> float:
    """A roofline estimate of the output tokens/s of `count` requests of fixed lengths, all
    sent at once, on the profile's own figures: all prompt tokens' prefill and every decode step
    on their rooflines (`EngineModel.roofline_seconds`), with no host, frontend or
    communication cost. Decode runs in rounds of as many sequences as max_num_seqs and the KV
    cache hold, one round after another (where the last round is small, a scheduler that
    overlaps rounds can edge past it)."""
    scheduler = build_scheduler(engine, settings or ServerSettings())
    held = scheduler.num_gpu_blocks * scheduler.block_size // (input_len + output_len)
    batch = max(1, min(count, scheduler.max_num_seqs, held))
    # Every prompt token once, as one step: the weights read once, all FLOPs on the roofline.
    tokens = count * input_len
    prefill = StepWork(prefill_tokens=tokens, prefill_attended=tokens * input_len / 2)
    seconds = engine.roofline_seconds(prefill)
    rounds, last = divmod(count, batch)
    for seqs, times in ((batch, rounds), (last, 1 if last else 0)):
        for step in range(output_len - 1 if times else 0):
            work = StepWork(
                decode_seqs=seqs, decode_context=seqs * (input_len + step + 1), emitted=seqs
            )
            seconds += engine.roofline_seconds(work) * times
    return count * output_len / seconds


def describe(engine: EngineModel, settings: ServerSettings) -> dict[str, Any]:
    scheduler = build_scheduler(engine, settings)
    return {
        **engine.describe(),
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "num_gpu_blocks": scheduler.num_gpu_blocks,
    }
