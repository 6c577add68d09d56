"""Records of a nightly suite over many sessions, measured on the simulator's virtual clock.

Each distinct case (model, device, max_num_seqs, tensor_parallel_size, request rate or
concurrency) runs once through the simulated engine on a virtual clock
(`pytest_profllm/sim/virtual.py`), 200 prompts of 1024 +- 50 % in and 256 +- 50 % out, and
its figures come from the per-request samples with vLLM's definitions
(`pytest_profllm/load/metrics.py`). A session is every case once, each with a small
multiplicative noise on its whole sample set (order statistics stay ordered). A few sessions
run one configuration slowed by 15 to 30 % (the engine model's `slowdown`), and the gate judges
each session against the one before, as `--profllm-baseline` would: a latency's bootstrap
interval (`gates/regression.py`), computed once per case on the simulated samples and scaled by
the two sessions' noise (a percentile interval of stat(a x) / stat(b y) is a / b times that of
stat(x) / stat(y), the resamples being the same). Thresholds, verdicts and statuses follow the
plugin's rules; `check` counts the records that break them.

The runs of the last `DETAILED_SESSIONS` sessions, and every run of the cases with the slowest
TTFT, carry what a real run carries for its page: telemetry over time (`series`) and
per-request samples (`.requests.jsonl.gz`, without inter-token gaps); other runs leave them
out, as they would multiply a million-run ingest.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import itertools
import math
import random
import re
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 200, 1024, 256, 0.5
THRESHOLDS = {"median_ttft_ms": {"min": None, "max": 2000.0},
              "median_tpot_ms": {"min": None, "max": 100.0}}
GATED = {"median_tpot_ms": 0.10, "p99_e2el_ms": 0.10}  # the regression: block, per request
NOISE = 0.02  # a run's factor on its whole sample set: lognormal, this sigma
SLOWED_SHARE = 1 / 40  # of sessions, one configuration slowed (and always the last session)
DETAILED_SESSIONS = 7
SERIES_POINTS = 60
LAST_DAY = datetime.datetime(2026, 11, 26, 1, 0, tzinfo=datetime.UTC)
# GPUs as NVML names them, with what telemetry of them looks like: memory (MiB), board power
# idle and at full load (W), the top SM clock (MHz).
GPUS = {
    "NVIDIA H100 80GB HBM3": (81_559, 90.0, 700.0, 1980.0),
    "NVIDIA A100-SXM4-80GB": (81_920, 60.0, 400.0, 1410.0),
}
_LATENCY_KEY = re.compile(r"^(mean|median|std|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
_THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput")


@dataclass(frozen=True)
class Axes:
    models: tuple[str, ...] = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B",
                               "Qwen/Qwen3-32B")
    devices: tuple[str, ...] = tuple(GPUS)
    max_num_seqs: tuple[int, ...] = (64, 128, 256, 512)
    tensor_parallel_sizes: tuple[int, ...] = (1, 2)
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
    concurrencies: tuple[int, ...] = (8, 32, 128)

    def configurations(self) -> list[tuple[str, str, int, int]]:
        return list(itertools.product(self.models, self.devices, self.max_num_seqs,
                                      self.tensor_parallel_sizes))

    def loads(self) -> list[tuple[str, float]]:
        return ([("rate", rate) for rate in self.rates]
                + [("concurrency", float(c)) for c in self.concurrencies])


@dataclass(frozen=True)
class Shape:
    """One case as the simulator runs it; `slowdown` > 1: the configuration slowed."""

    model: str
    device: str
    max_num_seqs: int
    tensor_parallel_size: int
    kind: str  # rate or concurrency
    load: float
    slowdown: float = 1.0

    @property
    def label(self) -> str:
        gpu = "h100" if "H100" in self.device else "a100"
        return (f"{self.model.split('/')[-1].lower()}-{gpu}-seqs{self.max_num_seqs}"
                f"-tp{self.tensor_parallel_size}")

    @property
    def workload(self) -> str:
        if self.kind == "rate":
            return "rate-inf" if math.isinf(self.load) else f"rate-{self.load:g}"
        return f"concurrency-{self.load:g}"


@dataclass
class Measured:
    """A shape's run: per-request samples (seconds), its vLLM figures, its telemetry."""

    ttft: np.ndarray[Any, Any]
    tpot: np.ndarray[Any, Any]
    e2el: np.ndarray[Any, Any]
    output_lens: list[int]
    input_lens: list[int]
    itl: np.ndarray[Any, Any]
    results: dict[str, Any]
    series: list[dict[str, float]]
    busy: float  # the share of the run the engine was stepping
    mean_kv: float
    peak_kv: float
    preemptions: int
    prefix_queries: int
    prefix_hits: int


