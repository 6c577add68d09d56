"""vLLM's development route `POST /reset_prefix_cache` on the simulated engine: served only
with `VLLM_SERVER_DEV_MODE=1`, it empties the scheduler's prefix cache (vLLM 0.32.0 and 0.33:
`vllm/entrypoints/serve/dev/cache/api_router.py`, `Scheduler.reset_prefix_cache`,
`BlockPool.reset_prefix_cache`)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import requests
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from helpers import simulator
from prometheus_client.parser import text_string_to_metric_families

from pytest_profllm.sim.batching import ConstantStepCost, Scheduler, Sequence
from pytest_profllm.sim.cli import main
from pytest_profllm.sim.instruments import add_dev_routes
from pytest_profllm.sim.profiler_config import dev_mode_from_env

T = TypeVar("T")
PROMPT = list(range(1000, 1100))  # 100 token ids: 6 full blocks, 96 tokens the cache can hold
DEV_ROUTES = ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache")


def _scheduler() -> Scheduler:
    return Scheduler(
        ConstantStepCost(), max_num_seqs=4, max_num_batched_tokens=512, stream_tokens=False
    )


def _step(scheduler: Scheduler, until: Callable[[], bool] = lambda: False) -> None:
    """Step on a virtual clock until nothing is left to run or `until()`."""
    now = 0.0
    while not until() and (step := scheduler.plan_step()) is not None:
        now += scheduler.step_duration(step)
        scheduler.finish_step(step, now)


def _served(scheduler: Scheduler, prompt_ids: list[int], max_tokens: int = 2) -> Sequence:
    sequence = scheduler.submit(len(prompt_ids), max_tokens, prompt_ids)
    _step(scheduler)
    return sequence


def test_a_reset_forgets_every_cached_block_and_keeps_the_counters() -> None:
    scheduler = _scheduler()
    assert _served(scheduler, PROMPT).cached_tokens == 0
    assert _served(scheduler, PROMPT).cached_tokens == 96
    queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
    assert scheduler.reset_prefix_cache()
    assert _served(scheduler, PROMPT).cached_tokens == 0
    # Counters, as vLLM's: the reset does not take them back, the lookup after it adds a query.
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (queries + 100, hits)
    assert _served(scheduler, PROMPT).cached_tokens == 96  # computed again, cached again


def test_a_reset_is_refused_while_running_sequences_hold_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = _scheduler()
    _served(scheduler, PROMPT)
    running = scheduler.submit(len(PROMPT), 50, PROMPT)
    _step(scheduler, until=lambda: running.generated == 3)
    with caplog.at_level(logging.WARNING, logger="profllm.sim"):
        assert not scheduler.reset_prefix_cache()
    assert "Failed to reset prefix cache because some blocks (7) are not freed yet" in caplog.text
    assert running in scheduler.running
    # Refused: nothing was forgotten.
    assert _served(scheduler, PROMPT).cached_tokens == 96


def test_reset_running_requests_preempts_them_in_order_then_resets() -> None:
    scheduler = _scheduler()
    _served(scheduler, PROMPT)
    first, second = (scheduler.submit(len(PROMPT), 50, PROMPT) for _ in range(2))
    _step(scheduler, until=lambda: second.generated == 3)
    assert scheduler.running == [first, second]
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert (scheduler.running, list(scheduler.waiting)) == ([], [first, second])
    assert scheduler.used_blocks == 0
    assert scheduler.num_preemptions == 2 and first.preemptions == second.preemptions == 1
    hits = scheduler.prefix_cache_hits
    _step(scheduler)
    # Both recomputed their prompt and the 3 tokens they had generated, finding nothing; their
    # tokens of the step in flight were dropped, not emitted twice.
    assert first.generated == second.generated == 50
    assert first.computed_tokens == second.computed_tokens == 4 + 103
    assert scheduler.prefix_cache_hits == hits


def test_a_waiting_sequence_looked_up_before_the_reset_looks_up_again() -> None:
    scheduler = _scheduler()
    scheduler.num_gpu_blocks = 12
    _served(scheduler, PROMPT)
    other = scheduler.submit(100, 50, list(range(5000, 5100)))
    _step(scheduler, until=lambda: other.generated == 1)
    waiting = scheduler.submit(len(PROMPT), 2, PROMPT)
    _step(scheduler, until=lambda: other.generated == 2)
    # It found 96 tokens, but its other 4 need a 7th block and only 5 are free: it waits.
    assert waiting in scheduler.waiting and waiting.prefilled == 96
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert list(scheduler.waiting) == [other, waiting]
    _step(scheduler)
    assert waiting.generated == 2
    assert waiting.cached_tokens == 0 and waiting.computed_tokens == 100


def test_dev_mode_is_read_as_vllm_reads_it() -> None:
    assert dev_mode_from_env({}) is False
    assert [dev_mode_from_env({"VLLM_SERVER_DEV_MODE": v}) for v in ("0", "1", "2")] == [
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE='yes': expected an integer"):
        dev_mode_from_env({"VLLM_SERVER_DEV_MODE": "yes"})


def test_an_unreadable_dev_mode_stops_the_simulator_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "true")
    with caplog.at_level(logging.ERROR, logger="profllm.sim"):
        assert main(["sim"]) == 1
    assert "VLLM_SERVER_DEV_MODE='true': expected an integer" in caplog.text


def _serve(scheduler: Scheduler, body: Callable[[TestClient[web.Request, web.Application]],
           Awaitable[T]]) -> T:  # fmt: skip
    async def run() -> T:
        app = web.Application()
        add_dev_routes(app, scheduler)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await body(client)

    return asyncio.run(run())


def test_the_route_answers_success_false_while_blocks_are_held_as_vllm() -> None:
    scheduler = _scheduler()
    running = scheduler.submit(len(PROMPT), 50, PROMPT)
    _step(scheduler, until=lambda: running.generated == 1)

    async def body(client: TestClient[web.Request, web.Application]) -> list[object]:
        found: list[object] = []
        for query in ("", "?reset_external=true", "?reset_running_requests=True"):
            response = await client.post("/reset_prefix_cache" + query)
            found.append((response.status, await response.json()))
        return found

    assert _serve(scheduler, body) == [
        (200, {"success": False}),
        (200, {"success": False}),  # no KV connector: reset_external changes nothing
        (200, {"success": True}),
    ]
    assert list(scheduler.waiting) == [running]


def test_a_query_flag_that_is_no_boolean_is_a_400() -> None:
    async def body(client: TestClient[web.Request, web.Application]) -> tuple[int, object]:
        response = await client.post("/reset_prefix_cache?reset_running_requests=maybe")
        return response.status, await response.json()

    status, answer = _serve(_scheduler(), body)
    assert status == 400
    assert isinstance(answer, dict)
    error = answer["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "Bad Request",
        "query.reset_running_requests",
        400,
    )
    assert "valid boolean" in error["message"]


def _prefix_cache_hits(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prefix_cache_hits_total"
    )


def _complete(url: str) -> None:
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 2}
    response = requests.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_a_dev_mode_simulator_recomputes_a_prompt_after_a_reset(
    port_range: str, tmp_path: Path
) -> None:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    first = int(port_range.split("-")[0]) + 60
    with simulator(first, tmp_path / "sim.log", "sim", env=env) as url:
        _complete(url)
        before = _prefix_cache_hits(url)
        _complete(url)
        repeated = _prefix_cache_hits(url)
        reset = requests.post(url + "/reset_prefix_cache", timeout=10)
        _complete(url)
        after_reset = _prefix_cache_hits(url)
        others = [requests.post(url + path, timeout=10) for path in DEV_ROUTES[1:]]
    assert repeated - before == 96
    assert (reset.status_code, reset.json()) == (200, {"success": True})
    assert after_reset == repeated  # no new hit: the prompt was computed again
    assert [(r.status_code, r.text) for r in others] == [(200, ""), (200, "")]
    log = (tmp_path / "sim.log").read_text()
    assert "development routes are enabled" in log
    assert "Successfully reset prefix cache" in log


def test_without_dev_mode_the_routes_are_404(port_range: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    first = int(port_range.split("-")[0]) + 70
    with simulator(first, tmp_path / "sim.log", "sim", env=env) as url:
        statuses = [requests.post(url + path, timeout=10).status_code for path in DEV_ROUTES]
    assert statuses == [404, 404, 404]
