"""The engine model fitted to one host's own runs: `profllm calibrate` (and the per-source check
on published rows, `benchmarks/perf/sim_calibration.py --per-source`).

Each run is an `Observation`: its workload, server settings and the figures vLLM measured.
The fit replays every observation on the virtual clock (`virtual.simulate`) with candidate
overheads and lowers the squared log error on output throughput, median TTFT, TPOT and ITL
(`scipy.optimize.least_squares` in log space, forward differences a few per cent wide, as the
simulator's figures move in steps). A faint pull towards the starting profile keeps a figure
the runs say nothing of where it was; `Fit.pinned` says which ones the runs did pin.

Before fitting, `problems` says why the runs cannot tell the parameters apart (too few
configurations, one load, one prompt length) and which runs would help. After, `leave_one_out`
predicts each configuration by a fit on all the others.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.hardware import DeviceProfile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.virtual import Outcome, Request, ServerSettings, simulate

# The figures fitted, each with the bounds it is searched within: the matmul rate's and the
# bandwidth's achieved shares, the host's cost per step and per running sequence, the API
# server's CPU per streamed token and its latency before a request reaches the scheduler.
BOUNDS: dict[str, tuple[float, float]] = {
    "compute_efficiency": (0.05, 1.5),
    "bandwidth_efficiency": (0.1, 1.0),
    "step_ms": (0.05, 50.0),
    "seq_us": (0.5, 500.0),
    "frontend_token_us": (0.5, 1000.0),
    "request_ms": (0.5, 5000.0),
    # Not fitted by default: how sharply a GEMM turns from bandwidth- to compute-bound.
    "roofline_sharpness": (1.0, 8.0),
}
PARAMETERS = tuple(name for name in BOUNDS if name != "roofline_sharpness")
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")
# Where the simulated engine reports no figure, or a source none: compared where both have one.
THROUGHPUT_METRICS = ("output_throughput", "total_token_throughput")
MIN_CONFIGURATIONS = 4  # fewer cannot pin six figures and leave one out
_STEPS = (0.05, 0.01)  # forward-difference steps in log space: 5 %, then 1 %
_PRIOR = 0.003  # weight of the pull towards the starting profile, per log unit
# A parameter whose column of the Jacobian (summed over runs) moves the log error less than
# this per log unit is said to be left where the runs do not pin it.
_PINNED = 0.05

Params = dict[str, float]


@dataclass(frozen=True)
class Observation:
    """One measured run, as the virtual clock replays it."""

    label: str  # a run id, or a published row's number
    configuration: str  # runs that share it are left out together
    model: str
    requests: tuple[Request, ...]
    measured: dict[str, float]  # of METRICS (or total_token_throughput), as measured
    tensor_parallel_size: int = 1
    settings: ServerSettings = field(default_factory=ServerSettings)
    request_rate: float = math.inf
    max_concurrency: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    kv_cache_dtype: str = "auto"
    api_server_count: int = 1
    throughput_scale: float = 1.0  # data-parallel replicas behind the load: one is simulated
    serial_output_processing: bool = False  # vLLM before 0.6.0
    # The client's own send times, from the run's requests file (None: vLLM's schedule for
    # request_rate, burstiness and seed): a short run's duration is its arrivals' as much as
    # the engine's.
    arrivals: tuple[float, ...] | None = None

    @property
    def load(self) -> str:
        """How hard the run pushed: its concurrency cap, or its rate (and count when all at
        once): runs of one load cannot tell a cost per sequence from a cost per step."""
        if self.max_concurrency:
            return f"concurrency {self.max_concurrency}"
        if math.isinf(self.request_rate):
            return f"{len(self.requests)} at once"
        return f"rate {self.request_rate:g}/s"

    @property
    def mean_input(self) -> float:
        return statistics.fmean(r.prompt_len for r in self.requests) if self.requests else 0.0


def replay(observation: Observation, profile: DeviceProfile) -> Outcome:
    """The observation's run replayed on `profile` by the engine model."""
    engine = EngineModel(
        resolve_model(observation.model),
        profile,
        observation.tensor_parallel_size,
        api_server_count=observation.api_server_count,
        kv_cache_dtype=observation.kv_cache_dtype,
        serial_output_processing=observation.serial_output_processing,
    )
    return simulate(
        engine,
        list(observation.requests),
        observation.settings,
        request_rate=observation.request_rate,
        max_concurrency=observation.max_concurrency,
        burstiness=observation.burstiness,
        seed=observation.seed,
        arrivals=observation.arrivals,
    )


def predict(observation: Observation, profile: DeviceProfile) -> dict[str, float]:
    """The figures the engine model gives the observation's run on `profile`."""
    summary = replay(observation, profile).summary()
    figures = {name: float(summary[name]) for name in (*METRICS, "total_token_throughput")}
    for name in THROUGHPUT_METRICS:
        figures[name] *= observation.throughput_scale
    return figures


def with_params(profile: DeviceProfile, params: Params) -> DeviceProfile:
    return profile.with_overheads(**params)


def start_params(profile: DeviceProfile) -> Params:
    return {name: float(getattr(profile.overheads, name)) for name in BOUNDS}


def errors(observation: Observation, predicted: dict[str, float]) -> dict[str, float]:
    """Relative errors (predicted / measured - 1) of every figure both have."""
    out: dict[str, float] = {}
    for name, value in observation.measured.items():
        got = predicted.get(name)
        if got is None or not value or not math.isfinite(got) or not math.isfinite(value):
            continue
        out[name] = got / value - 1
    return out


@dataclass(frozen=True)
class Fit:
    params: Params
    start: Params
    # The parameters the runs pin (the others stay near where they started).
    pinned: tuple[str, ...]
    evaluations: int

    def profile(self, base: DeviceProfile) -> DeviceProfile:
        return with_params(base, self.params)


