"""The simulator's continuous-batching `Scheduler` (its cost model: test_sim_cost.py).

A recording cost model with sub-millisecond steps logs what each step carries, so the tests can
check the batch limits step by step and still run in well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pytest_profllm.sim.batching import Scheduler, Sequence
from pytest_profllm.sim.cost import StepWork

T = TypeVar("T")


@dataclass(frozen=True)
class RecordingCost:
    """Tiny step costs; logs (running, decoding, prefill tokens) of every planned step."""

    seconds: float = 0.0002
    watch: list[Scheduler] = field(default_factory=list)
    log: list[tuple[int, int, int]] = field(default_factory=list)

    def step_seconds(self, work: StepWork) -> float:
        self.log.append((len(self.watch[0].running), work.decode_seqs, work.prefill_tokens))
        return self.seconds


def _scheduler(max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
    cost = RecordingCost()
    scheduler = Scheduler(cost, max_num_seqs, max_num_batched_tokens)
    cost.watch.append(scheduler)
    return scheduler


def _log(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    assert isinstance(scheduler.cost, RecordingCost)
    return scheduler.cost.log


def _run(scheduler: Scheduler, body: Callable[[], Awaitable[T]], timeout: float = 5.0) -> T:
    """Run `body` while the scheduler's loop runs; stop the loop whatever happens."""

    async def main() -> T:
        loop_task = asyncio.create_task(scheduler.run())
        body_task = asyncio.ensure_future(body())
        try:
            done, _ = await asyncio.wait(
                {loop_task, body_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if loop_task in done:
                loop_task.result()  # raises what stopped the loop
                raise AssertionError("the scheduler loop returned")
            if body_task not in done:
                raise TimeoutError(f"test body still running after {timeout} s")
            return body_task.result()
        finally:
            for task in (body_task, loop_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return asyncio.run(main())


async def _drain(sequence: Sequence) -> list[int]:
    tokens = []
    while (token := await sequence.tokens.get()) is not None:
        tokens.append(token)
    return tokens


def test_each_sequence_emits_max_tokens_then_none() -> None:
    scheduler = _scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    shapes = [(10, 1), (3, 5), (40, 12), (0, 3), (100, 2)]

    async def body() -> list[list[int]]:
        sequences = [scheduler.submit(prompt, tokens) for prompt, tokens in shapes]
        streams = await asyncio.gather(*(_drain(s) for s in sequences))
        await asyncio.sleep(0.01)  # nothing may follow the None
        assert all(s.tokens.empty() for s in sequences)
        assert all(s.generated == s.max_tokens for s in sequences)
        return streams

    streams = _run(scheduler, body)
    assert [len(stream) for stream in streams] == [tokens for _, tokens in shapes]
    every = [token for stream in streams for token in stream]
    assert len(set(every)) == len(every)
    assert not scheduler.running
    assert not scheduler.waiting


def test_empty_prompt_counts_as_one_token() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    assert scheduler.submit(0, 1).prompt_len == 1


def test_idle_scheduler_takes_no_steps_until_submit() -> None:
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=8)

    async def body() -> list[int]:
        await asyncio.sleep(0.02)
        assert scheduler.steps == 0
        return await _drain(scheduler.submit(2, 3))

    assert len(_run(scheduler, body)) == 3
    assert scheduler.steps == 3


def test_never_more_than_max_num_seqs_running() -> None:
    scheduler = _scheduler(max_num_seqs=3, max_num_batched_tokens=64)

    async def body() -> list[list[int]]:
        sequences = [scheduler.submit(5, 4) for _ in range(8)]
        return await asyncio.gather(*(_drain(s) for s in sequences))

    streams = _run(scheduler, body)
    assert all(len(stream) == 4 for stream in streams)
    running = [entry[0] for entry in _log(scheduler)]
    assert max(running) == 3  # the limit is reached, and never passed
    assert max(entry[1] for entry in _log(scheduler)) <= 3


def test_step_never_carries_more_than_token_budget() -> None:
    scheduler = _scheduler(max_num_seqs=4, max_num_batched_tokens=16)

    async def body() -> list[list[int]]:
        sequences = [scheduler.submit(prompt, 5) for prompt in (40, 7, 25, 3, 60, 1)]
        return await asyncio.gather(*(_drain(s) for s in sequences))

    assert all(len(stream) == 5 for stream in _run(scheduler, body))
    carried = [decoding + prefill for _, decoding, prefill in _log(scheduler)]
    assert max(carried) == 16  # full steps happen, over-full ones never
    # All 136 prompt tokens were prefilled, once each.
    assert sum(prefill for _, _, prefill in _log(scheduler)) == 40 + 7 + 25 + 3 + 60 + 1


def test_long_prompt_is_prefilled_in_chunks_before_its_first_token() -> None:
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=32)

    async def body() -> tuple[int, list[int]]:
        sequence = scheduler.submit(100, 3)
        first = await sequence.tokens.get()
        assert first is not None
        steps_to_first = scheduler.steps
        return steps_to_first, [first, *await _drain(sequence)]

    steps_to_first, tokens = _run(scheduler, body)
    # 100 tokens at 32 per step: 32, 32, 32, 4; the first token comes with the last chunk.
    assert steps_to_first == 4
    assert len(tokens) == 3
    assert _log(scheduler) == [(1, 0, 32), (1, 0, 32), (1, 0, 32), (1, 0, 4), (1, 1, 0), (1, 1, 0)]


def test_decoders_take_their_share_of_the_budget() -> None:
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=8)

    async def body() -> tuple[list[int], list[int]]:
        short = scheduler.submit(1, 6)
        long = scheduler.submit(20, 2)
        return await asyncio.gather(_drain(short), _drain(long))

    short, long = _run(scheduler, body)
    assert (len(short), len(long)) == (6, 2)
    # Step 1 prefills 1 + 7; then the short one decodes, leaving 7 for the long prompt's 13.
    assert _log(scheduler)[:4] == [(2, 0, 8), (2, 1, 7), (2, 1, 6), (2, 2, 0)]