def measure(shape: Shape) -> Measured:
    """Run the shape on the virtual clock and compute vLLM bench serve's figures."""
    from pytest_profllm.load.metrics import RequestOutcome, compute
    from pytest_profllm.sim.batching import Scheduler, Sequence
    from pytest_profllm.sim.cost import EngineModel
    from pytest_profllm.sim.hardware import device_profile
    from pytest_profllm.sim.models import resolve_model
    from pytest_profllm.sim.virtual import Request, ServerSettings, simulate

    seed = int(hashlib.sha256(f"{shape.model}{shape.workload}".encode()).hexdigest()[:8], 16)
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(int(mean * (1 - RANGE_RATIO)), int(mean * (1 + RANGE_RATIO)))

    requests = [Request(length(INPUT_LEN), length(OUTPUT_LEN)) for _ in range(NUM_PROMPTS)]
    engine = EngineModel(resolve_model(shape.model), device_profile(shape.device),
                         shape.tensor_parallel_size, slowdown=shape.slowdown)
    steps: list[tuple[float, float, int, int, float, int, int]] = []
    input_lens: list[int] = []
    output_lens: list[int] = []

    def observe(now: float, seconds: float, scheduler: Scheduler,
                finished: list[Sequence]) -> None:
        input_lens.extend(sequence.prompt_len for sequence in finished)
        output_lens.extend(sequence.generated for sequence in finished)
        steps.append((now, seconds, len(scheduler.running), len(scheduler.waiting),
                      scheduler.kv_cache_usage, scheduler.generation_tokens, len(output_lens)))

    rate = shape.load if shape.kind == "rate" else math.inf
    concurrency = int(shape.load) if shape.kind == "concurrency" else None
    outcome = simulate(engine, requests, ServerSettings(max_num_seqs=shape.max_num_seqs),
                       request_rate=rate, max_concurrency=concurrency, seed=seed,
                       observe=observe)
    outcomes = [RequestOutcome(prompt_len=p, success=True, output_tokens=n, ttft=t, latency=e)
                for p, n, t, e in zip(input_lens, output_lens, outcome.ttft, outcome.e2el,
                                      strict=True)]
    outcomes[0].itl = outcome.itl  # compute pools every request's gaps: one list will do
    results = compute(outcomes, outcome.duration)
    series, busy = _series(steps, outcome.duration)
    kv = [point["kv_cache_usage"] for point in series]
    queries = sum(input_lens)
    return Measured(
        ttft=np.asarray(outcome.ttft), tpot=np.asarray(outcome.tpot),
        e2el=np.asarray(outcome.e2el), output_lens=output_lens, input_lens=input_lens,
        itl=np.asarray(outcome.itl), results=results,
        series=series, busy=busy, mean_kv=float(np.mean(kv)) if kv else 0.0,
        peak_kv=outcome.peak_kv_cache_usage, preemptions=outcome.preemptions,
        prefix_queries=queries, prefix_hits=round(queries * outcome.prefix_cache_hit_rate),
    )


