"""The simulator's `/metrics`, its profile routes and its development routes, as vLLM 0.33.0
has them.

`/metrics` is Prometheus text with vLLM's metric names and labels (`model_name`, `engine`),
counting what the scheduler really did. The profile routes exist only when the server starts
with `--profiler-config` naming a profiler (vLLM attaches them then, else 404); a start while
one runs is 409; a stop without a start is 200 and writes nothing; a stop writes a Chrome
trace (`*.pt.trace.json.gz`, as vLLM's torch profiler) of the scheduler steps it saw.

`/metrics` also says how late the simulator's real-time steps ended (`StepLateness`): a step
that ends late is the host's delay, not the simulated GPU's. Names of our own, with the labels
of vLLM's families:

- `profllm:sim_step_lateness_seconds`: a histogram (`_bucket` by `le`, `_sum`, `_count`),
  bounds 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5 s and +Inf;
- `profllm:sim_steps_late_over_{1,2,5,10,20,50,100,200,500,1000}ms_total`: counters of the
  steps late by more than that many milliseconds, one name per threshold, so that a reader
  that sums samples over their labels (`run/telemetry.py:scrape_metrics`) can tell them apart;
- `profllm:sim_steps_total`: a counter of the steps the real-time loop ran;
- `profllm:sim_step_lateness_seconds_total`: a counter of the lateness summed over them (the
  histogram's `_sum`, under a name of its own);
- `profllm:sim_step_lateness_max_seconds`: a gauge, the largest lateness since the start.

The share of a window's steps late by more than X ms is the difference of
`..._over_Xms_total` between two scrapes over that of `profllm:sim_steps_total`.

The development routes exist only when `VLLM_SERVER_DEV_MODE` is a non-zero integer, as vLLM's
(`vllm/entrypoints/serve/dev/cache/api_router.py`, attached by `register_vllm_dev_api_routers`):
`POST /reset_prefix_cache` (query `reset_running_requests`, `reset_external`) answers 200 and
`{"success": bool}`: false while running requests hold KV blocks, unless they are reset
(preempted) too; `/reset_mm_cache` and `/reset_encoder_cache` answer 200 and do nothing, the
simulator keeping no multimodal or encoder output across requests.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from pytest_profllm.sim.batching import LATE_STEP_THRESHOLDS_MS, Scheduler
from pytest_profllm.sim.profiler_config import DEV_MODE_ENV, ProfilerSettings
from pytest_profllm.sim.stats import HISTOGRAMS

# The rank suffix vLLM's workers put in their trace names (single GPU, no parallelism).
_WORKER_TRACE_NAME = "dp0_pp0_tp0_dcp0_ep0_rank0"
_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# What vLLM's FastAPI (pydantic, lax mode) takes for a boolean query parameter.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})

log = logging.getLogger("profllm.sim")


def add_routes(
    app: web.Application, scheduler: Scheduler, model_name: str, profiler: ProfilerSettings
) -> None:
    app.router.add_get("/metrics", _metrics_handler(scheduler, model_name))
    if profiler.profiler is not None:
        session = _ProfileSession(scheduler, profiler)
        app.router.add_post("/start_profile", session.start)
        app.router.add_post("/stop_profile", session.stop)


def add_dev_routes(app: web.Application, scheduler: Scheduler) -> None:
    """vLLM's development cache routes; the caller attaches them only in development mode."""
    log.warning("development routes are enabled (%s): not for production", DEV_MODE_ENV)

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        flags = {}
        for name in ("reset_running_requests", "reset_external"):
            text = request.query.get(name, "false").lower()
            if text not in _TRUE | _FALSE:
                return _error(
                    f"1 validation error: query.{name}: Input should be a valid boolean, "
                    f"unable to interpret input {request.query[name]!r}",
                    400,
                    "Bad Request",
                    param=f"query.{name}",
                )
            flags[name] = text in _TRUE
        log.info("Resetting prefix cache...")
        # reset_external resets a KV connector's cache; the simulator has none, which vLLM
        # counts as a success.
        success = scheduler.reset_prefix_cache(flags["reset_running_requests"])
        return web.json_response({"success": success})

    async def no_cache(request: web.Request) -> web.Response:
        # Nothing to forget: images and audio are encoded again for every request that does
        # not find them in the prefix cache.
        log.info("Resetting %s...", request.path.removeprefix("/reset_").replace("_", " "))
        return web.Response(status=200)

    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/reset_mm_cache", no_cache)
    app.router.add_post("/reset_encoder_cache", no_cache)