def fit(
    observations: Sequence[Observation],
    base: DeviceProfile,
    start: Params | None = None,
    free: Sequence[str] = PARAMETERS,
    max_evaluations: int = 400,
    steps: Sequence[float] = _STEPS,
    tolerance: float = 1e-10,
) -> Fit:
    """The overheads of `base` that bring its figures closest to the observations' (squared
    log errors, every figure alike), `free` ones moving, the rest as in `start`."""
    # Deferred: scipy (about 0.3 s) only where a fit runs.
    import numpy as np
    from scipy.optimize import least_squares

    origin = {**start_params(base), **(start or {})}
    free = tuple(free)
    lows = np.log([BOUNDS[name][0] for name in free])
    highs = np.log([BOUNDS[name][1] for name in free])
    x0 = np.clip(np.log([max(origin[name], BOUNDS[name][0]) for name in free]), lows, highs)
    prior = x0.copy()
    cache: dict[bytes, np.ndarray] = {}

    def params_at(x: np.ndarray) -> Params:
        return {**origin, **{name: float(math.exp(v)) for name, v in zip(free, x, strict=True)}}

    def residuals(x: np.ndarray) -> np.ndarray:
        key = x.tobytes()
        if key not in cache:
            profile = with_params(base, params_at(x))
            values: list[float] = []
            for observation in observations:
                predicted = predict(observation, profile)
                for name, value in sorted(observation.measured.items()):
                    got = predicted.get(name, math.nan)
                    ok = value > 0 and got > 0 and math.isfinite(got)
                    values.append(math.log(got / value) if ok else 1.0)
            values += list(_PRIOR * (x - prior))
            cache[key] = np.array(values)
        return cache[key]

    def jacobian(x: np.ndarray, step: float = _STEPS[-1]) -> np.ndarray:
        here = residuals(x)
        columns = []
        for index in range(len(x)):
            signed = step if x[index] + step <= highs[index] else -step
            moved = x.copy()
            moved[index] += signed
            columns.append((residuals(moved) - here) / signed)
        return np.stack(columns, axis=1)

    # Coarse differences first, across the steps the simulator's figures move in, then fine
    # ones from where they ended (a fresh trust region: the first stops where its steps do).
    x = x0
    for step in steps:
        x = least_squares(
            residuals,
            x,
            jac=lambda at, step=step: jacobian(at, step),
            bounds=(lows, highs),
            max_nfev=max_evaluations // (len(free) + 1) // len(steps) + 1,
            ftol=tolerance,
            xtol=tolerance,
        ).x
    final = jacobian(x)[: -len(free)]  # the runs' rows, not the prior's
    strength = np.sqrt((final**2).sum(axis=0))
    pinned = tuple(name for name, s in zip(free, strength, strict=True) if s >= _PINNED)
    return Fit(params_at(x), origin, pinned, len(cache))


@dataclass(frozen=True)
class HeldOut:
    observation: Observation
    predicted: dict[str, float]
    errors: dict[str, float]
    params: Params


def leave_one_out(
    observations: Sequence[Observation],
    base: DeviceProfile,
    start: Params | None = None,
    free: Sequence[str] = PARAMETERS,
    progress: Callable[[str], None] | None = None,
    tolerance: float = 1e-10,
    max_evaluations: int = 400,
) -> list[HeldOut]:
    """Each configuration's runs predicted by a fit on all the other configurations'. From
    `start` (the fit on every run, say), which is near: fine steps alone."""
    held: list[HeldOut] = []
    for configuration in dict.fromkeys(o.configuration for o in observations):
        rest = [o for o in observations if o.configuration != configuration]
        steps = _STEPS[-1:] if start else _STEPS
        fitted = fit(rest, base, start, free, max_evaluations, steps=steps, tolerance=tolerance)
        profile = fitted.profile(base)
        for observation in (o for o in observations if o.configuration == configuration):
            predicted = predict(observation, profile)
            held.append(
                HeldOut(observation, predicted, errors(observation, predicted), fitted.params)
            )
        if progress is not None:
            progress(configuration)
    return held


def problems(observations: Sequence[Observation]) -> list[str]:
    """Why these runs cannot be fitted, each with the runs that would help (none: they can)."""
    configurations = {o.configuration for o in observations}
    found: list[str] = []
    if len(configurations) < MIN_CONFIGURATIONS:
        found.append(
            f"{len(configurations)} distinct configuration(s), at least {MIN_CONFIGURATIONS} "
            "needed to fit and leave one out: add runs at other concurrencies and prompt lengths"
        )
        return found
    loads = {o.load for o in observations}
    if len(loads) < 2:
        (load,) = loads
        found.append(
            f"every run at one load ({load}): the cost per sequence cannot be told from the "
            "cost per step; add runs at a concurrency of 1 and at 16 or more"
        )
    lengths = sorted(o.mean_input for o in observations)
    if lengths and lengths[-1] < 1.5 * max(lengths[0], 1):
        found.append(
            f"every prompt about {lengths[0]:.0f} tokens long: the matmul rate cannot be told "
            "from the API server's latency; add runs with prompts 4 times as long"
        )
    if not any(_has_latency(o) for o in observations):
        found.append("no run has a median TPOT or ITL: add runs that measure latency")
    return found


def _has_latency(observation: Observation) -> bool:
    return any(name in observation.measured for name in ("median_tpot_ms", "median_itl_ms"))


def summary_errors(held: Sequence[HeldOut], names: Sequence[str]) -> list[float]:
    """The absolute errors of the named figures (the first of `names` each run has)."""
    out = []
    for item in held:
        for name in names:
            if name in item.errors:
                out.append(abs(item.errors[name]))
                break
    return out