def _series(steps: list[tuple[float, float, int, int, float, int, int]],
            duration: float) -> tuple[list[dict[str, float]], float]:
    """The steps as a telemetry sampler would see them: SERIES_POINTS points, the gauges
    at each point, the counters' rates and the stepping share over each interval."""
    width = duration / SERIES_POINTS if duration > 0 else 1.0
    points: list[dict[str, float]] = []
    index, tokens, finished = 0, 0, 0
    state = (0, 0, 0.0)
    total_busy = 0.0
    for point in range(1, SERIES_POINTS + 1):
        end = point * width
        busy = 0.0
        new_tokens, new_finished = tokens, finished
        while index < len(steps) and steps[index][0] <= end + 1e-12:
            _, seconds, running, waiting, kv, new_tokens, new_finished = steps[index]
            busy += seconds
            state = (running, waiting, kv)
            index += 1
        total_busy += busy
        points.append({
            "t_s": end, "running": float(state[0]), "waiting": float(state[1]),
            "kv_cache_usage": state[2],
            "request_throughput": (new_finished - finished) / width,
            "output_throughput": (new_tokens - tokens) / width,
            "busy": min(1.0, busy / width),
        })
        tokens, finished = new_tokens, new_finished
    return points, min(1.0, total_busy / duration) if duration > 0 else 0.0


def ratio_interval(metric_name: str, new: Measured, base: Measured) -> tuple[float, float]:
    """The gate's percentile bootstrap interval of stat(new) / stat(base) (not less one)."""
    from pytest_profllm.gates.regression import GateSettings, change_interval, statistic_of
    from pytest_profllm.plan.regression import gated_metric

    metric = gated_metric(metric_name, GATED[metric_name])
    assert metric.latency is not None
    samples = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el"}[metric.latency]
    interval = change_interval(statistic_of(metric), getattr(new, samples) * 1000,
                               getattr(base, samples) * 1000, GateSettings())
    assert interval is not None
    return 1 + interval[0], 1 + interval[1]


def _measure_all(shapes: list[Shape], processes: int) -> dict[Shape, Measured]:
    if processes <= 1:
        return {shape: measure(shape) for shape in shapes}
    with ProcessPoolExecutor(processes) as pool:
        return dict(zip(shapes, pool.map(measure, shapes, chunksize=4), strict=True))


@dataclass
class Plan:
    """Which sessions slow which configuration, and by how much."""

    sessions: int
    slowed: dict[int, tuple[int, float]] = field(default_factory=dict)  # session -> (config, x)


def plan(sessions: int, configurations: int, seed: int = 0) -> Plan:
    rng = random.Random(seed)
    result = Plan(sessions)
    for session in range(1, sessions):
        if rng.random() < SLOWED_SHARE or session == sessions - 1:
            result.slowed[session] = (rng.randrange(configurations), rng.uniform(1.15, 1.30))
    return result


