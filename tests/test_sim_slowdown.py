"""The simulated engine's steps keep to its cost model's clock, so that PROFLLM_SIM_SLOWDOWN
(applied in sim/cost.py, tested in test_sim_cost.py) shows as a slower run."""

from __future__ import annotations

import asyncio
import time

from pytest_profllm.sim.batching import ConstantStepCost, Scheduler


def _generate(step_s: float, tokens: int) -> float:
    """Seconds the scheduler takes to generate `tokens` tokens of one sequence."""
    scheduler = Scheduler(ConstantStepCost(step_s), 4, 64)

    async def main() -> float:
        loop = asyncio.create_task(scheduler.run())
        began = time.perf_counter()
        sequence = scheduler.submit(4, tokens)
        while await sequence.tokens.get() is not None:
            pass
        loop.cancel()
        return time.perf_counter() - began

    return asyncio.run(main())


def test_every_step_takes_its_modelled_time() -> None:
    # A busy host can only make steps later, so the lower bound is what holds everywhere.
    assert _generate(0.030, 10) >= 10 * 0.030 * 0.99