def render_metrics(scheduler: Scheduler, model_name: str) -> bytes:
    # Deferred: prometheus_client is needed only once the simulator serves /metrics.
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SchedulerCollector(scheduler, model_name))
    data: bytes = generate_latest(registry)
    return data


def _metrics_handler(scheduler: Scheduler, model_name: str) -> Any:
    async def handler(request: web.Request) -> web.Response:
        # Deferred: prometheus_client is needed only once the simulator serves /metrics.
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(
            body=render_metrics(scheduler, model_name),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    return handler


class _SchedulerCollector:
    """vLLM 0.33.0's names (vllm/v1/metrics/loggers.py), read from the scheduler at scrape time:
    the families whose quantity the simulator has, with vLLM's types and label names."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler = scheduler
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self) -> Iterator[Any]:
        # Deferred: prometheus_client is needed only once the simulator serves /metrics.
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self.scheduler
        names, values = list(self.labels), list(self.labels.values())
        cached = s.prefix_cache_hits
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(s.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(s.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             s.kv_cache_usage),
        )
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             cached),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             s.generation_tokens),
        )
        yield from _families(GaugeMetricFamily, gauges, names, values)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*names, "reason"],
        )
        waiting.add_metric([*values, "capacity"], float(len(s.waiting)))
        waiting.add_metric([*values, "deferred"], 0.0)
        yield waiting
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            labels=[*names, "sleep_state"],
        )
        for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
            sleep.add_metric([*values, state], value)
        yield sleep
        yield from _families(CounterMetricFamily, counters, names, values)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*names, "source"],
        )
        for source, value in (
            ("local_compute", s.prompt_tokens - cached),
            ("local_cache_hit", cached),
            ("external_kv_transfer", 0),
        ):
            by_source.add_metric([*values, source], float(max(value, 0)))
        yield by_source
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in s.stats.request_success.items():
            success.add_metric([*values, reason], float(count))
        yield success
        for name, documentation, _ in HISTOGRAMS:
            histogram = s.stats.histograms[name]
            family = HistogramMetricFamily(name, documentation, labels=names)
            family.add_metric(values, histogram.buckets(), histogram.total)
            yield family
        yield from self._lateness(names, values)
        yield from self._speculation(names, values)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"],
        )
        info.add_metric(
            [str(s.block_size), str(s.enable_prefix_caching), str(s.num_gpu_blocks), "0"], 1.0
        )
        yield info

    def _speculation(self, names: list[str], values: list[str]) -> Iterator[Any]:
        """vLLM 0.32's speculative decoding counters (vllm/v1/spec_decode/metrics.py
        `SpecDecodingProm`), served only where the engine speculates, as vLLM's are."""
        # Deferred: prometheus_client is needed only once the simulator serves /metrics.
        from prometheus_client.core import CounterMetricFamily

        spec = self.scheduler.speculation
        if spec is None:
            return
        counters = (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
             spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             spec.num_accepted_tokens),
        )
        yield from _families(CounterMetricFamily, counters, names, values)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*names, "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*values, str(position)], float(count))
        yield per_position

    def _lateness(self, names: list[str], values: list[str]) -> Iterator[Any]:
        """The real-time loop's step lateness (the module's docstring has the names)."""
        # Deferred: prometheus_client is needed only once the simulator serves /metrics.
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        lateness = self.scheduler.lateness
        family = HistogramMetricFamily(
            "profllm:sim_step_lateness_seconds",
            "How late the simulator's steps ended, in seconds (a busy host's delay).",
            labels=names,
        )
        family.add_metric(values, lateness.histogram.buckets(), lateness.total_seconds)
        yield family
        counters: list[tuple[str, str, float]] = [
            (
                f"profllm:sim_steps_late_over_{ms}ms",
                f"Simulator steps that ended more than {ms} ms late.",
                lateness.over(ms),
            )
            for ms in LATE_STEP_THRESHOLDS_MS
        ]
        counters += [
            ("profllm:sim_steps", "Simulator steps run on the real-time clock.", lateness.steps),
            # The histogram's sum: a counter of its own for readers that take no histograms.
            ("profllm:sim_step_lateness_seconds",
             "Lateness of the simulator's steps, summed, in seconds.", lateness.total_seconds),
        ]  # fmt: skip
        yield from _families(CounterMetricFamily, counters, names, values)
        largest = ("profllm:sim_step_lateness_max_seconds",
                   "The largest lateness of a simulator step since the start, in seconds.",
                   lateness.max_seconds)  # fmt: skip
        yield from _families(GaugeMetricFamily, [largest], names, values)