def generate(folder: Path, count: int, axes: Axes = Axes(), processes: int = 2,
             seed: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """Write `count` records (and the detailed runs' request files) into `folder`; returns
    the counts of statuses and gate verdicts written, and `check`'s violations."""
    import orjson

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    configurations = axes.configurations()
    loads = axes.loads()
    per_session = len(configurations) * len(loads)
    sessions = -(-count // per_session)
    schedule = plan(sessions, len(configurations), seed)
    shapes = [Shape(*config, kind, load) for config in configurations for kind, load in loads]
    slowed_shapes = {replace(shapes[c * len(loads) + i], slowdown=round(x, 3))
                     for c, x in schedule.slowed.values() for i in range(len(loads))}
    measured = _measure_all(shapes + sorted(slowed_shapes, key=repr), processes)
    counts: dict[str, int] = {}

    def written() -> Iterator[dict[str, Any]]:
        for record, requests in records(count, axes, schedule, measured, seed):
            (folder / f"{record['run_id']}.json").write_bytes(
                orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY))
            if requests is not None:
                lines = b"".join(orjson.dumps(row) + b"\n" for row in requests)
                (folder / f"{record['run_id']}.requests.jsonl.gz").write_bytes(
                    gzip.compress(lines, mtime=0))
            counts[record["status"]] = counts.get(record["status"], 0) + 1
            for verdict in record["regression"]:
                counts[verdict["decision"]] = counts.get(verdict["decision"], 0) + 1
            yield record

    violations = check(written())
    return counts, violations


@dataclass
class _Last:
    """A case's latest valid run: what the next session's gate compares with."""

    session_id: str
    shape: Shape
    factor: float


def records(count: int, axes: Axes, schedule: Plan, measured: dict[Shape, Measured],
            seed: int = 0) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]] | None]]:
    """The records in session order, each with its request rows where it carries them."""
    from pytest_profllm.engine.registry import bundled
    from pytest_profllm.plan.suite import BenchmarkConfig

    registry = bundled()
    common = _Common(registry.defaults(), registry.describe(),
                     BenchmarkConfig().model_dump(mode="json"))
    rng = random.Random(seed + 1)
    configurations, loads = axes.configurations(), axes.loads()
    per_session = len(configurations) * len(loads)
    skip = schedule.sessions * per_session - count  # the first session is the one cut short
    last: dict[int, _Last] = {}
    ratios: dict[tuple[Shape, Shape, str], tuple[float, float]] = {}
    slowest = slowest_ttft(measured)
    for session in range(schedule.sessions):
        day = LAST_DAY - datetime.timedelta(days=schedule.sessions - 1 - session)
        session_id = day.strftime("%Y%m%dT%H%M%S") + "-" + hashlib.sha256(
            f"{seed}-{session}".encode()).hexdigest()[:6]
        detailed = session >= schedule.sessions - DETAILED_SESSIONS
        slowed = schedule.slowed.get(session)
        clocks = [day.timestamp()] * 4  # four xdist workers, one server at a time each
        host_factor = math.exp(rng.gauss(0, NOISE / 2))
        for config_index, config in enumerate(configurations):
            worker = config_index % 4
            server_started = clocks[worker]
            server_ready = server_started + rng.uniform(45, 120)
            now = server_ready
            planned = []
            for load_index, (kind, load) in enumerate(loads):
                case = config_index * len(loads) + load_index
                shape = Shape(*config, kind, load)
                if slowed is not None and slowed[0] == config_index:
                    shape = replace(shape, slowdown=round(slowed[1], 3))
                factor = host_factor * math.exp(rng.gauss(0, NOISE))
                duration = measured[shape].results["duration"] * factor + rng.uniform(1, 3)
                planned.append((case, shape, factor, now, duration))
                now += duration
            clocks[worker] = now + rng.uniform(5, 15)
            for case, shape, factor, started, duration in planned:
                if session * per_session + case < skip:
                    continue
                run = _Run(session_id, worker, shape, factor, measured[shape], started,
                           duration, (server_started, server_ready, clocks[worker]),
                           detailed or shape in slowest)
                record, requests = _record(run, common, rng, last.get(case), ratios,
                                           measured)
                if record["validity"] == "valid":
                    last[case] = _Last(session_id, shape, factor)
                yield record, requests


def slowest_ttft(measured: dict[Shape, Measured], within: float = 0.8) -> set[Shape]:
    """The cases (slowed or not) whose median or p99 TTFT is within `within` of the highest:
    sorted by TTFT, the landing table opens their runs first, so every one of their runs
    carries what a run page draws."""
    slowest = set()
    for metric in ("median_ttft_ms", "p99_ttft_ms"):
        top = max(m.results[metric] for m in measured.values())
        slowest |= {shape for shape, m in measured.items() if m.results[metric] >= within * top}
    return slowest


@dataclass(frozen=True)
class _Common:
    server: dict[str, Any]
    engine_args: dict[str, Any]
    benchmark: dict[str, Any]


@dataclass(frozen=True)
class _Run:
    session_id: str
    worker: int
    shape: Shape
    factor: float
    measured: Measured
    started: float
    duration: float
    server_times: tuple[float, float, float]
    detailed: bool


