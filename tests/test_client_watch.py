"""The client watching itself (load/client_watch.py), the rule that reads it
(`client_saturated` in load/validity.py), and the client's own queue under max_concurrency.

The watch's arithmetic runs on a loop whose clock the test moves, and the run-queue figures
come from a file the test writes: nothing there depends on how busy the host is. The one
real load slowed on purpose blocks its own loop, which a busy host can only make later."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from aiohttp import web
from helpers import serve_handler

from pytest_profllm.load import metrics
from pytest_profllm.load.attempts import Attempts
from pytest_profllm.load.bench import measure, run_load
from pytest_profllm.load.client_watch import ClientWatch, WatchFigures, worst
from pytest_profllm.load.dataset import PromptRequest, TokenizerCodec
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult, LoadSettings
from pytest_profllm.load.validity import InvalidKind, Judgement, LoadFacts, Rules, judge
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.run.outcome import request_row
from pytest_profllm.sim.model_files import MODEL_DIR

CODEC = TokenizerCodec.load(str(MODEL_DIR))


class _Timer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class SteppedLoop:
    """Enough of an event loop for the watch: a clock the test sets, and timers that run
    when the test lets the loop get to them (as a loop runs them after a stall: at once)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.timers: list[_Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(when, callback)
        self.timers.append(timer)
        return timer

    def run_until(self, now: float) -> None:
        self.now = now
        due = [t for t in self.timers if t.when <= now and not t.cancelled]
        self.timers = [t for t in self.timers if t not in due]
        for timer in due:
            timer.callback()


def _watch(schedstat: Path) -> tuple[ClientWatch, SteppedLoop]:
    loop = SteppedLoop()
    watch = ClientWatch(tick_s=0.010, schedstat=schedstat)
    watch.start(cast(asyncio.AbstractEventLoop, loop))
    return watch, loop


def test_every_tick_that_fell_due_in_a_stall_counts_with_its_own_lateness(
    tmp_path: Path,
) -> None:
    watch, loop = _watch(tmp_path / "none")
    # A microsecond after each due moment (the sums of float ticks are not exact): on time,
    # on time, then a stall: the ticks due at 30, 40 and 50 ms ran at 55 ms; then on time.
    for moment in (0.010, 0.020, 0.055, 0.060):
        loop.run_until(100.0 + moment + 1e-6)
    figures = watch.stop()
    assert figures.ticks == 6
    assert figures.lag_max_ms == pytest.approx(25.0, abs=0.01)
    assert figures.lag_p50_ms == pytest.approx(2.5, abs=0.01)
    assert figures.lag_p99_ms == pytest.approx(15.0, abs=0.01)  # the lower of the two there
    assert figures.wall_s == pytest.approx(0.060, abs=1e-5)
    assert figures.runqueue_wait_share is None  # no schedstat here: not known, not zero


def test_the_shares_are_the_threads_own_scheduler_figures(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("5000000 7000000 12\n")
    watch, loop = _watch(schedstat)
    loop.run_until(100.100)
    # 20 ms on a core and 60 ms waiting for one, of 100 ms.
    schedstat.write_text(f"{5_000_000 + 20_000_000} {7_000_000 + 60_000_000} 40\n")
    figures = watch.stop()
    assert figures.cpu_share == pytest.approx(0.2)
    assert figures.runqueue_wait_share == pytest.approx(0.6)
    assert figures.runnable_share == pytest.approx(0.8)


def test_a_load_shorter_than_a_tick_has_no_lag_figures(tmp_path: Path) -> None:
    watch, loop = _watch(tmp_path / "none")
    loop.now = 100.004
    figures = watch.stop()
    assert (figures.ticks, figures.lag_p99_ms, figures.lag_max_ms) == (0, None, None)
    assert not loop.timers or all(t.cancelled for t in loop.timers)  # it stopped ticking


def _figures(lag_p99_ms: float | None = 1.0, wait: float | None = 0.05,
             cpu: float | None = 0.2) -> WatchFigures:
    return WatchFigures(wall_s=1.0, ticks=100, lag_p50_ms=0.5, lag_p99_ms=lag_p99_ms,
                        lag_max_ms=lag_p99_ms, cpu_share=cpu, runqueue_wait_share=wait)


def test_several_processes_report_the_worst_loop_and_the_busiest_processs_shares() -> None:
    shares = worst([_figures(30.0, 0.1, 0.7), _figures(2.0, 0.6, 0.3), _figures(None, None)])
    assert shares["client_loop_lag_p99_ms"] == 30.0
    # The second wanted 0.9 of a core (0.3 + 0.6 waiting): its shares, never a sum.
    assert (shares["client_cpu_share"], shares["client_runqueue_wait_share"]) == (0.3, 0.6)
    assert set(worst([]).values()) == {None}  # no watch (the virtual clock's client)


def _judged(figures: list[WatchFigures], rules: Rules | None = None) -> Judgement:
    made = [RequestOutcome(prompt_len=4, success=True, output_tokens=2, output_len=2,
                           ttft=0.01, latency=0.02, itl=[0.01], end_time=0.02, status=200)]
    load = LoadResult(made, 1.0, 0.0, 0.0, cpu_seconds=0.1, intended_offsets=[0.0],
                      watch=figures)
    config = BenchmarkConfig(num_prompts=1)
    _, health = measure(load, config, CODEC)
    return judge(LoadFacts(load, config, health, {}), (None, None), rules or Rules())


def _saturated(judgement: Judgement) -> list[str]:
    return [r.text for r in judgement.reasons if r.kind is InvalidKind.CLIENT_SATURATED]


def test_a_quiet_client_is_not_saturated() -> None:
    # The loop on time within the bound, a little wait for a core; and a load no watch saw.
    for figures in ([_figures(10.0, 0.05)], [_figures(1.2, 0.5)], [_figures(None, None)], []):
        assert _saturated(_judged(figures)) == []


@pytest.mark.parametrize(("figures", "said"), [
    (_figures(lag_p99_ms=10.5), "event loop p99 lag 10.5 ms is over 10 ms"),
    (_figures(wait=0.72), "it waited for a core 72% of the load, over 50%"),
])
def test_a_late_loop_or_a_long_wait_for_a_core_is_saturated_and_measured_again(
    figures: WatchFigures, said: str
) -> None:
    judgement = _judged([figures])
    [text] = _saturated(judgement)
    assert text.startswith("client saturated: ") and said in text
    assert "it ran 20% of the load" in text
    reasons = [r for r in judgement.reasons if r.kind is InvalidKind.CLIENT_SATURATED]
    assert all(r.host_caused for r in reasons)
    assert Attempts(remeasure=1).again(reasons)


def test_the_loop_lag_bound_is_the_schedule_lags() -> None:
    late = [_figures(lag_p99_ms=50.0)]
    assert _saturated(_judged(late, Rules(max_schedule_lag_ms=1000))) == []
    assert _saturated(_judged(late, Rules(max_schedule_lag_ms=20)))
    virtual = _judged(late, Rules(virtual_clock=True))
    assert _saturated(virtual) == [] and InvalidKind.CLIENT_SATURATED in virtual.not_applied


def _stream(*steps: bytes | float) -> Callable[[web.Request], Any]:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for step in steps:
            if isinstance(step, bytes):
                await response.write(step)
            else:
                await asyncio.sleep(step)
        await response.write_eof()
        return response

    return handler


TOKEN = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
LAST = b'data: {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}\n\n'
USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
DONE = b"data: [DONE]\n\n"


def _load(handler: Callable[[web.Request], Any], count: int, *, block_s: float = 0.0,
          max_concurrency: int | None = None) -> LoadResult:
    """`count` requests at once, bounded in time; with `block_s`, a callback that blocks
    the client's loop that long every 10 ms it is free, as a client's own heavy work would."""

    async def main() -> LoadResult:
        loop = asyncio.get_running_loop()
        blocker: list[asyncio.TimerHandle] = []

        def block() -> None:
            time.sleep(block_s)
            blocker[:] = [loop.call_later(0.010, block)]

        async with serve_handler(handler) as url:
            settings = LoadSettings(base_url=url, model="sim", request_timeout_s=10.0,
                                    max_concurrency=max_concurrency)
            requests = [PromptRequest(f"p{i}", 3, 2) for i in range(count)]
            if block_s:
                blocker.append(loop.call_later(0.005, block))
            try:
                return await asyncio.wait_for(run_load(settings, requests), timeout=20)
            finally:
                for handle in blocker:
                    handle.cancel()

    return asyncio.run(main())


def test_a_client_slowed_on_purpose_is_saturated_where_its_cpu_says_nothing() -> None:
    # Its loop blocked 30 ms in every 40: the tokens it reads wait as long to be stamped.
    load = _load(_stream(TOKEN, 0.3, LAST, USAGE, DONE), 2, block_s=0.030)
    config = BenchmarkConfig(num_prompts=2)
    results, health = measure(load, config, CODEC)
    assert results["completed"] == 2
    [figures] = load.watch
    assert figures.ticks >= 20 and figures.lag_max_ms is not None and figures.lag_max_ms >= 20
    judgement = judge(LoadFacts(load, config, health, results), (None, None), Rules())
    kinds = [reason.kind for reason in judgement.reasons]
    assert InvalidKind.CLIENT_SATURATED in kinds
    # It slept, so its CPU stayed far under a core: the old rule alone called it valid.
    assert InvalidKind.CLIENT_FELL_BEHIND not in kinds
    assert all(reason.host_caused for reason in judgement.reasons)


def test_the_client_queue_is_each_requests_wait_for_a_free_slot() -> None:
    # One slot, three requests due at once: each waits for those before it.
    load = _load(_stream(TOKEN, 0.1, LAST, USAGE, DONE), 3, max_concurrency=1)
    first, second, third = load.outcomes
    assert all(o.success for o in load.outcomes)
    queue = [o.client_queue for o in load.outcomes]
    latency = [o.latency for o in load.outcomes]
    assert second.start_time >= first.end_time and third.start_time >= second.end_time
    # The second waited about the first's latency; the third that and the second's.
    assert latency[0] - 0.002 <= queue[1] < latency[0] + latency[1]
    assert queue[1] + latency[1] - 0.002 <= queue[2] < queue[1] + latency[1] + latency[2]
    assert queue[0] < queue[1] / 2
    # vLLM's TTFT and E2EL start at the send: the wait is not in them.
    assert all(o.ttft < queue[1] for o in load.outcomes)
    results, _ = measure(load, BenchmarkConfig(num_prompts=3, max_concurrency=1), CODEC)
    assert results["median_e2el_ms"] == pytest.approx(statistics.median(latency) * 1000)
    assert results["mean_client_queue_ms"] == pytest.approx(statistics.fmean(queue) * 1000)
    assert results["p99_client_queue_ms"] == pytest.approx(np.percentile(queue, 99) * 1000)
    with_queue = [q + e for q, e in zip(queue, latency, strict=True)]
    assert results["median_e2el_with_queue_ms"] == pytest.approx(
        statistics.median(with_queue) * 1000)
    assert results["mean_e2el_with_queue_ms"] > results["mean_e2el_ms"]
    row = request_row(1, second, load.clock_start)
    assert row["client_queue_s"] == pytest.approx(queue[1])
    assert row["start_s"] - row["dispatch_s"] == pytest.approx(queue[1])


def test_without_max_concurrency_nothing_waits_in_the_client() -> None:
    figures = metrics.client_queue_summary([
        RequestOutcome(prompt_len=1, success=True, latency=0.2, dispatch_time=1.0,
                       start_time=1.0),
        RequestOutcome(prompt_len=1, success=False, dispatch_time=1.0, start_time=3.0),
    ])
    assert figures["p99_client_queue_ms"] == 0.0  # the failed request is not counted
    assert figures["median_e2el_with_queue_ms"] == pytest.approx(200.0)
