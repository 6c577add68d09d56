"""PROFLLM_SIM_SLOWDOWN: the factor the simulated engine multiplies its step times by."""

from __future__ import annotations

import asyncio
import time

import pytest

from pytest_profllm.sim.scheduler import CostModel, Scheduler, slowdown_from_env


def test_slowdown_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROFLLM_SIM_SLOWDOWN", raising=False)
    assert slowdown_from_env() == 1.0
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "1.15")
    assert slowdown_from_env() == 1.15
    assert Scheduler(CostModel(), 4, 64).slowdown == 1.15
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", bad)
        with pytest.raises(ValueError, match=f"PROFLLM_SIM_SLOWDOWN='{bad}'"):
            slowdown_from_env()


def _generate(slowdown: float, tokens: int) -> float:
    """Seconds the scheduler takes to generate `tokens` tokens of one sequence."""
    scheduler = Scheduler(
        CostModel(decode_base_ms=10, decode_per_seq_ms=0, prefill_per_token_ms=0),
        4,
        64,
        slowdown=slowdown,
    )

    async def main() -> float:
        loop = asyncio.create_task(scheduler.run())
        began = time.perf_counter()
        sequence = scheduler.submit(4, tokens)
        while await sequence.tokens.get() is not None:
            pass
        loop.cancel()
        return time.perf_counter() - began

    return asyncio.run(main())


def test_every_step_takes_its_time_times_the_factor() -> None:
    # A busy host can only make steps later, so the lower bound is what holds everywhere.
    assert _generate(3.0, 10) >= 10 * 0.010 * 3.0 * 0.99