def scaled(results: dict[str, Any], factor: float) -> dict[str, Any]:
    """A run's figures with its whole sample set `factor` times slower."""
    out = dict(results)
    for name, value in results.items():
        if value is None:
            continue
        if _LATENCY_KEY.match(name) or name == "duration":
            out[name] = value * factor
        elif name in _THROUGHPUTS:
            out[name] = value / factor
    return out


def _record(run: _Run, common: _Common, rng: random.Random, baseline: _Last | None,
            ratios: dict[tuple[Shape, Shape, str], tuple[float, float]],
            measured: dict[Shape, Measured]) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    from pytest_profllm.gates.regression import classify
    from pytest_profllm.gates.worker import regression_message
    from pytest_profllm.load.metrics import RequestOutcome, compute
    from pytest_profllm.plan.regression import gated_metric
    from pytest_profllm.results.record import RegressionResult, ThresholdResult
    from pytest_profllm.run.outcome import describe_missed

    shape, m = run.shape, run.measured
    nodeid = f"benchmarks/bench_nightly.yaml::{shape.label}::{shape.workload}"
    run_id = f"{run.session_id}-{hashlib.sha256(nodeid.encode()).hexdigest()[:10]}"
    draw = rng.random()
    status, message, reasons = "passed", None, []
    results = scaled(m.results, run.factor)
    lag = rng.uniform(0.05, 1.5)
    if draw < 0.001:  # the server died: nothing measured
        status, message = "error", ("server exited during the case (exit status -9): "
                                    "EngineCore died unexpectedly")
        results, reasons = {}, [message]
    elif draw < 0.003 and shape.kind == "rate" and not math.isinf(shape.load):
        lag = rng.uniform(15, 80)  # the host's other load held the client back
        reason = f"client fell behind: p99 schedule lag {lag:.3g} ms is over 10 ms"
        status, message, reasons = "invalid", f"invalid measurement: {reason}", [reason]
    elif draw < 0.005:  # a few requests timed out
        failed = rng.randint(1, 5)
        outcomes = [RequestOutcome(prompt_len=p, success=i >= failed, output_tokens=n,
                                   ttft=t * run.factor, latency=e * run.factor)
                    for i, (p, n, t, e) in enumerate(zip(m.input_lens, m.output_lens, m.ttft,
                                                         m.e2el, strict=True))]
        outcomes[-1].itl = list(m.itl * run.factor)
        results = compute(outcomes, m.results["duration"] * run.factor)
        status = "failed"
        message = (f"{failed} of {NUM_PROMPTS} requests failed ({failed} timed out; none "
                   "allowed: thresholds: {failed: {max: N}}); first errors: TimeoutError: no "
                   "end within 600 s")
        reasons = [f"{failed} of {NUM_PROMPTS} requests failed"]
    if results:
        rate = None if shape.kind == "concurrency" or math.isinf(shape.load) else shape.load
        results.update(
            mean_schedule_lag_ms=lag / 4, median_schedule_lag_ms=lag / 5,
            p99_schedule_lag_ms=lag, max_schedule_lag_ms=lag * 1.3,
            target_request_rate=rate,
            achieved_request_rate=None if rate is None else rate * rng.uniform(0.97, 1.03),
            client_cpu_percent=15 + 40 * m.busy * rng.uniform(0.8, 1.2),
        )
    verdicts = [] if not results else [
        ThresholdResult(metric=name, bound=bound, limit=limit, value=results.get(name),
                passed=results.get(name) is not None and (
                    results[name] <= limit if bound == "max" else results[name] >= limit))
        for name, bounds in THRESHOLDS.items() for bound, limit in bounds.items()
        if limit is not None
    ]
    valid = not reasons
    regression: list[RegressionResult] = []
    if valid:
        for name, tolerance in GATED.items():
            metric = gated_metric(name, tolerance)
            value = results[name]
            verdict = RegressionResult(metric=name, decision="no-baseline", tolerance=tolerance,
                                        higher_is_better=False, value=value, confidence=0.99,
                                        samples=len(m.e2el))
            if baseline is not None:
                key = (shape, baseline.shape, name)
                if key not in ratios:
                    ratios[key] = ratio_interval(name, m, measured[baseline.shape])
                low, high = ratios[key]
                scale = run.factor / baseline.factor
                base_value = scaled(measured[baseline.shape].results, baseline.factor)[name]
                verdict.baseline = base_value
                verdict.change = value / base_value - 1
                verdict.ci_low, verdict.ci_high = low * scale - 1, high * scale - 1
                verdict.decision = classify(metric, verdict.ci_low, verdict.ci_high)
                verdict.baseline_samples = len(measured[baseline.shape].e2el)
                verdict.baseline_session = baseline.session_id
            regression.append(verdict)
        problems = [describe_missed([v for v in verdicts if not v.passed])
                    if any(not v.passed for v in verdicts) else "",
                    regression_message(regression) or ""]
        if any(problems):
            status, message = "failed", "; ".join(p for p in problems if p)
    record = {
        "schema_version": 1, "run_id": run_id, "session_id": run.session_id,
        "suite": "nightly", "source": "benchmarks/bench_nightly.yaml",
        "case_id": f"bench_nightly.yaml::{shape.label}::{shape.workload}", "nodeid": nodeid,
        "repeat_index": 0,
        "timestamp": datetime.datetime.fromtimestamp(run.started, datetime.UTC).isoformat(),
        # The whole case: its server's start too, for the first case of a server.
        "duration": run.duration + (run.server_times[1] - run.server_times[0]
                                    if run.started == run.server_times[1] else 0.0),
        "status": status, "message": message,
        "engine": {"name": "vllm", "reason": "--profllm-engine vllm", "version": "0.33.0",
                   "distribution": "vllm", "device": "cuda", "python": "3.12.3"},
        "config": {
            "server": {**common.server, "model": shape.model,
                       "max_num_seqs": shape.max_num_seqs,
                       "tensor_parallel_size": shape.tensor_parallel_size},
            "benchmark": _benchmark(common.benchmark, shape),
            "engine_args": common.engine_args,
            "axes": ["server.model", "server.max_num_seqs", "server.tensor_parallel_size",
                     "benchmark.request_rate" if shape.kind == "rate"
                     else "benchmark.max_concurrency"],
        },
        "results": results,
        "system": _system(run, rng, bool(results)),
        "runtime": _runtime(run, rng),
        "thresholds": THRESHOLDS,
        "threshold_results": [v.model_dump() for v in verdicts],
        "regression": [v.model_dump() for v in regression],
        "validity": "valid" if valid else "invalid",
        "validity_reasons": reasons,
        "series": _scaled_series(m.series, run) if run.detailed and results else [],
    }
    requests = _requests(run) if run.detailed and results else None
    return record, requests


