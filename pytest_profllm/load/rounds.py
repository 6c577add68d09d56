"""A serve load in rounds (`until:`, plan/suite/until.py): the workload's prompts first, then
round after round of more requests of the same arrival process (same rate and burstiness,
prompts and gaps drawn from the next seed, as a capacity probe's runs are), until the
statistic's interval is narrow enough or the cap is reached (load/until.py).

The rounds are one measurement: the server's caches are not emptied between them, and the
result is their requests laid back to back (load/schedule.py `back_to_back`), each request
once, which the case's metrics, its judge (load/validity.py) and its record see as one load.
Between rounds the client waits for a round's last response before the next round's first
request: the server drains for at most one request's latency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pytest_profllm.load import stages
from pytest_profllm.load.bench import run_load
from pytest_profllm.load.capacity.statistics import probe_samples
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadResult, LoadSettings, back_to_back
from pytest_profllm.load.until import Stop, narrow_enough, next_round, read, stop
from pytest_profllm.plan.suite import Until

# (count, seed) -> that many prompts drawn from that seed: a later round's prompts.
MorePrompts = Callable[[int, int], Sequence[PromptRequest]]


async def run_rounds(
    settings: LoadSettings,
    first: Sequence[PromptRequest],
    more: MorePrompts,
    until: Until,
) -> tuple[LoadResult, Stop, list[PromptRequest]]:
    """The pooled load, why it stopped, and every prompt sent, in sending order."""
    loads = [await run_load(settings, first)]
    sent = list(first)
    rounds = 1
    while True:
        pooled = back_to_back(loads)
        samples = probe_samples(pooled.outcomes, {}, {}, None, None).latencies[until.latency]
        reading = read(until, samples, seed=settings.seed)
        if narrow_enough(until, reading):
            return pooled, stop(until, reading, "interval", rounds, len(sent)), sent
        count = next_round(until, len(first), len(sent))
        if count == 0:
            return pooled, stop(until, reading, "cap", rounds, len(sent)), sent
        stages.enter("loading", f"round {rounds + 1}, {len(sent) + count:,} requests")
        seed = settings.seed + rounds
        prompts = list(more(count, seed))
        # One warm-up at most, before the first round; request ids stay distinct per round.
        later = dataclasses.replace(
            settings, seed=seed, num_warmups=0,
            request_id_prefix=f"{settings.request_id_prefix}r{rounds}-",
        )
        loads.append(await run_load(later, prompts))
        sent += prompts
        rounds += 1
