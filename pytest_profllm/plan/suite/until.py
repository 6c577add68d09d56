"""A serve workload's stopping rule (`until:`): send the load in rounds until a latency
statistic's bootstrap interval is as narrow as asked, or a cap on the requests is reached
(load/until.py reads it, load/rounds.py runs the rounds)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, field_validator

from pytest_profllm.limits import MAX_PROBE_REQUESTS
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.regression import latency_statistic

# What `until.metric` may name: a per-request latency statistic the record has.
UNTIL_METRICS = (
    f"mean_/median_/pNN_ of {', '.join(metric_names.LATENCY_METRICS)} in ms (e.g. p99_ttft_ms)"
)
DEFAULT_UNTIL_CONFIDENCE = 0.95


def fraction_of(value: object, not_a_number: str, out_of_range: str) -> float:
    """`value`, a fraction (0.05) or a percentage ('5%'), as a fraction strictly between 0 and
    1; else ValueError with `not_a_number` or `out_of_range`."""
    text = str(value).strip()
    try:
        number = float(text.removesuffix("%"))
    except ValueError:
        raise ValueError(not_a_number) from None
    fraction = number / 100 if text.endswith("%") else number
    if isinstance(value, bool) or not (0 < fraction < 1 and math.isfinite(fraction)):
        raise ValueError(out_of_range)
    return fraction


class Until(BaseModel):
    """Stop when `metric`'s interval at `confidence` is within +-`half_width` of its value
    (a fraction: 0.05 is +-5 %), else at `max_prompts` requests. The first round sends the
    workload's `num_prompts`, each further one `round_prompts` (default: `num_prompts`)."""

    model_config = ConfigDict(extra="forbid")

    metric: str
    half_width: float
    max_prompts: int
    confidence: float = DEFAULT_UNTIL_CONFIDENCE
    round_prompts: int | None = None

    @field_validator("metric")
    @classmethod
    def _metric(cls, value: str) -> str:
        parsed = latency_statistic(value)
        if parsed is None or parsed[1] == "std":
            raise ValueError(f"unknown metric; allowed: {UNTIL_METRICS}")
        statistic = parsed[1]
        if statistic not in ("mean", "median") and not 0 < float(statistic) < 100:
            raise ValueError(f"{value}: a percentile lies strictly between 0 and 100")
        return value

    @field_validator("half_width", mode="before")
    @classmethod
    def _half_width(cls, value: object) -> float:
        return fraction_of(value, "a relative half width like 0.05 or '5%'",
                           "a relative half width above 0 and below 1 (0.05 is +-5 %)")

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0.5 < value < 1
        ):
            raise ValueError("a confidence above 0.5 and below 1 (e.g. 0.95)")
        return float(value)

    @field_validator("max_prompts", "round_prompts", mode="before")
    @classmethod
    def _count(cls, value: object) -> object:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not (
            0 < value <= MAX_PROBE_REQUESTS
        ):
            raise ValueError(f"a whole number of requests from 1 to {MAX_PROBE_REQUESTS:,}")
        return value

    @property
    def latency(self) -> str:
        """ttft, tpot, itl or e2el: the samples the statistic is taken of."""
        parsed = latency_statistic(self.metric)
        assert parsed is not None  # checked on validation
        return parsed[0]

    @property
    def statistic(self) -> str:
        """mean, median, or a percentile as text ("99")."""
        parsed = latency_statistic(self.metric)
        assert parsed is not None
        return parsed[1]

    def round_size(self, num_prompts: int) -> int:
        return self.round_prompts or num_prompts


def until_problem(until: Until, num_prompts: int, latency_metrics: list[str]) -> str | None:
    """Why `until` cannot stop this workload, or None: the cap below the first round, or a
    statistic of samples the workload does not measure."""
    if until.max_prompts < num_prompts:
        return (
            f"until.max_prompts ({until.max_prompts:,}) is below one round: the first round "
            f"sends num_prompts ({num_prompts:,})"
        )
    if until.latency not in latency_metrics:
        return (
            f"until.metric {until.metric}: {until.latency} is not among the workload's "
            f"percentile_metrics ({', '.join(latency_metrics)})"
        )
    return None
