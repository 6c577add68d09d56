"""What a case cost the machine: NVML for the leased GPUs (hosts/nvml.py), psutil for the
server's process tree and the client, and the server's Prometheus `/metrics`, sampled in a
background thread while the load runs. The record's `system` block gets peaks and means; where
NVML is absent the GPU figures stay null, never invented.

Telemetry never costs a case its record: whatever fails in the sampler (a host out of file
descriptors, a /proc read, NVML) is logged in one line, the samples it could not take are
missing, and the record's `telemetry_problem` says so.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from pytest_profllm.hosts.nvml import EnergyCount, GpuReading, NvmlGpus
from pytest_profllm.hosts.processes import process_tree
from pytest_profllm.limits import METRICS_DEADLINE_S
from pytest_profllm.load import live_status
from pytest_profllm.load.scrape import Scraped, left_out, unread_reason, usable
from pytest_profllm.load.server_state import (
    CACHE_INFO,
    KV_BLOCK_SIZE,
    KV_BLOCKS,
    KV_TOKENS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    scrape_metrics,
    sim_lateness,
)
from pytest_profllm.load.spec_decode import spec_decode_figures

DEFAULT_INTERVAL_S = 0.5
_MIB = 2**20
log = logging.getLogger("profllm.telemetry")


@dataclass(frozen=True)
class ProcessReading:
    cpu_percent: float  # summed over the tree: 200 = two cores busy
    rss_mib: float
    processes: int


@dataclass(frozen=True)
class Sample:
    # perf_counter seconds: the clock a load's `clock_start` and its requests' times use, so a
    # sample can be placed on the load's own time axis.
    at: float
    gpus: tuple[GpuReading, ...]
    server: ProcessReading | None
    client: ProcessReading | None
    kv_cache_usage: float | None  # vLLM's vllm:kv_cache_usage_perc, a fraction (1 = full)
    # vLLM's gauges of the scheduler's queues, and its counters of finished requests and
    # generated tokens (rates between samples are the throughput over the run).
    running: float | None = None
    waiting: float | None = None
    requests_done: float | None = None
    tokens_generated: float | None = None


class _TreeMeter:
    """CPU and memory of a process tree; psutil's cpu_percent needs the same Process object
    from one call to the next, so they are kept by pid."""

    def __init__(self, pid: int, recursive: bool = True) -> None:
        self.pid = pid
        self.recursive = recursive
        self._known: dict[int, psutil.Process] = {}

    def read(self) -> ProcessReading | None:
        if self.recursive:
            current = process_tree(self.pid)
        else:
            try:
                current = [psutil.Process(self.pid)]
            except psutil.Error:
                current = []
        if not current:
            return None
        cpu = 0.0
        rss = 0
        counted = 0
        for process in current:
            process = self._known.setdefault(process.pid, process)
            try:
                with process.oneshot():
                    cpu += process.cpu_percent(None)
                    rss += process.memory_info().rss
                counted += 1
            except psutil.Error:
                continue
        return ProcessReading(cpu_percent=cpu, rss_mib=rss / _MIB, processes=counted)


# vLLM 0.33.0's names (vllm/v1/metrics/loggers.py); counters carry prometheus_client's `_total`.
PREEMPTIONS = "vllm:num_preemptions_total"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
REQUESTS_DONE = "vllm:request_success_total"
TOKENS_GENERATED = "vllm:generation_tokens_total"
# The record keeps the series over the run at most this many points (a long run's samples
# are averaged in equal stretches): a run page's charts, not a trace.
MAX_SERIES_POINTS = 300
SERIES_FIELDS = (
    "t_s", "request_throughput", "output_throughput", "running", "waiting", "kv_cache_usage",
    "gpu_utilization", "gpu_memory_mib", "gpu_power_w", "server_cpu_percent",
    "server_rss_mib", "client_cpu_percent",
)


# The counters whose change over a load the record keeps, and every metric the telemetry reads:
# where the server's /metrics left one out, or a counter went back, the record says so.
_COUNTERS = (PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS)
_READ = (*_COUNTERS, KV_CACHE_USAGE, RUNNING, WAITING, REQUESTS_DONE, TOKENS_GENERATED, CACHE_INFO)


def _delta(before: dict[str, float] | None, after: dict[str, float] | None,
           name: str) -> float | None:
    """A counter's change over the load; None without both scrapes, and where it went back (a
    restart, or a server not to be believed)."""
    before, after = usable(before), usable(after)
    if before is None or after is None or name not in after:
        return None
    change = after[name] - before.get(name, 0.0)
    return change if change >= 0 else None


def server_metric_deltas(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None]:
    """Preemptions and prefix-cache figures of the case: the counters' change over it; the KV
    cache the server sized; and the simulated engine's lateness over it
    (load/server_state.py). Null where a counter went back (`metrics_problem` says so)."""
    queries, hits = _delta(before, after, PREFIX_QUERIES), _delta(before, after, PREFIX_HITS)
    if queries is not None and hits is not None and hits > queries:
        queries = hits = None  # more tokens found than looked up: neither is to be believed
    return {
        **kv_cache_size(usable(after) or usable(before)),
        "server_num_preemptions": _delta(before, after, PREEMPTIONS),
        "server_prefix_cache_queries": queries,
        "server_prefix_cache_hits": hits,
        "server_prefix_cache_hit_rate": (hits / queries if queries and hits is not None else None),
        **sim_lateness(before, after),
    }


def metrics_problem(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> str | None:
    """What of the server's /metrics around the load the telemetry could not use, and why:
    a scrape that could not be read, a metric it reads left out, a counter that went back."""
    notes: list[str] = []
    scrapes = (("before the load", before), ("after the load", after))
    for when, scraped in scrapes:
        if scraped is not None and usable(scraped) is None:
            notes.append(f"{when}, it {unread_reason(scraped)}")
    for name in _READ:
        whys = {when: why for when, scraped in scrapes
                if (why := left_out(scraped, name)) is not None}
        if whys:
            notes.append(f"{name} left out {' and '.join(whys)} ({next(iter(whys.values()))})")
    usable_before, usable_after = usable(before), usable(after)
    for name in _COUNTERS:
        if usable_before is not None and usable_after is not None and name in usable_after and (
            _delta(before, after, name) is None
        ):
            notes.append(f"{name} went back during the load (a restart?)")
    queries, hits = _delta(before, after, PREFIX_QUERIES), _delta(before, after, PREFIX_HITS)
    if queries is not None and hits is not None and hits > queries:
        notes.append(f"{PREFIX_HITS} grew by {hits:.0f}, more than the {queries:.0f} tokens "
                     "looked up")
    return "the server's /metrics: " + "; ".join(notes) if notes else None


def kv_cache_size(scraped: dict[str, float] | None) -> dict[str, int | None]:
    """The KV cache the server sized at its start, from vLLM's `vllm:cache_config_info`: its
    blocks, their size, and its capacity in tokens (vLLM's own figure where it gives one,
    which counts a hybrid model's groups; else blocks times their size). None where the
    server gives no such metric."""
    scraped = scraped or {}
    blocks, size = _count(scraped.get(KV_BLOCKS)), _count(scraped.get(KV_BLOCK_SIZE))
    tokens = _count(scraped.get(KV_TOKENS)) or (blocks * size if blocks and size else None)
    return {
        "server_num_gpu_blocks": blocks,
        "server_kv_block_size": size,
        "server_kv_cache_tokens": tokens,
    }


def _count(value: float | None) -> int | None:
    """A count a server states: a positive whole number, else none (never a made-up one)."""
    return int(value) if value is not None and value >= 1 and value == int(value) else None


def energy_used(
    start: EnergyCount | None, end: EnergyCount | None
) -> dict[str, float | str | None]:
    """The leased GPUs' energy over the sampled window (the load, its warm-ups included):
    NVML's counters read as it began and as it ended, summed over the GPUs, and the mean power
    that makes. Null without NVML GPUs (a CPU host, the simulator's virtual GPUs), and then
    without a reason: every record would say it. Null with the reason where a GPU's counter
    could not be read."""
    figures: dict[str, float | str | None] = dict.fromkeys(ENERGY_FIELDS)
    if start is None and end is None:
        return figures
    if start is None or end is None:
        figures["gpu_energy_problem"] = "NVML's energy counters were read at one end only"
        return figures
    problem = start.problem or end.problem
    if problem is None:
        # One NvmlGpus object reads both ends: the same GPUs, in the same order.
        used = [after - before
                for before, after in zip(start.millijoules, end.millijoules, strict=True)]
        if any(mj < 0 for mj in used):
            problem = "NVML's energy counter went back during the load (the driver reloaded?)"
    if problem is not None:
        figures["gpu_energy_problem"] = problem
        return figures
    joules = sum(used) / 1000  # NVML counts millijoules
    window = end.at - start.at
    figures["gpu_energy_j"] = joules
    figures["gpu_energy_window_s"] = window
    figures["mean_gpu_power_from_energy_w"] = joules / window if window > 0 else None
    return figures


ENERGY_FIELDS = (
    "gpu_energy_j", "gpu_energy_window_s", "mean_gpu_power_from_energy_w", "gpu_energy_problem",
)


def summarize(samples: Sequence[Sample], interval_s: float) -> dict[str, float | int | None]:
    """Peaks and means for the record's `system` block.

    GPU memory and temperature are per GPU (the fullest, the hottest of the leased ones);
    utilisation and SM clock are means over the leased GPUs; power is their total.
    """
    gpu_rows = [s.gpus for s in samples if s.gpus]

    def per_sample(pick: Callable[[GpuReading], float | None], combine: str) -> list[float]:
        values = []
        for row in gpu_rows:
            known = [v for v in (pick(g) for g in row) if v is not None]
            if known:
                values.append(
                    max(known)
                    if combine == "max"
                    else sum(known)
                    if combine == "sum"
                    else statistics.fmean(known)
                )
        return values

    memory = per_sample(lambda g: g.memory_used_mib, "max")
    utilization = per_sample(lambda g: g.utilization, "mean")
    power = per_sample(lambda g: g.power_w, "sum")
    clock = per_sample(lambda g: g.sm_clock_mhz, "mean")
    temperature = per_sample(lambda g: g.temperature_c, "max")
    server = [s.server for s in samples if s.server is not None]
    client = [s.client for s in samples if s.client is not None]
    kv = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
    return {
        "peak_gpu_memory_mib": _peak(memory),
        "mean_gpu_memory_mib": _mean(memory),
        "mean_gpu_utilization": _mean(utilization),
        "peak_gpu_utilization": _peak(utilization),
        "mean_gpu_power_w": _mean(power),
        "peak_gpu_power_w": _peak(power),
        "mean_gpu_sm_clock_mhz": _mean(clock),
        "peak_gpu_sm_clock_mhz": _peak(clock),
        "mean_gpu_temperature_c": _mean(temperature),
        "peak_gpu_temperature_c": _peak(temperature),
        "mean_server_cpu_percent": _mean([r.cpu_percent for r in server]),
        "peak_server_cpu_percent": _peak([r.cpu_percent for r in server]),
        "mean_server_rss_mib": _mean([r.rss_mib for r in server]),
        "peak_server_rss_mib": _peak([r.rss_mib for r in server]),
        "peak_server_processes": max((r.processes for r in server), default=None),
        "mean_client_cpu_percent": _mean([r.cpu_percent for r in client]),
        "peak_client_cpu_percent": _peak([r.cpu_percent for r in client]),
        "peak_client_rss_mib": _peak([r.rss_mib for r in client]),
        "mean_kv_cache_usage": _mean(kv),
        "peak_kv_cache_usage": _peak(kv),
        "telemetry_samples": len(samples),
        "telemetry_interval_s": interval_s,
    }


def series(samples: Sequence[Sample], max_points: int = MAX_SERIES_POINTS,
           origin: float | None = None) -> list[dict[str, float | None]]:
    """The run over time, for its page: one point per sample (seconds from `origin`, the
    load's start on the perf_counter clock; else from the first sample), the
    throughput as the counters' rate since the sample before; averaged down to `max_points`.
    GPU figures follow summarize's rules (utilisation a mean, memory the fullest GPU, power
    the total); they are null without NVML."""
    if not samples:
        return []
    start = samples[0].at if origin is None else origin
    points: list[dict[str, float | None]] = []
    for before, sample in zip([None, *samples[:-1]], samples, strict=True):
        elapsed = sample.at - before.at if before is not None else 0.0
        gpus = sample.gpus

        def gpu(pick: Callable[[GpuReading], float | None], combine: str,
                readings: Sequence[GpuReading] = gpus) -> float | None:
            known = [v for v in (pick(g) for g in readings) if v is not None]
            if not known:
                return None
            return max(known) if combine == "max" else sum(known) if combine == "sum" else (
                statistics.fmean(known))

        points.append({
            "t_s": sample.at - start,
            "request_throughput": _rate(before.requests_done if before else None,
                                        sample.requests_done, elapsed),
            "output_throughput": _rate(before.tokens_generated if before else None,
                                       sample.tokens_generated, elapsed),
            "running": sample.running,
            "waiting": sample.waiting,
            "kv_cache_usage": sample.kv_cache_usage,
            "gpu_utilization": gpu(lambda g: g.utilization, "mean"),
            "gpu_memory_mib": gpu(lambda g: g.memory_used_mib, "max"),
            "gpu_power_w": gpu(lambda g: g.power_w, "sum"),
            "server_cpu_percent": sample.server.cpu_percent if sample.server else None,
            "server_rss_mib": sample.server.rss_mib if sample.server else None,
            "client_cpu_percent": sample.client.cpu_percent if sample.client else None,
        })
    return _downsample(points, max_points)


def _rate(before: float | None, after: float | None, elapsed: float) -> float | None:
    if before is None or after is None or elapsed <= 0:
        return None
    return max(0.0, (after - before) / elapsed)


def _downsample(points: list[dict[str, float | None]], max_points: int
                ) -> list[dict[str, float | None]]:
    if len(points) <= max_points:
        return points
    out = []
    for index in range(max_points):
        stretch = points[index * len(points) // max_points:
                         (index + 1) * len(points) // max_points]
        averaged: dict[str, float | None] = {}
        for name in SERIES_FIELDS:
            known = [p[name] for p in stretch if p[name] is not None]
            averaged[name] = statistics.fmean(v for v in known if v is not None) if known else None
        out.append(averaged)
    return out


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _peak(values: Sequence[float]) -> float | None:
    return max(values) if values else None


@dataclass
class Sampler:
    """Samples in a daemon thread between `start()` and `stop()`, scraping the server's
    `/metrics` once before and once after. Use as a context manager around the load."""

    server_pid: int | None
    gpu_ids: Sequence[str]
    metrics_url: str | None
    interval_s: float = DEFAULT_INTERVAL_S
    gpus: NvmlGpus | None = None
    # The deadline of each scrape around the load (limits.py); a sample's is its interval's.
    metrics_deadline_s: float = METRICS_DEADLINE_S
    samples: list[Sample] = field(default_factory=list)
    metrics_before: dict[str, float] | None = None
    metrics_after: dict[str, float] | None = None
    sample_seconds: float = 0.0  # time spent taking samples, to show the sampler's overhead
    # The leased GPUs' energy counters as the load began and as it ended (None: not read).
    energy_start: EnergyCount | None = None
    energy_end: EnergyCount | None = None
    # Why some telemetry is missing (the first failure, and how many there were); None: none.
    problem: str | None = None
    _failures: int = 0
    started: float | None = None  # perf_counter at start(): the origin of a search's series
    # The series' origin where not the start (a load's `clock_start`, known once it ran): the
    # live page's series takes it too, and ends as the record's.
    origin: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _owns_gpus: bool = False
    _server: _TreeMeter | None = None
    _client: _TreeMeter | None = None
    # The first sample whose /metrics could not be read, or lacked what the sampler reads, and
    # how many there were.
    _sample_problem: str | None = None
    _sample_problems: int = 0

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.started = time.perf_counter()
        self._guarded("starting", self._start)
        self._guarded("sampling", self._take)  # primes psutil's CPU counters: 0 the first time
        self.samples.clear()
        # The live page's series: the record's, of the samples so far (a copy: the thread
        # appends while the live file is written).
        live_status.series_start(lambda: self.series(samples=list(self.samples)))
        self._guarded("reading energy", lambda: self._read_energy(at_start=True))
        self._thread = threading.Thread(target=self._loop, name="profllm-telemetry", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        if self.gpus is None:
            self.gpus = NvmlGpus.open(self.gpu_ids)
            self._owns_gpus = self.gpus is not None
        self._server = _TreeMeter(self.server_pid) if self.server_pid else None
        self._client = _TreeMeter(psutil.Process().pid, recursive=False)
        if self.metrics_url:
            self.metrics_before = scrape_metrics(self.metrics_url, self.metrics_deadline_s)

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._guarded("sampling", self._take)  # the run's tail, however short the run
        self._guarded("reading energy", lambda: self._read_energy(at_start=False))
        self._guarded("stopping", self._finish)

    def _read_energy(self, at_start: bool) -> None:
        if self.gpus is None:
            return
        if at_start:
            self.energy_start = self.gpus.energy()
        else:
            self.energy_end = self.gpus.energy()

    def _finish(self) -> None:
        try:
            if self.metrics_url:
                self.metrics_after = scrape_metrics(self.metrics_url, self.metrics_deadline_s)
        finally:
            if self._owns_gpus and self.gpus is not None:
                self.gpus.close()

    def _guarded(self, what: str, step: Callable[[], None]) -> None:
        """Run one step of the sampler; a failure is noted (and logged the first time),
        never raised: telemetry is what the case cost, not what it measured."""
        try:
            step()
        except Exception as error:  # any: psutil, NVML, requests, the host's descriptors
            self._failures += 1
            if self.problem is None:
                why = str(error).splitlines()[0] if str(error) else ""
                self.problem = f"telemetry incomplete: {what} failed: {type(error).__name__}"
                self.problem += f": {why}" if why else ""
                log.warning("%s (the load goes on; the record says so)", self.problem)

    def summary(self) -> dict[str, float | int | None]:
        return {
            **summarize(self.samples, self.interval_s),
            **server_metric_deltas(self.metrics_before, self.metrics_after),
        }

    def record(self) -> dict[str, Any]:
        """The record's telemetry: the summary, speculative decoding over the load
        (load/spec_decode.py), and why some of it is missing."""
        problem = self.problem
        if problem is not None and self._failures > 1:
            problem += f" ({self._failures} failures)"
        sampled = self._sample_problem
        if sampled is not None and self._sample_problems > 1:
            sampled += f" ({self._sample_problems} samples)"
        problems = [problem, metrics_problem(self.metrics_before, self.metrics_after), sampled]
        return {
            **self.summary(),
            **energy_used(self.energy_start, self.energy_end),
            **spec_decode_figures(self.metrics_before, self.metrics_after),
            "telemetry_problem": "; ".join(text for text in problems if text) or None,
        }

    def series(self, origin: float | None = None, samples: Sequence[Sample] | None = None
               ) -> list[dict[str, float | None]]:
        """The samples over time, from `origin` (a load's `clock_start`; else `self.origin`,
        else the start): the first sample comes an interval after start(), so counting from
        it put every point late."""
        if origin is not None:
            self.origin = origin
        return series(self.samples if samples is None else samples,
                      origin=self.origin if self.origin is not None else self.started)

    def _note_sample(self, scraped: Scraped) -> None:
        why: str | None = None
        if scraped.unread is not None:
            why = f"it {scraped.unread}"
        else:
            why = next((f"{name} left out ({scraped.left_out[name]})"
                        for name in _READ if name in scraped.left_out), None)
        if why is not None:
            self._sample_problems += 1
            self._sample_problem = self._sample_problem or f"a sample's /metrics: {why}"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._guarded("sampling", self._take)

    def _take(self) -> None:
        began = time.perf_counter()
        scraped = Scraped()
        if self.metrics_url:
            scraped = scrape_metrics(self.metrics_url, deadline_s=min(self.interval_s, 1.0))
            self._note_sample(scraped)
        self.samples.append(
            Sample(
                at=time.perf_counter(),
                gpus=self.gpus.read() if self.gpus is not None else (),
                server=self._server.read() if self._server is not None else None,
                client=self._client.read() if self._client is not None else None,
                kv_cache_usage=scraped.get(KV_CACHE_USAGE),
                running=scraped.get(RUNNING),
                waiting=scraped.get(WAITING),
                requests_done=scraped.get(REQUESTS_DONE),
                tokens_generated=scraped.get(TOKENS_GENERATED),
            )
        )
        live_status.changed()  # a new point of the live page's series
        if scraped:
            live_status.server_state(
                scraped.get(RUNNING), scraped.get(WAITING), scraped.get(KV_CACHE_USAGE)
            )
        self.sample_seconds += time.perf_counter() - began
