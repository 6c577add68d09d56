"""The bootstrap that intervals of per-request statistics come from: scipy.stats.bootstrap's
percentile interval over one sample or several (each resampled apart), vectorised in batches
that bound memory. The regression gate's change of a metric (gates/regression.py) and a
case's stopping rule (load/until.py) both take their intervals from here."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
Statistic = Callable[..., Any]

# Resampled values held at once (resamples x samples): bounds memory on long ITL samples.
_BATCH_ELEMENTS = 4_000_000


def statistic_of(name: str) -> Statistic:
    """A statistic by name (mean, median, std, or a percentile as text: "99") along the last
    axis, vectorised as scipy.stats.bootstrap calls it."""
    if name == "mean":
        return lambda x, axis=-1: np.mean(x, axis=axis)
    if name == "median":
        return lambda x, axis=-1: np.median(x, axis=axis)
    if name == "std":
        return lambda x, axis=-1: np.std(x, axis=axis)
    percentile = float(name)
    return lambda x, axis=-1: np.percentile(x, percentile, axis=axis)


def percentile_interval(
    samples: tuple[FloatArray, ...],
    statistic: Statistic,
    confidence: float,
    resamples: int,
    seed: int,
) -> tuple[float, float] | None:
    """The bootstrap percentile interval of `statistic(*samples)`, each sample resampled apart
    (independent requests); None where a sample has fewer than two values or the interval is
    not finite."""
    # Deferred: scipy.stats takes about 0.9 s to import; only a gated or stopping case needs it.
    from scipy import stats

    if any(sample.size < 2 for sample in samples):
        return None
    batch = max(1, _BATCH_ELEMENTS // max(sample.size for sample in samples))
    with warnings.catch_warnings():
        # Few distinct values (two repeats) make a lumpy bootstrap distribution: that is what
        # the percentile interval then honestly shows.
        warnings.simplefilter("ignore")
        result = stats.bootstrap(
            samples,
            statistic,
            paired=False,
            vectorized=True,
            axis=-1,
            n_resamples=resamples,
            batch=batch,
            confidence_level=confidence,
            # BCa needs a jackknife over every sample: quadratic on thousands of ITL samples.
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    low, high = result.confidence_interval
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    return float(low), float(high)