def _benchmark(defaults: dict[str, Any], shape: Shape) -> dict[str, Any]:
    benchmark = {**defaults, "num_prompts": NUM_PROMPTS, "random_input_len": INPUT_LEN,
                 "random_output_len": OUTPUT_LEN, "random_range_ratio": RANGE_RATIO}
    if shape.kind == "rate":
        benchmark["request_rate"] = "inf" if math.isinf(shape.load) else shape.load
    else:
        benchmark["max_concurrency"] = int(shape.load)
    return benchmark


def _system(run: _Run, rng: random.Random, measured: bool) -> dict[str, Any]:
    shape, m = run.shape, run.measured
    memory, idle_w, full_w, clock = GPUS[shape.device]
    tp = shape.tensor_parallel_size
    node = int(run.session_id[6:8]) % 7
    system: dict[str, Any] = {
        "host": f"gpu-node-{node}", "platform": "Linux-6.8.0-x86_64-with-glibc2.39",
        "python": "3.12.3", "cpu_count": 96, "device_kind": "gpu",
        "device_name": shape.device, "gpu_names": [shape.device] * tp,
        "gpu_uuids": [_uuid(node, run.worker * 2 + i) for i in range(tp)],
        "driver_version": "570.124.06", "vllm_version": "0.33.0",
    }
    if not measured:
        return system
    busy = m.busy
    peak_busy = max((p["busy"] for p in m.series), default=busy)
    used = memory * 0.9 + rng.uniform(200, 600)  # vLLM takes gpu_memory_utilization at start
    system.update(
        peak_gpu_memory_mib=round(used, 0), mean_gpu_memory_mib=round(used - 40, 0),
        mean_gpu_utilization=round(97 * busy, 1), peak_gpu_utilization=round(97 * peak_busy, 1)
        + 3,
        mean_gpu_power_w=round(tp * (idle_w + busy * (full_w - idle_w) * 0.85), 1),
        peak_gpu_power_w=round(tp * (idle_w + peak_busy * (full_w - idle_w)), 1),
        mean_gpu_sm_clock_mhz=round(clock * (0.55 + 0.4 * busy), 0),
        peak_gpu_sm_clock_mhz=clock,
        mean_gpu_temperature_c=round(34 + 30 * busy, 1),
        peak_gpu_temperature_c=round(36 + 34 * peak_busy, 1),
        mean_server_cpu_percent=round(100 + 45 * busy * tp, 1),
        peak_server_cpu_percent=round(110 + 60 * peak_busy * tp, 1),
        mean_server_rss_mib=round(5200 + 900 * tp + rng.uniform(-100, 100), 0),
        peak_server_rss_mib=round(5400 + 900 * tp + rng.uniform(-100, 100), 0),
        peak_server_processes=2 + tp,
        mean_client_cpu_percent=round(15 + 40 * busy, 1),
        peak_client_cpu_percent=round(25 + 60 * peak_busy, 1),
        peak_client_rss_mib=round(rng.uniform(180, 260), 0),
        mean_kv_cache_usage=round(m.mean_kv, 4), peak_kv_cache_usage=round(m.peak_kv, 4),
        server_num_preemptions=float(m.preemptions),
        server_prefix_cache_queries=float(m.prefix_queries),
        server_prefix_cache_hits=float(m.prefix_hits),
        server_prefix_cache_hit_rate=m.prefix_hits / m.prefix_queries
        if m.prefix_queries else None,
        telemetry_interval_s=0.5,
        telemetry_samples=max(1, int(m.results["duration"] * run.factor / 0.5)),
    )
    return system