def test_cancel_running_sequence_frees_its_slot() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)

    async def body() -> tuple[int, int, list[int]]:
        endless = scheduler.submit(1, 1_000_000)
        queued = scheduler.submit(1, 2)
        assert await endless.tokens.get() is not None
        assert scheduler.running == [endless]
        assert list(scheduler.waiting) == [queued]
        scheduler.cancel(endless)
        emitted = endless.generated
        tokens = await _drain(queued)  # would hang (timeout) if the slot stayed taken
        return emitted, endless.generated, tokens

    emitted, later, tokens = _run(scheduler, body)
    assert len(tokens) == 2
    assert later == emitted  # a cancelled sequence gets no more tokens
    assert not scheduler.running
    assert not scheduler.waiting


def test_cancel_waiting_sequence_and_unknown_sequence() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)

    async def body() -> list[int]:
        first = scheduler.submit(1, 3)
        dropped = scheduler.submit(1, 3)
        scheduler.cancel(dropped)
        assert dropped not in scheduler.waiting
        tokens = await _drain(first)
        scheduler.cancel(first)  # finished already: a no-op
        await asyncio.sleep(0.01)
        assert dropped.tokens.empty()
        assert dropped.generated == 0
        return tokens

    assert len(_run(scheduler, body)) == 3
    assert scheduler.steps == 3


def _virtual_scheduler(num_gpu_blocks: int, max_num_batched_tokens: int) -> Scheduler:
    """A scheduler stepped by hand (plan, finish), with a cache of `num_gpu_blocks` blocks."""
    return Scheduler(
        RecordingCost(),
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks=num_gpu_blocks,
        stream_tokens=False,
        clock=lambda: 0.0,
    )


def test_a_waiting_prompt_is_admitted_only_when_its_whole_chunk_fits() -> None:
    # vLLM V1's allocate_slots: a chunk gets all its blocks or the request waits. 10 blocks of
    # 16 tokens; the first prompt takes 6, so the second's 96-token chunk (6 blocks) waits
    # rather than starting on the 4 that are free.
    scheduler = _virtual_scheduler(num_gpu_blocks=10, max_num_batched_tokens=512)
    first = scheduler.submit(96, 4)
    second = scheduler.submit(96, 4)
    step = scheduler.plan_step()
    assert step is not None
    assert [(s, chunk) for s, chunk in step.prefill] == [(first, 96)]
    assert list(scheduler.waiting) == [second] and second.blocks == 0


def test_a_step_that_preempts_admits_no_waiting_request() -> None:
    # Two prompts fill the cache; when the older one's next token needs a block, the newer is
    # preempted, and in that step nobody is admitted (it would come straight back), as in
    # vLLM V1's scheduler. Each finishes in the end.
    scheduler = _virtual_scheduler(num_gpu_blocks=8, max_num_batched_tokens=512)
    older, newer = scheduler.submit(64, 20), scheduler.submit(64, 20)
    step = scheduler.plan_step()
    assert step is not None and len(step.prefill) == 2
    scheduler.finish_step(step, 0.0)
    step = scheduler.plan_step()  # both decode: each needs a 5th block, 8 in all: one gives way
    assert step is not None
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [newer]
    assert step.decoding == [older] and step.prefill == []
    for _ in range(200):
        if (step := scheduler.plan_step()) is None:
            break
        scheduler.finish_step(step, 0.0)
    assert older.generated == newer.generated == 20