def _families(
    family: Callable[..., Any],
    rows: Iterable[tuple[str, str, float]],
    names: list[str],
    values: list[str],
) -> Iterator[Any]:
    """A `family` (a counter or gauge family of prometheus_client) for each of `rows` (its
    name, documentation and value), labelled `names` = `values`."""
    for name, documentation, value in rows:
        metric = family(name, documentation, labels=names)
        metric.add_metric(values, float(value))
        yield metric


class _ProfileSession:
    def __init__(self, scheduler: Scheduler, settings: ProfilerSettings) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.prefix: str | None = None

    async def start(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {}
        if request.can_read_body:
            try:
                body = await request.json()
            except json.JSONDecodeError:
                body = {}
        prefix = body.get("profile_prefix") if isinstance(body, dict) else None
        if prefix is not None and (not isinstance(prefix, str) or not _PREFIX.match(prefix)):
            return _error(
                "profile_prefix must be 1-128 ASCII characters, start with a letter or number, "
                "and contain only letters, numbers, '.', '_', or '-'",
                400,
                "BadRequestError",
            )
        if self.scheduler.trace_events is not None:
            return _error(
                "A profiling session is already active. Call /stop_profile before starting "
                "another session.",
                409,
                "Conflict",
            )
        self.prefix = prefix
        self.scheduler.trace_events = []
        return web.Response(status=200)

    async def stop(self, request: web.Request) -> web.Response:
        events = self.scheduler.trace_events
        if events is None:
            return web.Response(status=200)  # as vLLM: a stop with nothing running is ignored
        self.scheduler.trace_events = None
        name = f"{self.prefix}_{_WORKER_TRACE_NAME}" if self.prefix else _WORKER_TRACE_NAME
        self._write(name, events)
        return web.Response(status=200)

    def _write(self, name: str, events: list[dict[str, Any]]) -> Path:
        directory = Path(self.settings.torch_profiler_dir)
        directory.mkdir(parents=True, exist_ok=True)
        trace = {
            "traceEvents": [
                {"name": "process_name", "ph": "M", "pid": os.getpid(),
                 "args": {"name": "profllm sim engine"}},
                *events,
            ],
            "displayTimeUnit": "ms",
        }
        data = json.dumps(trace).encode()
        suffix = ".pt.trace.json"
        if self.settings.torch_profiler_use_gzip:
            data, suffix = gzip.compress(data), suffix + ".gz"
        path = directory / f"{name}.{time.time_ns()}{suffix}"
        temporary = path.with_name("." + path.name)
        temporary.write_bytes(data)
        temporary.replace(path)  # a reader never sees half a trace
        return path


def _error(message: str, status: int, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)