def _uuid(node: int, index: int) -> str:
    digest = hashlib.sha256(f"{node}-{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _runtime(run: _Run, rng: random.Random) -> dict[str, Any]:
    tp = run.shape.tensor_parallel_size
    started, ready, stopped = run.server_times
    node = int(run.session_id[6:8]) % 7
    return {
        "worker": f"gw{run.worker}",
        "server_key": hashlib.sha256(run.shape.label.encode()).hexdigest()[:16],
        "gpus": [str(run.worker * 2 + i) for i in range(tp)],
        "gpu_uuids": [_uuid(node, run.worker * 2 + i) for i in range(tp)],
        "port": 24_000 + 16 * run.worker, "server_started_at": started,
        "server_ready_at": ready, "server_stopped_at": stopped,
        "lease_wait_s": 0.0, "attempts": 1,
        "prompt_seed": int(hashlib.sha256(run.shape.workload.encode()).hexdigest()[:8], 16),
        "prompt_seed_derived": True, "prefix_cache": "emptied",
        "server_log": f"{run.shape.label}.log",
    }


def _scaled_series(series: list[dict[str, float]], run: _Run) -> list[dict[str, float | None]]:
    memory, idle_w, full_w, _ = GPUS[run.shape.device]
    tp = run.shape.tensor_parallel_size
    return [{
        "t_s": round(p["t_s"] * run.factor, 3),
        "request_throughput": round(p["request_throughput"] / run.factor, 3),
        "output_throughput": round(p["output_throughput"] / run.factor, 1),
        "running": p["running"], "waiting": p["waiting"],
        "kv_cache_usage": round(p["kv_cache_usage"], 4),
        "gpu_utilization": round(97 * p["busy"], 1),
        "gpu_memory_mib": round(memory * 0.9, 0),
        "gpu_power_w": round(tp * (idle_w + p["busy"] * (full_w - idle_w) * 0.85), 1),
        "server_cpu_percent": round(100 + 45 * p["busy"] * tp, 1),
        "server_rss_mib": float(5200 + 900 * tp),
        "client_cpu_percent": round(15 + 40 * p["busy"], 1),
    } for p in series]


def _requests(run: _Run) -> list[dict[str, Any]]:
    """The run's request rows (run/outcome.py `request_row`'s keys that its samples use);
    inter-token gaps are left out (51,000 a run)."""
    m, f = run.measured, run.factor
    return [{"index": i, "success": True, "status": 200, "prompt_len": p, "output_tokens": n,
             "ttft_s": float(t) * f, "latency_s": float(e) * f, "itl_s": []}
            for i, (p, n, t, e) in enumerate(zip(m.input_lens, m.output_lens, m.ttft, m.e2el,
                                                 strict=True))]


def check(records_: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Violations of the record's rules, by rule (every count 0 for data a page can be judged
    on): ordered percentiles, statuses that agree with verdicts and validity, verdicts that
    agree with their figures."""
    from pytest_profllm.plan.metric_names import LATENCY_METRICS

    counts = {"percentiles out of order": 0, "passed but regressed": 0,
              "error or invalid with a regression decision": 0,
              "threshold result disagrees with its value": 0,
              "threshold result disagrees with the results": 0,
              "passed with a missed threshold": 0,
              "regression decision disagrees with its change": 0,
              "regressed but not failed": 0}
    for record in records_:
        results = record.get("results") or {}
        for metric in LATENCY_METRICS:
            chain = [results.get(f"{stat}_{metric}_ms") for stat in ("p50", "p90", "p95", "p99")]
            values = [v for v in chain if v is not None]
            if any(a > b * (1 + 1e-9) for a, b in itertools.pairwise(values)):
                counts["percentiles out of order"] += 1
        gate = [v["decision"] for v in record.get("regression") or []]
        if record["status"] == "passed" and "regressed" in gate:
            counts["passed but regressed"] += 1
        if "regressed" in gate and record["status"] != "failed":
            counts["regressed but not failed"] += 1
        if (record["status"] in ("error", "invalid") or record.get("validity") == "invalid") \
                and gate:
            counts["error or invalid with a regression decision"] += 1
        for verdict in record.get("threshold_results") or []:
            value, limit = verdict["value"], verdict["limit"]
            holds = value is not None and (value <= limit if verdict["bound"] == "max"
                                           else value >= limit)
            if holds != verdict["passed"]:
                counts["threshold result disagrees with its value"] += 1
            if value != results.get(verdict["metric"]):
                counts["threshold result disagrees with the results"] += 1
            if record["status"] == "passed" and not verdict["passed"]:
                counts["passed with a missed threshold"] += 1
        for verdict in record.get("regression") or []:
            counts["regression decision disagrees with its change"] += not _gate_agrees(verdict)
    return counts


def _gate_agrees(verdict: dict[str, Any]) -> bool:
    tolerance, low, high = verdict["tolerance"], verdict.get("ci_low"), verdict.get("ci_high")
    if verdict["decision"] == "no-baseline":
        return verdict.get("baseline") is None
    base, value, change = verdict["baseline"], verdict["value"], verdict["change"]
    if base is None or value is None or change is None or low is None or high is None:
        return False
    if not math.isclose(value / base - 1, change, rel_tol=1e-6, abs_tol=1e-9):
        return False
    if not low <= high:
        return False
    worse, better = (high < -tolerance, low > tolerance) if verdict["higher_is_better"] else (
        low > tolerance, high < -tolerance)
    expected = "regressed" if worse else "improved" if better else "unchanged"
    return bool(verdict["decision"] == expected)
