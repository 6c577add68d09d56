"""The simulated engine's step loop: continuous batching over the engine model's step times.

Each step runs the decode of every running sequence plus a chunk of prefill, as vLLM's V1
scheduler does with chunked prefill: at most `max_num_seqs` sequences run, and a step carries
at most `max_num_batched_tokens` tokens. What a step costs is the cost model's answer
(`cost.EngineModel.step_seconds`, a roofline of the model on the device), asked in one place:
`Scheduler.step_duration`. Every decoding sequence emits one token per step; with speculative
decoding (`speculation.py`), one plus the draft tokens the target accepted.

The KV cache is `num_gpu_blocks` blocks of `block_size` tokens. A decoding sequence that needs
a block when none is free preempts the newest running sequence, which goes back to the front
of the queue and recomputes its tokens later (vLLM V1's recompute preemption). With prefix
caching, a new sequence's leading full blocks whose token ids were computed before are hits
and skip prefill. The counters (preemptions, prefix-cache queries and hits, tokens) and the
request histograms (`stats.py`) are what `/metrics` reports under vLLM's names.
Simplification: a hit's blocks are the sequence's own, not shared, so usage counts them once
per sequence.

The loop is three calls, `plan_step`, `step_duration` and `finish_step(now)`: the server
sleeps the duration on the event loop (`run`), `virtual.py` advances a virtual clock instead.
On the event loop a step can end late (a busy host wakes the loop late): `run` measures each
step's lateness into `lateness` (`StepLateness`), which `/metrics` reports; virtual runs have
none.

`reset_prefix_cache` forgets the cached blocks, as vLLM's scheduler does for the dev-mode route
`POST /reset_prefix_cache`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_profllm.sim.cost import StepWork
from pytest_profllm.sim.lora import LoraSlots
from pytest_profllm.sim.speculation import Speculation
from pytest_profllm.sim.stats import EngineStats, Histogram

BLOCK_SIZE = 16  # vLLM's default block size on CUDA
# About what vLLM 0.33 finds for an 8B model (Qwen3-8B: 144 KiB of KV per token) on one 80 GB
# GPU at gpu_memory_utilization 0.9: ~54 GiB left after weights, ~390k tokens. A round figure.
DEFAULT_GPU_BLOCKS = 24_000
# How late a step may end before the lateness is forgotten rather than caught up.
_MAX_CATCH_UP_S = 0.05
# Step lateness: the histogram's bounds, and the first ten as the thresholds of the plain
# "late by more than" counters (in milliseconds, which name them).
LATENESS_BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
LATE_STEP_THRESHOLDS_MS = LATENESS_BOUNDS_MS[:10]

log = logging.getLogger("profllm.sim")


class StepCost(Protocol):
    def step_seconds(self, work: StepWork) -> float: ...


@dataclass(frozen=True)
class ConstantStepCost:
    """Every step takes the same time: for tests and tools that exercise the batching alone."""

    seconds: float = 0.001

    def step_seconds(self, work: StepWork) -> float:
        return self.seconds


@dataclass
class StepLateness:
    """How late the real-time loop's steps ended: each step's end as it happened minus the end
    it was due at, never below 0. A late step stands for a busy host (the event loop woke late),
    not for the simulated GPU, so a measurement on such a host is suspect."""

    histogram: Histogram = field(
        default_factory=lambda: Histogram(tuple(ms / 1000 for ms in LATENESS_BOUNDS_MS))
    )
    max_seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.histogram.observe(seconds)
        self.max_seconds = max(self.max_seconds, seconds)

    @property
    def steps(self) -> int:
        return sum(self.histogram.counts)

    @property
    def total_seconds(self) -> float:
        return self.histogram.total

    def over(self, threshold_ms: int) -> int:
        """Steps late by more than `threshold_ms`, one of `LATENESS_BOUNDS_MS`."""
        # A bucket holds the values up to its bound, so those above it are in the later ones.
        return sum(self.histogram.counts[LATENESS_BOUNDS_MS.index(threshold_ms) + 1 :])


@dataclass(eq=False)  # identity: two requests alike are still two
class Sequence:
    prompt_len: int
    max_tokens: int
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    prefilled: int = 0
    generated: int = 0
    prompt_ids: tuple[int, ...] | None = None  # for prefix caching; None: no lookup
    context_len: int = 0  # tokens to compute before decoding: the prompt, or more after preemption
    blocks: int = 0  # KV-cache blocks held
    looked_up: bool = False
    uid: int = 0  # stands for the prompt's token ids when there are none
    block_hashes: list[int] | None = None
    # Times on the scheduler's clock, for vLLM's request histograms and virtual runs.
    # vLLM's timestamps (vllm/v1/metrics/stats.py): `arrived` when the API server got the
    # request, `queued` when the engine did (after the API server's own work), then
    # scheduled, first token and last token.
    arrived: float = 0.0
    queued: float = 0.0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    computed_tokens: int = 0  # prompt tokens computed, not found in the prefix cache
    # Prompt tokens found in the prefix cache when it was first scheduled (the usage chunk's
    # prompt_tokens_details.cached_tokens, as vLLM reports it).
    cached_tokens: int = 0
    # Its images' vision-encoder FLOPs, spent in the step that first schedules it.
    encoder_flops: float = 0.0
    # Its own inter-token gaps, where a virtual run keeps them per request (None: not kept).
    gaps: list[float] | None = None
    # The LoRA adapter it asks for (sim/lora.py); None: the base model.
    adapter: str | None = None

    def __post_init__(self) -> None:
        self.context_len = self.context_len or self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.context_len


@dataclass
class Step:
    """One planned engine step: who decodes, which prefill chunks, and the work for the cost."""

    decoding: list[Sequence]
    prefill: list[tuple[Sequence, int]]
    work: StepWork
    # What its LoRA adapters add (sim/lora.py): loads the batch waits for, their extra work.
    lora_s: float = 0.0


@dataclass
class Scheduler:
    cost: StepCost
    max_num_seqs: int
    max_num_batched_tokens: int
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    steps: int = 0
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_GPU_BLOCKS
    enable_prefix_caching: bool = True
    # False: a prompt runs whole in one step or waits (vLLM's --no-enable-chunked-prefill).
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: the largest chunk of one prompt per step
    used_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, as vLLM counts them
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    stats: EngineStats = field(default_factory=EngineStats)
    clock: Callable[[], float] = time.perf_counter
    # False for virtual runs: nobody reads the token queues, only the times.
    stream_tokens: bool = True
    on_finish: Callable[[Sequence], None] | None = None
    itl_log: list[float] | None = None  # every inter-token gap, when a virtual run wants them
    # Chrome-trace events of each step while the profiler runs; None when it does not.
    trace_events: list[dict[str, Any]] | None = None
    lateness: StepLateness = field(default_factory=StepLateness)  # of `run`'s steps
    # The LoRA adapters served and their slots (--enable-lora); None: the base model only.
    lora: LoraSlots | None = None
    # Speculative decoding (--speculative-config): k draft tokens per decoder per step, and
    # vLLM's counters of them. None: one token per decoder per step.
    speculation: Speculation | None = None
    _cached: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _step_end: float = 0.0  # when the last step was due to end (perf_counter)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _uids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: the fraction of blocks in use (1 = full)."""
        return self.used_blocks / self.num_gpu_blocks

    def submit(
        self,
        prompt_len: int,
        max_tokens: int,
        prompt_ids: list[int] | None = None,
        arrived: float | None = None,
        encoder_flops: float = 0.0,
        adapter: str | None = None,
    ) -> Sequence:
        sequence = Sequence(
            adapter=adapter,
            encoder_flops=encoder_flops,
            prompt_len=max(prompt_len, 1),
            max_tokens=max_tokens,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
            arrived=self.clock() if arrived is None else arrived,
            queued=self.clock(),
            uid=next(self._uids),
        )
        self.stats.observe("vllm:request_params_n", 1)
        self.stats.observe("vllm:request_params_max_tokens", max_tokens)
        self.stats.observe("vllm:request_max_num_generation_tokens", max_tokens)
        self.waiting.append(sequence)
        self._wake.set()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        # A client that hung up frees its slot, as vLLM aborts the request.
        if sequence in self.running:
            self.running.remove(sequence)
            self._free(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        else:
            return
        self.stats.request_success["abort"] += 1

    async def run(self) -> None:
        self._step_end = time.perf_counter()
        while True:
            step = self.plan_step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                self._step_end = time.perf_counter()  # idle time is no lateness to catch up
                continue
            began = time.perf_counter()
            # Each step ends its time after the previous one ended, not after this process woke:
            # on a busy host a late wake-up is caught up by the next step (up to a bound).
            self._step_end = max(self._step_end, began - _MAX_CATCH_UP_S) + self.step_duration(step)
            await asyncio.sleep(max(0.0, self._step_end - time.perf_counter()))
            # Measured before the step is applied: the lateness is the host's, not our work's.
            self.lateness.observe(max(0.0, time.perf_counter() - self._step_end))
            self.finish_step(step, self.clock())
            self._trace(began, step)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block, so that no prompt finds one until computed again;
        whether it was done. As vLLM's block pool, it refuses (False, and a warning) while
        running sequences hold blocks, unless `reset_running_requests`: then they are all
        preempted first, back to the front of the queue in their order, to be recomputed (their
        tokens of a step in flight are dropped, as vLLM drops stale output). The prefix-cache
        counters are counters: they keep counting, as vLLM's do."""
        if reset_running_requests:
            while self.running:
                self._preempt(self.running[-1])  # the newest first: the oldest ends up in front
        if self.used_blocks:
            log.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.used_blocks,
            )
            return False
        self._cached.clear()
        # A waiting sequence already looked up (its chunk did not fit) holds hits that are gone:
        # it looks up again, as vLLM looks a waiting request up at every attempt.
        for sequence in self.waiting:
            if sequence.looked_up:
                sequence.looked_up = False
                sequence.prefilled = 0
        log.info("Successfully reset prefix cache")
        return True

    def plan_step(self) -> Step | None:
        """Admit and chunk as vLLM's V1 scheduler would; None when there is nothing to run."""
        if not self.running and not self.waiting:
            return None
        # As vLLM V1's scheduler: a step that had to preempt admits no waiting request (the
        # one just preempted would come straight back and be preempted again: a thrash).
        preempted = self._grow_decoders()
        decoding = [s for s in self.running if s.prefilled >= s.context_len]  # not in_prefill
        # A decoder's draft tokens are verified in the step: they take from its token budget.
        drafted = self.speculation.num_speculative_tokens if self.speculation else 0
        budget = self.max_num_batched_tokens - len(decoding) * (1 + drafted)
        prefill: list[tuple[Sequence, int]] = []
        # A running prefill's next chunk gets its blocks, or the newest running sequences give
        # way (itself last), as a decode's next token does.
        for sequence in list(self.running):
            in_prefill = sequence.prefilled < sequence.context_len  # inlined: every step
            if not (in_prefill and budget > 0 and sequence in self.running):
                continue
            chunk = self._chunk(sequence, budget)
            while chunk and not self._allocate(sequence, chunk):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    chunk = 0
            if chunk:
                prefill.append((sequence, chunk))
                budget -= chunk
        if preempted:  # a decoder may have given way to a prefill chunk
            decoding = [s for s in decoding if s.blocks]
        now = None
        lora = self.lora
        # As vLLM V1: a request whose adapter would be one more than max_loras in the batch
        # is skipped for a later step, and those behind it may still come in.
        active = {s.adapter for s in self.running if s.adapter} if lora is not None else set()
        skipped: list[Sequence] = []
        while (
            not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0
        ):
            sequence = self.waiting[0]
            if lora is not None and not lora.admits(sequence.adapter, active):
                skipped.append(self.waiting.popleft())
                continue
            self._look_up(sequence)
            chunk = self._chunk(sequence, budget)
            if not (chunk and self._allocate(sequence, chunk)):
                break  # no room in the KV cache for its whole chunk: it waits, as in vLLM V1
            self.running.append(self.waiting.popleft())
            if sequence.scheduled_at is None:
                now = self.clock() if now is None else now
                sequence.scheduled_at = now
            prefill.append((sequence, chunk))
            budget -= chunk
            if sequence.adapter is not None:
                active.add(sequence.adapter)
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if prefill and not self.enable_chunked_prefill:
            decoding = []  # vLLM without chunked prefill runs prefill steps alone
        if not decoding and not prefill:
            if not self.running:
                return None  # a prompt larger than the whole cache waits for nothing
            # Partial prefills filled the cache and none can grow: the newest gives way.
            self._preempt(self.running[-1])
            return self.plan_step()
        context = 0
        for sequence in decoding:
            context += sequence.prompt_len + sequence.generated
        prefill_tokens = prefill_context = 0
        attended = 0.0
        finishing = 0
        encoder = 0.0
        for sequence, chunk in prefill:
            if not sequence.prefilled and not sequence.preemptions:
                encoder += sequence.encoder_flops  # vLLM's encoder cache keeps it after
            prefill_tokens += chunk
            prefill_context += sequence.prefilled
            attended += chunk * (sequence.prefilled + chunk / 2)
            finishing += sequence.prefilled + chunk >= sequence.context_len
        work = StepWork(
            decode_seqs=len(decoding),
            decode_context=context,
            spec_tokens=drafted * len(decoding),
            prefill_tokens=prefill_tokens,
            prefill_context=prefill_context,
            prefill_attended=attended,
            emitted=len(decoding) + finishing,
            prefill_seqs=len(prefill),
            encoder_flops=encoder,
        )
        lora_s = 0.0
        if lora is not None:
            lora_s = lora.step_seconds(
                [s.adapter for s in decoding] + [s.adapter for s, _ in prefill],
                sum(1 for s in decoding if s.adapter)
                + sum(chunk for s, chunk in prefill if s.adapter),
            )
        return Step(decoding, prefill, work, lora_s)

    def _chunk(self, sequence: Sequence, budget: int) -> int:
        left = sequence.context_len - sequence.prefilled
        if not self.enable_chunked_prefill:
            return left if left <= budget else 0
        if self.long_prefill_token_threshold:
            left = min(left, self.long_prefill_token_threshold)
        return min(left, budget)

    def step_duration(self, step: Step) -> float:
        """Seconds the step takes on the simulated GPU: the cost model's answer, asked here
        and nowhere else."""
        return self.cost.step_seconds(step.work) + step.lora_s

    def finish_step(self, step: Step, now: float) -> None:
        """Apply a step that ended at `now`: prefill progress, one token per decoder."""
        self.steps += 1
        self.stats.observe(
            "vllm:iteration_tokens_total", step.work.decode_seqs + step.work.prefill_tokens
        )
        emitting = [s for s in step.decoding if s.generated < s.max_tokens and s.blocks]
        # With speculation each decoder's draft is verified in this step: it emits the
        # accepted draft tokens and the target's own (vLLM's bonus token).
        speculation = self.speculation
        counts = {id(s): 1 + speculation.draft() for s in emitting} if speculation else {}
        for sequence, chunk in step.prefill:
            if not sequence.blocks:
                continue  # preempted since the step was planned
            sequence.prefilled += chunk
            sequence.computed_tokens += chunk
            if not sequence.in_prefill:
                self._remember(sequence)
                # Its prefill completed this step: it emits its first token with the decoders.
                emitting.append(sequence)
        # The decoders of a step mostly share their last token's step, so their gaps are
        # counted once per distinct gap: this is the simulator's hottest loop.
        gaps: dict[float, int] = {}
        for sequence in emitting:
            self._emit(sequence, now, gaps, counts.get(id(sequence), 1))
        for gap, times in gaps.items():
            self.stats.observe("vllm:inter_token_latency_seconds", gap, times)

    def _emit(
        self, sequence: Sequence, now: float, gaps: dict[float, int], count: int = 1
    ) -> None:
        """`count` tokens of `sequence` at `now` (more than one: accepted draft tokens, up to
        its max_tokens); its inter-token gap, one per step as vLLM observes it, is added to
        `gaps`."""
        count = min(count, sequence.max_tokens - sequence.generated)
        sequence.generated += count
        self.generation_tokens += count
        if sequence.first_token_at is None:
            sequence.first_token_at = now
            self.stats.observe("vllm:time_to_first_token_seconds", now - sequence.arrived)
        elif sequence.last_token_at is not None:
            gap = now - sequence.last_token_at
            gaps[gap] = gaps.get(gap, 0) + 1
            if self.itl_log is not None:
                self.itl_log.append(gap)
            if sequence.gaps is not None:
                sequence.gaps.append(gap)
        sequence.last_token_at = now
        if self.stream_tokens:
            for _ in range(count):
                sequence.tokens.put_nowait(next(self._ids))
        if sequence.generated >= sequence.max_tokens:
            if self.stream_tokens:
                sequence.tokens.put_nowait(None)
            self.running.remove(sequence)
            self._free(sequence)
            self._finished(sequence, now)

    def _finished(self, sequence: Sequence, now: float) -> None:
        sequence.finished_at = now
        stats, first = self.stats, sequence.first_token_at or now
        scheduled = sequence.scheduled_at if sequence.scheduled_at is not None else now
        stats.request_success["length"] += 1
        stats.observe("vllm:e2e_request_latency_seconds", now - sequence.arrived)
        # As vLLM: the queue is the engine's (queued to scheduled); the API server's time
        # before it (arrival to queued) is in TTFT and E2E only.
        stats.observe("vllm:request_queue_time_seconds", scheduled - sequence.queued)
        stats.observe("vllm:request_inference_time_seconds", now - scheduled)
        stats.observe("vllm:request_prefill_time_seconds", first - scheduled)
        stats.observe("vllm:request_decode_time_seconds", now - first)
        stats.observe("vllm:request_prompt_tokens", sequence.prompt_len)
        stats.observe("vllm:request_generation_tokens", sequence.generated)
        stats.observe("vllm:request_num_preemptions", sequence.preemptions)
        stats.observe("vllm:request_prefill_kv_computed_tokens", sequence.computed_tokens)
        if sequence.generated > 1:
            stats.observe(
                "vllm:request_time_per_output_token_seconds",
                (now - first) / (sequence.generated - 1),
            )
        if self.on_finish is not None:
            self.on_finish(sequence)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _grow_decoders(self) -> bool:
        """Give each decoding sequence room for its next token, preempting the newest running
        sequences (itself last) when the cache is full; whether any was preempted."""
        preempted = False
        block_size = self.block_size
        # Room for the step's token and, speculating, its draft's (vLLM allocates slots for
        # the draft tokens it verifies).
        ahead = 1 + (self.speculation.num_speculative_tokens if self.speculation else 0)
        for sequence in list(self.running):
            # Still in prefill (also a sequence preempted in this loop: prefilled = 0). The
            # property and _blocks_for are inlined: once per decoder per step.
            if sequence.prefilled < sequence.context_len:
                continue
            tokens = sequence.prompt_len + sequence.generated + ahead
            need = -(-tokens // block_size) - sequence.blocks
            if not need:
                continue  # its next token fits in its last block
            while need > self.num_gpu_blocks - self.used_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is sequence:
                    break
            else:
                sequence.blocks += need
                self.used_blocks += need
        return preempted

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._free(sequence)
        sequence.context_len = sequence.prompt_len + sequence.generated
        sequence.prefilled = 0
        sequence.preemptions += 1
        # Its blocks go back to the cache's free list: on resumption it looks its prompt up
        # again, and finds what no other allocation took since (vLLM V1's prefix cache).
        sequence.looked_up = False
        self.waiting.appendleft(sequence)
        self.num_preemptions += 1

    def _allocate(self, sequence: Sequence, chunk: int) -> bool:
        """The blocks for the sequence's next `chunk` tokens, if the free ones can hold them all
        (vLLM V1's allocate_slots: a chunk is scheduled whole or not at all)."""
        need = self._blocks_for(sequence.prefilled + chunk) - sequence.blocks
        if need > self.num_gpu_blocks - self.used_blocks:
            return False
        if need > 0:
            sequence.blocks += need
            self.used_blocks += need
        return True

    def _free(self, sequence: Sequence) -> None:
        self.used_blocks -= sequence.blocks
        sequence.blocks = 0

    def _block_hashes(self, sequence: Sequence) -> list[int]:
        """The hashes of the prompt's full blocks, chained as vLLM's (a block's hash covers
        every token before it); a prompt without token ids gets hashes of its own."""
        if sequence.block_hashes is None:
            full = sequence.prompt_len // self.block_size
            if sequence.prompt_ids is None:
                sequence.block_hashes = [hash((-1, sequence.uid, i)) for i in range(full)]
            else:
                hashes, parent, ids = [], 0, sequence.prompt_ids
                for start in range(0, full * self.block_size, self.block_size):
                    parent = hash((parent, ids[start : start + self.block_size]))
                    hashes.append(parent)
                sequence.block_hashes = hashes
        return sequence.block_hashes

    def _look_up(self, sequence: Sequence) -> None:
        if sequence.looked_up:
            return
        sequence.looked_up = True
        if not self.enable_prefix_caching:
            return
        self.prefix_cache_queries += sequence.prompt_len
        hits = 0
        # The last prompt token is always computed (it yields the first output), as in vLLM.
        usable = (sequence.prompt_len - 1) // self.block_size
        for block_hash in self._block_hashes(sequence)[:usable]:
            if block_hash not in self._cached:
                break
            self._cached.move_to_end(block_hash)
            hits += self.block_size
        self.prefix_cache_hits += hits
        sequence.prefilled = hits
        if not sequence.preemptions:
            sequence.cached_tokens = hits

    def _remember(self, sequence: Sequence) -> None:
        if sequence.context_len == sequence.prompt_len:
            self.prompt_tokens += sequence.prompt_len
        if not self.enable_prefix_caching:
            return
        for block_hash in self._block_hashes(sequence):
            self._cached[block_hash] = None
            self._cached.move_to_end(block_hash)
        while len(self._cached) > self.num_gpu_blocks:
            self._cached.popitem(last=False)

    def _trace(self, began: float, step: Step) -> None:
        if self.trace_events is None:
            return
        self.trace_events.append(
            {
                "name": "execute_model",
                "cat": "sim_step",
                "ph": "X",
                "ts": began * 1e6,
                "dur": (time.perf_counter() - began) * 1e6,
                "pid": os.getpid(),
                "tid": 0,
                "args": {
                    "step": self.steps,
                    "running": len(self.running),
                    "waiting": len(self.waiting),
                    "decode_seqs": step.work.decode_seqs,
                    "prefill_tokens": step.work.prefill_tokens,
                    "kv_cache_usage": round(self.kv_cache_usage, 4),
                },
            }
        )
