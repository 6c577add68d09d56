"""The simulator's continuous-batching `Scheduler` and its `CostModel`.

A recording cost model with sub-millisecond steps logs what each step carries, so the tests can
check the batch limits step by step and still run in well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from pytest_profllm.sim.scheduler import CostModel, Scheduler, Sequence

T = TypeVar("T")


@dataclass(frozen=True)
class RecordingCost(CostModel):
    """Tiny step costs; logs (running, decoding, prefill tokens) and tp of every planned step."""

    decode_base_ms: float = 0.2
    decode_per_seq_ms: float = 0.0
    prefill_per_token_ms: float = 0.0
    watch: list[Scheduler] = field(default_factory=list)
    log: list[tuple[int, int, int]] = field(default_factory=list)
    tps: list[int] = field(default_factory=list)

    def step_seconds(self, decoding: int, prefill_tokens: int, tp: int) -> float:
        self.log.append((len(self.watch[0].running), decoding, prefill_tokens))
        self.tps.append(tp)
        return super().step_seconds(decoding, prefill_tokens, tp)


def _scheduler(max_num_seqs: int, max_num_batched_tokens: int, tp: int = 1) -> Scheduler:
    cost = RecordingCost()
    scheduler = Scheduler(cost, max_num_seqs, max_num_batched_tokens, tensor_parallel_size=tp)
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


def test_tensor_parallel_size_reaches_cost_model() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8, tp=4)
    _run(scheduler, lambda: _drain(scheduler.submit(2, 2)))
    cost = scheduler.cost
    assert isinstance(cost, RecordingCost)
    assert cost.tps == [4, 4]


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


# CostModel arithmetic.

PUBLISHED = CostModel(
    decode_base_ms=7.2, decode_per_seq_ms=0.07, prefill_per_token_ms=0.1, tp_efficiency=0.8
)


def test_defaults_are_the_published_figures() -> None:
    assert CostModel() == PUBLISHED


@pytest.mark.parametrize(
    ("decoding", "prefill", "tp", "seconds"),
    [
        (0, 0, 1, 0.0072),
        (1, 0, 1, 0.00727),  # 7.2 + 0.07
        (8, 0, 1, 0.00776),  # 7.2 + 8 * 0.07
        (8, 100, 1, 0.01776),  # + 100 * 0.1
        (8, 100, 0, 0.01776),  # tp below 1 counts as one GPU
        (8, 100, 2, 0.01776 / 1.7411011),  # 2 ** 0.8
        (8, 100, 4, 0.01776 / 3.0314331),  # 4 ** 0.8
    ],
)
def test_step_seconds(decoding: int, prefill: int, tp: int, seconds: float) -> None:
    assert PUBLISHED.step_seconds(decoding, prefill, tp) == pytest.approx(seconds, rel=1e-6)


def test_tp_speed_up_follows_efficiency() -> None:
    linear = CostModel(decode_base_ms=8.0, decode_per_seq_ms=0.0, tp_efficiency=1.0)
    none = CostModel(decode_base_ms=8.0, decode_per_seq_ms=0.0, tp_efficiency=0.0)
    assert linear.step_seconds(0, 0, 4) == pytest.approx(0.002)
    assert none.step_seconds(0, 0, 4) == pytest.approx(0.008)
    # Sub-linear by default: more GPUs help, but less than proportionally.
    assert 0.25 < PUBLISHED.step_seconds(3, 0, 4) / PUBLISHED.step_seconds(3, 0, 1) < 0.5


# --- KV cache: usage, preemption, prefix caching ---------------------------------------------


def test_full_kv_cache_preempts_the_newest_sequence_which_recomputes_later() -> None:
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler.block_size, scheduler.num_gpu_blocks = 4, 6
    usage: list[float] = []

    async def body() -> tuple[list[int], list[int]]:
        old = scheduler.submit(8, 10)  # 8 + 10 tokens: 5 blocks at the end
        new = scheduler.submit(8, 10)
        drains = asyncio.gather(_drain(old), _drain(new))
        while not drains.done():
            usage.append(scheduler.kv_cache_usage)
            await asyncio.sleep(0)
        return await drains

    old_tokens, new_tokens = _run(scheduler, body)
    # Both finish, with every token, though both never fit at once.
    assert (len(old_tokens), len(new_tokens)) == (10, 10)
    assert scheduler.num_preemptions >= 1
    assert max(usage) == 1.0  # full when the preemption came
    assert scheduler.used_blocks == 0  # all freed at the end
    # The newest one was preempted and prefilled again: its 8 prompt tokens and the tokens
    # it had generated, on top of both prompts' first prefill.
    prefilled = sum(prefill for _, _, prefill in _log(scheduler))
    assert prefilled > 16
    assert scheduler.generation_tokens == 20


def test_prefix_cache_hits_skip_prefill_of_full_blocks() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.block_size = 4
    shared = list(range(10))

    async def body() -> None:
        await _drain(scheduler.submit(12, 1, [*shared, 100, 101]))
        await _drain(scheduler.submit(12, 1, [*shared, 200, 201]))
        await _drain(scheduler.submit(3, 1, None))  # no ids (a prompt of ids unknown): no lookup

    _run(scheduler, body)
    assert scheduler.prefix_cache_queries == 24
    # Blocks [0..3] and [4..7] match; [8, 9, 200, 201] differs from [8, 9, 100, 101].
    assert scheduler.prefix_cache_hits == 8
    assert [prefill for _, _, prefill in _log(scheduler)] == [12, 4, 3]
    assert scheduler.prompt_tokens == 12 + 12 + 3


def test_prefix_caching_off_counts_no_queries() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.enable_prefix_caching = False

    async def body() -> None:
        for _ in range(2):
            await _drain(scheduler.submit(8, 1, list(range(8))))

    _run(scheduler, body)
    assert [prefill for _, _, prefill in _log(scheduler)] == [8, 8]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (0, 0)


def test_profiling_records_one_trace_event_per_step() -> None:
    scheduler = _scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    scheduler.trace_events = []
    _run(scheduler, lambda: _drain(scheduler.submit(2, 3)))
    events = scheduler.trace_events
    assert [e["args"]["step"] for e in events] == [1, 2, 3]
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in events)
    assert events[0]["args"]["prefill_tokens"] == 2
