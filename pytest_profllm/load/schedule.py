"""A load: what to send where (its settings), when to send each request (the arrival schedule,
as `vllm bench serve` draws it), and what came back (its result).

Arrival times follow vLLM's schedule: all at once for an infinite rate, else gamma-distributed
gaps (burstiness 1.0 is a Poisson process), or a linear or exponential ramp from one rate to
another.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from pytest_profllm.load.client_watch import WatchFigures
from pytest_profllm.load.metrics import RequestOutcome

Backend = Literal["openai", "openai-chat", "openai-embeddings", "vllm-rerank"]
RampUp = Literal["linear", "exponential"]


@dataclass(frozen=True)
class LoadSettings:
    base_url: str
    model: str
    backend: Backend = "openai"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ramp_up_strategy: RampUp | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float | None = 0.0  # None: not sent, the server's default applies (as vLLM)
    num_warmups: int = 0
    request_timeout_s: float = 600.0
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a traceback
    endpoint: str | None = None  # default: the backend's
    # Each request sends `x-request-id: <prefix><index>`, as vLLM's client does, so server logs
    # can be matched to requests.
    request_id_prefix: str = "profllm-"
    client_processes: int = 1  # more than one: the load is spread over that many processes
    # Each request goes at its own `timestamp` (a timed trace's), not on a drawn schedule.
    self_timed: bool = False
    # The first 16 hex digits of every trace id the load sends (load/trace_context.py), where
    # a receiver awaits its spans (load/span_receiver.py); empty: wholly random trace ids.
    trace_key: str = ""


def client_cores() -> int | None:
    """How many cores the calling thread may run on (and the processes it starts)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return len(os.sched_getaffinity(0))  # 0: the calling thread, on Linux


@dataclass
class LoadResult:
    outcomes: list[RequestOutcome]
    duration: float  # seconds from the benchmark's start to the last response
    started_at: float  # Unix seconds
    clock_start: float  # the same moment on the perf_counter clock the outcomes use
    cpu_seconds: float = 0.0  # the client event loops' CPU time during the timed part
    processes: int = 1  # how many client processes shared the load
    intended_offsets: list[float] = field(default_factory=list)
    # The client's open-file limit, and the line that says where it capped the connections
    # the load would have opened (hosts/descriptors.py); None where it did not.
    open_file_limit: int | None = None
    client_limit: str | None = None
    # What each client process saw of itself over the load (load/client_watch.py): its
    # loop's lag, its CPU and run-queue shares. Empty where no watch ran (the virtual clock).
    watch: list[WatchFigures] = field(default_factory=list)
    # How many host cores the client could run on (its loop thread's affinity, which the
    # client processes it starts inherit); None where not known (the virtual clock).
    cores: int | None = None


def back_to_back(loads: Sequence[LoadResult]) -> LoadResult:
    """Runs of one workload as one load that ran them one after another: each run's times
    moved to start where the runs before it ended (their summed durations), so vLLM's metrics
    over it are those of all their requests over their summed duration, and every request
    keeps its own latencies and lag. A capacity probe pools its runs this way."""
    if len(loads) == 1:
        return loads[0]
    first = loads[0]
    outcomes: list[RequestOutcome] = []
    offsets: list[float] = []
    elapsed = 0.0
    for load in loads:
        shift = first.clock_start + elapsed - load.clock_start
        outcomes += [_shifted(outcome, shift) for outcome in load.outcomes]
        offsets += [elapsed + offset for offset in load.intended_offsets]
        elapsed += load.duration
    limits = [load.open_file_limit for load in loads if load.open_file_limit is not None]
    capped = dict.fromkeys(load.client_limit for load in loads if load.client_limit)
    return LoadResult(outcomes, elapsed, first.started_at, first.clock_start,
                      sum(load.cpu_seconds for load in loads),
                      max(load.processes for load in loads), offsets,
                      open_file_limit=min(limits) if limits else None,
                      client_limit="; ".join(capped) or None,
                      cores=max((load.cores for load in loads if load.cores), default=None),
                      watch=[figures for load in loads for figures in load.watch])


def _shifted(outcome: RequestOutcome, shift: float) -> RequestOutcome:
    def moved(moment: float) -> float:
        return moment + shift if moment else moment  # 0.0: never happened (an unsent turn)

    return replace(outcome, start_time=moved(outcome.start_time),
                   intended_start=moved(outcome.intended_start),
                   dispatch_time=moved(outcome.dispatch_time),
                   end_time=moved(outcome.end_time),
                   message_times=[moved(moment) for moment in outcome.message_times])


def arrival_offsets(
    count: int,
    rate: float,
    burstiness: float,
    seed: int,
    ramp_up: RampUp | None = None,
    ramp_start: float | None = None,
    ramp_end: float | None = None,
) -> list[float]:
    """Intended send times in seconds from the start, as vLLM schedules them."""
    if ramp_up is not None:
        if ramp_start is None or ramp_end is None:
            raise ValueError("a ramp-up needs ramp_up_start_rps and ramp_up_end_rps")
        progress = np.arange(count) / max(count - 1, 1)
        if ramp_up == "linear":
            rates = ramp_start + (ramp_end - ramp_start) * progress
        else:
            rates = ramp_start * (ramp_end / ramp_start) ** progress
    else:
        if math.isinf(rate):
            return [0.0] * count
        rates = np.full(count, rate)
    if math.isinf(burstiness):
        gaps = 1.0 / rates
    else:
        # One draw per request from a generator seeded like vLLM's global numpy one.
        generator = np.random.RandomState(seed)
        gaps = np.array(
            [generator.gamma(shape=burstiness, scale=1.0 / (r * burstiness)) for r in rates]
        )
    offsets = np.cumsum(gaps)
    # vLLM rescales a fixed rate so the last request goes at count / rate: the mean is exact.
    if ramp_up is None and count and offsets[-1] != 0:
        offsets = offsets * (count / rate) / offsets[-1]
    result: list[float] = offsets.tolist()
    return result


def load_offsets(settings: LoadSettings, count: int) -> list[float]:
    """`count` requests' send times on the schedule `settings` asks for (`arrival_offsets`)."""
    return arrival_offsets(
        count,
        settings.request_rate,
        settings.burstiness,
        settings.seed,
        settings.ramp_up_strategy,
        settings.ramp_up_start_rps,
        settings.ramp_up_end_rps,
    )
