"""The simulated engine on a busy host: how late its real-time steps end (`StepLateness`, on
`/metrics` as `profllm:sim_step_lateness_seconds` and plain counters), and the lower priority
it runs at (`PROFLLM_SIM_NICE`), so that the client's CPU comes first."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import psutil
import pytest
import requests
from helpers import simulator
from prometheus_client.parser import text_string_to_metric_families

from pytest_profllm.sim.batching import LATE_STEP_THRESHOLDS_MS, ConstantStepCost, Scheduler
from pytest_profllm.sim.cli import DEFAULT_NICE, nice_from_env
from pytest_profllm.sim.instruments import render_metrics

STEP_S = 0.01  # long enough that a scheduling hiccup of the test host makes few late steps


def _run_for(scheduler: Scheduler, seconds: float, blocks: int = 0) -> None:
    """Run the real-time loop with one long sequence for `seconds`, the event loop blocked
    `blocks` times for 50 ms (as a busy host delays the loop's wake-up)."""

    async def main() -> None:
        loop = asyncio.create_task(scheduler.run())
        scheduler.submit(16, 100_000)
        try:
            for _ in range(blocks):
                await asyncio.sleep(seconds / (blocks + 1))
                time.sleep(0.05)
            await asyncio.sleep(seconds / (blocks + 1))
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    asyncio.run(asyncio.wait_for(main(), timeout=10))


def test_a_blocked_event_loop_makes_late_steps() -> None:
    scheduler = Scheduler(ConstantStepCost(STEP_S), max_num_seqs=4, max_num_batched_tokens=64)
    _run_for(scheduler, 0.6, blocks=5)
    lateness = scheduler.lateness
    assert lateness.steps == scheduler.steps > 20
    # Each block ends the step in flight 40-50 ms late, and the next ones late while the loop
    # catches up.
    assert lateness.over(20) >= 5
    assert lateness.over(1) >= lateness.over(20)
    assert 0.035 < lateness.max_seconds < 1.0
    assert lateness.total_seconds >= 5 * 0.035


def test_an_idle_host_makes_almost_no_late_steps() -> None:
    scheduler = Scheduler(ConstantStepCost(STEP_S), max_num_seqs=4, max_num_batched_tokens=64)
    _run_for(scheduler, 0.6)
    lateness = scheduler.lateness
    assert lateness.steps == scheduler.steps > 30
    assert lateness.over(20) <= 5, [lateness.over(ms) for ms in LATE_STEP_THRESHOLDS_MS]


def test_steps_of_a_virtual_clock_have_no_lateness() -> None:
    scheduler = Scheduler(ConstantStepCost(), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.submit(16, 5)
    now = 0.0
    while (step := scheduler.plan_step()) is not None:
        now += scheduler.step_duration(step)
        scheduler.finish_step(step, now)
    assert scheduler.steps == 5 and scheduler.lateness.steps == 0


def _samples(text: str) -> dict[tuple[str, str | None], float]:
    return {
        (sample.name, sample.labels.get("le")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_carry_the_lateness_histogram_and_one_counter_per_threshold() -> None:
    scheduler = Scheduler(ConstantStepCost(), max_num_seqs=4, max_num_batched_tokens=64)
    for seconds in (0.0, 0.0015, 0.015, 0.015, 0.3, 7.0):
        scheduler.lateness.observe(seconds)
    samples = _samples(render_metrics(scheduler, "m").decode())
    histogram = "profllm:sim_step_lateness_seconds"
    assert {le: v for (name, le), v in samples.items() if name == histogram + "_bucket"} == {
        "0.001": 1, "0.002": 2, "0.005": 2, "0.01": 2, "0.02": 4, "0.05": 4, "0.1": 4,
        "0.2": 4, "0.5": 5, "1.0": 5, "2.0": 5, "5.0": 5, "+Inf": 6,
    }  # fmt: skip
    assert samples[histogram + "_count", None] == 6
    assert samples[histogram + "_sum", None] == pytest.approx(7.3315)
    late = {ms: samples[f"profllm:sim_steps_late_over_{ms}ms_total", None] for ms in (1, 20)}
    assert late == {1: 5, 20: 2}
    assert samples["profllm:sim_steps_late_over_1000ms_total", None] == 1
    assert samples["profllm:sim_steps_total", None] == 6
    assert samples["profllm:sim_step_lateness_seconds_total", None] == pytest.approx(7.3315)
    assert samples["profllm:sim_step_lateness_max_seconds", None] == 7.0


def test_the_niceness_increment_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PROFLLM_SIM_NICE", raising=False)
    assert nice_from_env() == DEFAULT_NICE == 10
    monkeypatch.setenv("PROFLLM_SIM_NICE", "0")
    assert nice_from_env() == 0
    monkeypatch.setenv("PROFLLM_SIM_NICE", "low")
    with pytest.raises(ValueError, match="PROFLLM_SIM_NICE='low': expected an integer"):
        nice_from_env()


def _simulator_process(url: str) -> psutil.Process:
    port = url.rsplit(":", 1)[1]
    for child in psutil.Process().children():
        cmdline = child.cmdline()
        if "pytest_profllm.sim" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
            return child
    raise AssertionError(f"no simulator child serves port {port}")


@pytest.mark.parametrize(("nice", "increment"), [(None, 10), ("0", 0), ("3", 3)])
def test_the_simulator_runs_below_the_clients_priority(
    nice: str | None, increment: int, port_range: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROFLLM_SIM_NICE"}
    if nice is not None:
        env["PROFLLM_SIM_NICE"] = nice
    first = int(port_range.split("-")[0]) + 80
    with simulator(first, tmp_path / "sim.log", "sim", env=env) as url:
        niceness = _simulator_process(url).nice()
        names = {
            sample.name
            for family in text_string_to_metric_families(
                requests.get(url + "/metrics", timeout=10).text
            )
            for sample in family.samples
        }
    assert niceness == min(19, os.nice(0) + increment)
    lateness = {f"profllm:sim_steps_late_over_{ms}ms_total" for ms in LATE_STEP_THRESHOLDS_MS}
    assert {
        "profllm:sim_step_lateness_seconds_bucket",
        "profllm:sim_step_lateness_seconds_sum",
        "profllm:sim_step_lateness_seconds_count",
        "profllm:sim_steps_total",
        "profllm:sim_step_lateness_seconds_total",
        "profllm:sim_step_lateness_max_seconds",
        *lateness,
    } <= names
