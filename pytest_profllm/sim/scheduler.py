"""The simulated engine's step loop: continuous batching with a simple cost model.

Each step runs the decode of every running sequence plus a chunk of prefill, as vLLM's V1
scheduler does with chunked prefill: at most `max_num_seqs` sequences run, and a step carries
at most `max_num_batched_tokens` tokens. A step costs

    decode_base_ms + decode_per_seq_ms * decoding sequences + prefill_per_token_ms * prefill tokens

divided by the tensor-parallel speed-up. Every decoding sequence emits one token per step.

The KV cache is `num_gpu_blocks` blocks of `block_size` tokens. A decoding sequence that needs
a block when none is free preempts the newest running sequence, which goes back to the front
of the queue and recomputes its tokens later (vLLM V1's recompute preemption). With prefix
caching, a new sequence's leading full blocks whose token ids were computed before are hits
and skip prefill. The counters (preemptions, prefix-cache queries and hits, tokens) are what
`/metrics` reports under vLLM's names. Simplification: a hit's blocks are the sequence's own,
not shared, so usage counts them once per sequence.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 16  # vLLM's default block size on CUDA
# About what vLLM 0.33 finds for an 8B model (Qwen3-8B: 144 KiB of KV per token) on one 80 GB
# GPU at gpu_memory_utilization 0.9: ~54 GiB left after weights, ~390k tokens. A round figure.
DEFAULT_GPU_BLOCKS = 24_000
# A factor on every step time (1.15: 15 % slower), so a regression gate can be shown to catch a
# known slowdown. Read once, where the server process starts.
SLOWDOWN_ENV = "PROFLLM_SIM_SLOWDOWN"
# How late a step may end before the lateness is forgotten rather than caught up.
_MAX_CATCH_UP_S = 0.05


def slowdown_from_env() -> float:
    text = os.environ.get(SLOWDOWN_ENV, "1")
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"{SLOWDOWN_ENV}={text!r}: expected a factor like 1.15") from None
    if not 0 < factor < 100:
        raise ValueError(f"{SLOWDOWN_ENV}={text!r}: expected a factor between 0 and 100")
    return factor


@dataclass(frozen=True)
class CostModel:
    """Per-step costs in milliseconds on one GPU.

    The default decode figures follow published vLLM 0.11 numbers for Qwen3-8B on one H100
    (shared/data rows 7 and 10: TPOT 7.2 ms at concurrency 1, 7.7 ms at 8); the prefill
    figure is a round number of the same order (about 10k prompt tokens/s).
    """

    decode_base_ms: float = 7.2
    decode_per_seq_ms: float = 0.07
    prefill_per_token_ms: float = 0.1
    tp_efficiency: float = 0.8  # speed-up of tp GPUs is tp ** tp_efficiency

    def step_seconds(self, decoding: int, prefill_tokens: int, tp: int) -> float:
        cost = self.decode_base_ms + self.decode_per_seq_ms * decoding
        cost += self.prefill_per_token_ms * prefill_tokens
        speedup: float = max(tp, 1) ** self.tp_efficiency
        return cost / 1000 / speedup


@dataclass
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

    def __post_init__(self) -> None:
        self.context_len = self.context_len or self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.context_len


@dataclass
class Scheduler:
    cost: CostModel
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    steps: int = 0
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_GPU_BLOCKS
    enable_prefix_caching: bool = True
    used_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, as vLLM counts them
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Chrome-trace events of each step while the profiler runs; None when it does not.
    trace_events: list[dict[str, Any]] | None = None
    slowdown: float = field(default_factory=slowdown_from_env)
    _cached: OrderedDict[int, None] = field(default_factory=OrderedDict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _step_end: float = 0.0  # when the last step was due to end (perf_counter)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: the fraction of blocks in use (1 = full)."""
        return self.used_blocks / self.num_gpu_blocks

    def submit(
        self, prompt_len: int, max_tokens: int, prompt_ids: list[int] | None = None
    ) -> Sequence:
        sequence = Sequence(
            prompt_len=max(prompt_len, 1),
            max_tokens=max_tokens,
            prompt_ids=tuple(prompt_ids) if prompt_ids is not None else None,
        )
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

    async def run(self) -> None:
        self._step_end = time.perf_counter()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                self._step_end = time.perf_counter()  # idle time is no lateness to catch up
            self._grow_decoders()
            decoding = [s for s in self.running if not s.in_prefill]
            budget = self.max_num_batched_tokens - len(decoding)
            prefill: list[tuple[Sequence, int]] = []
            for sequence in self.running:
                if sequence.in_prefill and budget > 0:
                    left = sequence.context_len - sequence.prefilled
                    chunk = self._fit(sequence, min(left, budget))
                    if chunk:
                        prefill.append((sequence, chunk))
                        budget -= chunk
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                sequence = self.waiting[0]
                self._look_up(sequence)
                chunk = self._fit(sequence, min(sequence.context_len - sequence.prefilled, budget))
                if not chunk:
                    break  # no room in the KV cache: it waits
                self.running.append(self.waiting.popleft())
                prefill.append((sequence, chunk))
                budget -= chunk
            prefill_tokens = sum(chunk for _, chunk in prefill)
            began = time.perf_counter()
            step = self.cost.step_seconds(len(decoding), prefill_tokens, self.tensor_parallel_size)
            step *= self.slowdown  # PROFLLM_SIM_SLOWDOWN, applied here only
            # Each step ends its time after the previous one ended, not after this process woke:
            # on a busy host a late wake-up is caught up by the next step (up to a bound).
            self._step_end = max(self._step_end, began - _MAX_CATCH_UP_S) + step
            await asyncio.sleep(max(0.0, self._step_end - time.perf_counter()))
            self.steps += 1
            self._trace(began, len(decoding), prefill_tokens)
            for sequence, chunk in prefill:
                sequence.prefilled += chunk
                if not sequence.in_prefill:
                    self._remember(sequence)
            # A sequence whose prefill completed this step emits its first token with the decoders.
            for sequence in [s for s in self.running if not s.in_prefill]:
                sequence.generated += 1
                self.generation_tokens += 1
                sequence.tokens.put_nowait(next(self._ids))
                if sequence.generated >= sequence.max_tokens:
                    sequence.tokens.put_nowait(None)
                    self.running.remove(sequence)
                    self._free(sequence)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _grow_decoders(self) -> None:
        """Give each decoding sequence room for its next token, preempting the newest running
        sequences (itself last) when the cache is full."""
        for sequence in list(self.running):
            if sequence not in self.running or sequence.in_prefill:
                continue
            need = self._blocks_for(sequence.prompt_len + sequence.generated + 1) - sequence.blocks
            while need > self.num_gpu_blocks - self.used_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is sequence:
                    break
            else:
                sequence.blocks += need
                self.used_blocks += need

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._free(sequence)
        sequence.context_len = sequence.prompt_len + sequence.generated
        sequence.prefilled = 0
        self.waiting.appendleft(sequence)
        self.num_preemptions += 1

    def _fit(self, sequence: Sequence, chunk: int) -> int:
        """The part of `chunk` the free blocks can hold, allocated."""
        room = (sequence.blocks + self.num_gpu_blocks - self.used_blocks) * self.block_size
        chunk = max(min(chunk, room - sequence.prefilled), 0)
        need = self._blocks_for(sequence.prefilled + chunk) - sequence.blocks
        if chunk and need > 0:
            sequence.blocks += need
            self.used_blocks += need
        return chunk

    def _free(self, sequence: Sequence) -> None:
        self.used_blocks -= sequence.blocks
        sequence.blocks = 0

    def _block_hashes(self, ids: tuple[int, ...]) -> list[int]:
        # Chained, as vLLM's: a block's hash covers every token before it.
        hashes, parent = [], 0
        for start in range(0, len(ids) - len(ids) % self.block_size, self.block_size):
            parent = hash((parent, ids[start : start + self.block_size]))
            hashes.append(parent)
        return hashes

    def _look_up(self, sequence: Sequence) -> None:
        if sequence.looked_up:
            return
        sequence.looked_up = True
        if not self.enable_prefix_caching or sequence.prompt_ids is None:
            return
        self.prefix_cache_queries += sequence.prompt_len
        hits = 0
        # The last prompt token is always computed (it yields the first output), as in vLLM.
        for block_hash in self._block_hashes(sequence.prompt_ids[: sequence.prompt_len - 1]):
            if block_hash not in self._cached:
                break
            self._cached.move_to_end(block_hash)
            hits += self.block_size
        self.prefix_cache_hits += hits
        sequence.prefilled = hits

    def _remember(self, sequence: Sequence) -> None:
        if sequence.context_len == sequence.prompt_len:
            self.prompt_tokens += sequence.prompt_len
        if not self.enable_prefix_caching or sequence.prompt_ids is None:
            return
        for block_hash in self._block_hashes(sequence.prompt_ids):
            self._cached[block_hash] = None
            self._cached.move_to_end(block_hash)
        while len(self._cached) > self.num_gpu_blocks:
            self._cached.popitem(last=False)

    def _trace(self, began: float, decoding: int, prefill_tokens: int) -> None:
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
                    "decode_seqs": decoding,
                    "prefill_tokens": prefill_tokens,
                    "kv_cache_usage": round(self.kv_cache_usage, 4),
                },
            }
        )
