"""The stopping rule of a workload's `until:` (plan/suite/until.py): the interval of a latency
statistic over the samples so far, whether it is narrow enough, and how many requests the next
round sends. Pure: the rounds themselves are load/rounds.py's.

The interval is the regression gate's bootstrap (load/bootstrap.py) over the pooled
per-request samples, each request resampled alone. A percentile's interval counts only once
`TAIL_SAMPLES` samples lie beyond it (a p99 from 2,000 requests), as a capacity probe's does
(load/capacity/statistics.py): over fewer, its bootstrap has too few distinct tail values to
show how wide it really is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from pytest_profllm.load.bootstrap import FloatArray, percentile_interval, statistic_of
from pytest_profllm.load.capacity.statistics import TAIL_SAMPLES
from pytest_profllm.plan.regression import DEFAULT_RESAMPLES
from pytest_profllm.plan.suite import Until

StoppedBy = Literal["interval", "cap"]


@dataclass(frozen=True)
class Reading:
    """The statistic over the samples so far and its interval (None: not yet one to trust)."""

    value: float | None
    low: float | None
    high: float | None
    samples: int

    @property
    def relative_half_width(self) -> float | None:
        """Half the interval's width over the estimate; None without an interval."""
        if self.value is None or self.low is None or self.high is None or self.value == 0:
            return None
        return (self.high - self.low) / 2 / abs(self.value)


def tail_fraction(until: Until) -> float:
    """The fraction of samples beyond the statistic (a mean's or median's: half)."""
    if until.statistic in ("mean", "median"):
        return 0.5
    return 1 - float(until.statistic) / 100


def samples_needed(until: Until) -> int:
    """The fewest samples whose interval counts: `TAIL_SAMPLES` beyond the statistic."""
    # Rounded first: 20 / (1 - 0.9) is 200.00000000000003 in floating point.
    return max(2, math.ceil(round(TAIL_SAMPLES / tail_fraction(until), 6)))


def read(until: Until, samples: FloatArray, seed: int = 0) -> Reading:
    """The statistic of `samples` (ms) and its bootstrap interval at `until.confidence`;
    no interval while there are fewer than `samples_needed`."""
    statistic = statistic_of(until.statistic)
    value = float(statistic(samples)) if samples.size else None
    if samples.size < samples_needed(until):
        return Reading(value, None, None, int(samples.size))
    if np.ptp(samples) == 0:  # every sample alike: no spread, the interval is the value
        return Reading(value, value, value, int(samples.size))
    interval = percentile_interval(
        (samples,), statistic, until.confidence, DEFAULT_RESAMPLES, seed
    )
    low, high = interval if interval is not None else (None, None)
    return Reading(value, low, high, int(samples.size))


def narrow_enough(until: Until, reading: Reading) -> bool:
    width = reading.relative_half_width
    return width is not None and width <= until.half_width


def next_round(until: Until, num_prompts: int, sent: int) -> int:
    """How many requests the next round sends after `sent`: a round's worth, or what is left
    under the cap; 0 at the cap."""
    return max(0, min(until.round_size(num_prompts), until.max_prompts - sent))


@dataclass(frozen=True)
class Stop:
    """Why a load in rounds ended, and where: the record's `until` block."""

    metric: str
    half_width: float  # asked, relative
    confidence: float
    max_prompts: int
    stopped_by: StoppedBy
    value: float | None
    ci_low: float | None
    ci_high: float | None
    relative_half_width: float | None
    rounds: int
    requests: int  # sent in all rounds, failed ones included
    samples: int  # the statistic's samples (successful requests; ITL: gaps)

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def stop(
    until: Until, reading: Reading, stopped_by: StoppedBy, rounds: int, requests: int
) -> Stop:
    return Stop(
        until.metric, until.half_width, until.confidence, until.max_prompts, stopped_by,
        reading.value, reading.low, reading.high, reading.relative_half_width, rounds, requests,
        reading.samples,
    )
