"""The simulated engine's step loop: continuous batching with a simple cost model.

Each step runs the decode of every running sequence plus a chunk of prefill, as vLLM's V1
scheduler does with chunked prefill: at most `max_num_seqs` sequences run, and a step carries
at most `max_num_batched_tokens` tokens. A step costs

    decode_base_ms + decode_per_seq_ms * decoding sequences + prefill_per_token_ms * prefill tokens

divided by the tensor-parallel speed-up. Every decoding sequence emits one token per step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field


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

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prompt_len


@dataclass
class Scheduler:
    cost: CostModel
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    steps: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def submit(self, prompt_len: int, max_tokens: int) -> Sequence:
        sequence = Sequence(prompt_len=max(prompt_len, 1), max_tokens=max_tokens)
        self.waiting.append(sequence)
        self._wake.set()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        # A client that hung up frees its slot, as vLLM aborts the request.
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            decoding = [s for s in self.running if not s.in_prefill]
            budget = self.max_num_batched_tokens - len(decoding)
            prefill: list[tuple[Sequence, int]] = []
            for sequence in self.running:
                if sequence.in_prefill and budget > 0:
                    chunk = min(sequence.prompt_len - sequence.prefilled, budget)
                    prefill.append((sequence, chunk))
                    budget -= chunk
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                sequence = self.waiting.popleft()
                self.running.append(sequence)
                chunk = min(sequence.prompt_len, budget)
                prefill.append((sequence, chunk))
                budget -= chunk
            prefill_tokens = sum(chunk for _, chunk in prefill)
            await asyncio.sleep(
                self.cost.step_seconds(len(decoding), prefill_tokens, self.tensor_parallel_size)
            )
            self.steps += 1
            for sequence, chunk in prefill:
                sequence.prefilled += chunk
            # A sequence whose prefill completed this step emits its first token with the decoders.
            for sequence in [s for s in self.running if not s.in_prefill]:
                sequence.generated += 1
                sequence.tokens.put_nowait(next(self._ids))
                if sequence.generated >= sequence.max_tokens:
                    sequence.tokens.put_nowait(None)
                    self.running.remove(sequence)
