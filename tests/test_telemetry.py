"""Telemetry of a case: the peaks and means of the `system` block, NVML through a fake `pynvml`
(no GPU here), psutil on real processes, and the server's Prometheus counters."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from fake_nvml import FakeGpu, FakeNvml

from pytest_profllm.hosts.nvml import GpuReading, NvmlGpus, wait_gpu_memory_released
from pytest_profllm.load.server_state import scrape_metrics
from pytest_profllm.run.telemetry import (
    ProcessReading,
    Sample,
    Sampler,
    server_metric_deltas,
    summarize,
)

MIB = 2**20


def gpu(index: int, util: float, mem: float, power: float | None, clock: float, temp: float) -> Any:
    return GpuReading(index, util, mem, power, clock, temp)


def test_summarize_gives_peaks_and_means_over_samples_and_gpus() -> None:
    samples = [
        Sample(0.0, (gpu(0, 50, 1000, 100, 1500, 60), gpu(1, 70, 3000, 200, 1700, 70)),
               ProcessReading(100, 500, 3), ProcessReading(20, 100, 1), 0.25),
        Sample(0.5, (gpu(0, 90, 2000, None, 1900, 65), gpu(1, 10, 1000, 300, 1300, 80)),
               ProcessReading(300, 700, 4), ProcessReading(40, 120, 1), 0.75),
    ]
    summary = summarize(samples, 0.5)
    # Memory and temperature: the fullest/hottest GPU of each sample.
    assert summary["peak_gpu_memory_mib"] == 3000
    assert summary["mean_gpu_memory_mib"] == 2500
    assert summary["peak_gpu_temperature_c"] == 80
    assert summary["mean_gpu_temperature_c"] == 75
    # Utilisation and clock: mean over the GPUs, then over samples.
    assert summary["mean_gpu_utilization"] == 55
    assert summary["peak_gpu_utilization"] == 60
    assert summary["mean_gpu_sm_clock_mhz"] == 1600
    # Power: total of the GPUs that report it.
    assert summary["peak_gpu_power_w"] == 300
    assert summary["mean_gpu_power_w"] == 300
    assert summary["mean_server_cpu_percent"] == 200
    assert summary["peak_server_rss_mib"] == 700
    assert summary["peak_server_processes"] == 4
    assert summary["peak_client_cpu_percent"] == 40
    assert summary["peak_kv_cache_usage"] == 0.75
    assert summary["mean_kv_cache_usage"] == 0.5
    assert summary["telemetry_samples"] == 2


def test_without_gpus_the_gpu_fields_are_null_not_zero() -> None:
    samples = [Sample(0.0, (), ProcessReading(10, 50, 1), None, None)]
    summary = summarize(samples, 0.5)
    gpu_fields = [name for name in summary if "gpu" in name]
    assert len(gpu_fields) == 10
    assert all(summary[name] is None for name in gpu_fields)
    assert summary["mean_kv_cache_usage"] is None
    assert summary["peak_server_rss_mib"] == 50


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml(
        [
            FakeGpu(utilization=30, memory_used=512 * MIB, power_mw=250_000, sm_clock=1980,
                    temperature=55),
            FakeGpu(utilization=80, memory_used=1024 * MIB, power_mw=None, sm_clock=1410,
                    temperature=61),
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_nvml_readings_are_converted_and_unsupported_ones_null(fake_nvml: FakeNvml) -> None:
    gpus = NvmlGpus.open(["1", "0"])
    assert gpus is not None
    first, second = gpus.read()
    assert (first.index, first.utilization, first.memory_used_mib) == (1, 80.0, 1024.0)
    assert first.power_w is None  # the board does not report it
    assert (second.power_w, second.sm_clock_mhz, second.temperature_c) == (250.0, 1980.0, 55.0)
    gpus.close()
    assert fake_nvml.initialised == 0


def test_nvml_absent_or_gpus_unknown_gives_no_source(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert NvmlGpus.open(["7"]) is None  # no such GPU
    assert NvmlGpus.open([]) is None
    assert fake_nvml.initialised == 0
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: nvidia-ml-py absent
    assert NvmlGpus.open(["0"]) is None


def test_gpu_memory_release_waits_until_the_pids_let_go(fake_nvml: FakeNvml) -> None:
    calls = iter(range(100))
    # pid 41 (ours) holds memory for three queries; pid 99 (someone else's) always does.
    fake_nvml.gpus[0].holders = lambda: {41: 2 * MIB, 99: MIB} if next(calls) < 3 else {99: MIB}
    gpus = NvmlGpus.open(["0"])
    assert gpus is not None
    assert wait_gpu_memory_released(gpus, {41}, timeout=10, poll_s=0.01) is None
    assert next(calls) == 4  # it polled until the fourth query showed pid 41 gone


def test_gpu_memory_never_released_is_reported(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpus[1].holders = lambda: {41: 3 * 1024 * MIB}
    gpus = NvmlGpus.open(["0", "1"])
    assert gpus is not None
    problem = wait_gpu_memory_released(gpus, {41, 42}, timeout=0.1, poll_s=0.01)
    assert problem == (
        "GPU memory still held 0 s after the server stopped (GPU 1: pid 41 3072 MiB)"
    )


BURN = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: pass"])
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def busy_tree() -> Iterator[subprocess.Popen[str]]:
    """A process whose child keeps one core busy, like an EngineCore under load."""
    process = subprocess.Popen(
        [sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield process
    finally:
        import os
        import signal

        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_sampler_measures_the_server_tree_and_the_client(
    busy_tree: subprocess.Popen[str],
) -> None:
    import time

    with Sampler(busy_tree.pid, [], None, interval_s=0.1) as sampler:
        time.sleep(0.6)
    summary = sampler.summary()
    assert summary["telemetry_samples"] is not None and summary["telemetry_samples"] >= 3
    assert summary["peak_server_processes"] == 2
    # The child spins: the tree used a good share of a core (a loose bound: 2 shared cores).
    assert summary["mean_server_cpu_percent"] is not None
    assert summary["mean_server_cpu_percent"] > 10
    assert summary["peak_server_rss_mib"] is not None and summary["peak_server_rss_mib"] > 5
    assert summary["peak_client_rss_mib"] is not None and summary["peak_client_rss_mib"] > 5
    assert summary["peak_gpu_memory_mib"] is None  # no GPU ids: no NVML, no invented zero
    assert summary["server_num_preemptions"] is None  # no /metrics to scrape


def test_sampler_reads_the_leased_gpus_through_nvml(fake_nvml: FakeNvml) -> None:
    with Sampler(None, ["0"], None, interval_s=0.05) as sampler:
        fake_nvml.gpus[0].memory_used = 4096 * MIB
        import time

        time.sleep(0.2)
    summary = sampler.summary()
    assert summary["peak_gpu_memory_mib"] == 4096
    assert summary["mean_gpu_power_w"] == 250
    assert summary["mean_server_cpu_percent"] is None  # no server pid given
    assert fake_nvml.initialised == 0  # the sampler closed what it opened


class _Metrics(BaseHTTPRequestHandler):
    bodies: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        body = self.bodies.pop(0) if len(self.bodies) > 1 else self.bodies[0]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def exposition(
    preemptions: float, queries: float, hits: float, kv: float, capacity: str = ""
) -> str:
    lines = []
    for engine in ("0", "1"):  # two engines (data parallel): values are summed
        labels = f'{{engine="{engine}",model_name="m"}}'
        # vLLM's cache configuration, an info metric: its facts are labels (each engine's own
        # cache; `capacity`: the label of the cache's tokens, where vLLM gives it: 0.32 does).
        info = (f'block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
                f'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2271",'
                f'{capacity}engine="{engine}"')
        lines += [
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{info}}} 1.0",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{labels} {preemptions}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{labels} {queries}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{labels} {hits}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {kv}",
        ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def metrics_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_sums_labels_and_deltas_cover_the_run(metrics_server: str) -> None:
    _Metrics.bodies = [exposition(1, 100, 10, 0.1), exposition(4, 400, 160, 0.3)]
    before = scrape_metrics(metrics_server)
    after = scrape_metrics(metrics_server)
    assert before is not None and after is not None
    assert before["vllm:kv_cache_usage_perc"] == pytest.approx(0.2)
    deltas = server_metric_deltas(before, after)
    assert deltas == {
        # The cache's size from its info metric's labels: each engine's, not their sum.
        "server_num_gpu_blocks": 2271,
        "server_kv_block_size": 16,
        "server_kv_cache_tokens": 2271 * 16,
        "server_num_preemptions": 6.0,
        "server_prefix_cache_queries": 600.0,
        "server_prefix_cache_hits": 300.0,
        "server_prefix_cache_hit_rate": 0.5,
        # Not the simulated engine: no step counters, no lateness.
        "sim_steps": None,
        "sim_step_lateness_mean_ms": None,
        "sim_step_lateness_p99_ms": None,
    }


def test_the_kv_cache_capacity_is_vllms_own_figure_where_it_gives_one(
    metrics_server: str,
) -> None:
    # Recent vLLM (0.32) labels the cache's capacity in tokens (a hybrid model's groups counted),
    # which need not be blocks x block size.
    _Metrics.bodies = [exposition(1, 1, 1, 0.1, capacity='kv_cache_size_tokens="36000",')]
    scraped = scrape_metrics(metrics_server)
    assert scraped is not None
    assert scraped["vllm:cache_config_info.kv_cache_size_tokens"] == 36000
    assert "vllm:cache_config_info.cache_dtype" not in scraped  # not a figure
    assert server_metric_deltas(scraped, scraped)["server_kv_cache_tokens"] == 36000


def test_a_cache_size_that_is_no_count_is_left_out() -> None:
    # A label that is not a positive whole number never becomes a cache size.
    for blocks, size in ((-5.0, 16.0), (2271.5, 16.0), (2271.0, 0.0)):
        scraped = {"vllm:cache_config_info.num_gpu_blocks": blocks,
                   "vllm:cache_config_info.block_size": size}
        figures = server_metric_deltas(scraped, scraped)
        assert figures["server_kv_cache_tokens"] is None, (blocks, size)
        assert None in (figures["server_num_gpu_blocks"], figures["server_kv_block_size"])


def test_no_metrics_endpoint_gives_null_figures() -> None:
    unanswered = scrape_metrics("http://127.0.0.1:9/metrics", deadline_s=0.5)
    assert unanswered == {} and unanswered.unread and "did not answer" in unanswered.unread
    assert set(server_metric_deltas(None, None).values()) == {None}
    assert set(server_metric_deltas(unanswered, unanswered).values()) == {None}


class _Flaky:
    """A process meter that fails on some reads, as psutil does on a host out of descriptors."""

    def __init__(self, fail_every: int) -> None:
        self.reads = 0
        self.fail_every = fail_every

    def read(self) -> ProcessReading | None:
        self.reads += 1
        if self.reads % self.fail_every == 0:
            raise OSError(24, "Too many open files")
        return ProcessReading(10.0, 100.0, 1)


def test_a_failing_sampler_costs_no_record_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any exception in the sampler thread is noted and logged in one line; sampling goes on,
    and nothing reaches the load's thread (the record then says telemetry was incomplete)."""
    import time

    sampler = Sampler(None, [], None, interval_s=0.02)
    errors: list[threading.ExceptHookArgs] = []
    before, threading.excepthook = threading.excepthook, errors.append
    try:
        with caplog.at_level("WARNING", logger="profllm.telemetry"), sampler:
            flaky = _Flaky(fail_every=2)
            sampler._client = flaky  # type: ignore[assignment]
            deadline = time.monotonic() + 10
            while flaky.reads < 8 and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        threading.excepthook = before
    summary = sampler.summary()
    assert not errors  # the thread raised nothing
    problem = sampler.record()["telemetry_problem"]
    assert isinstance(problem, str)
    assert problem.startswith(
        "telemetry incomplete: sampling failed: OSError: [Errno 24] Too many open files ("
    )
    assert summary["telemetry_samples"] is not None and summary["telemetry_samples"] >= 3
    lines = [r.getMessage() for r in caplog.records if r.name == "profllm.telemetry"]
    assert len(lines) == 1 and "\n" not in lines[0]  # logged once, in one line


def test_a_sampler_that_cannot_start_still_lets_the_load_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(NvmlGpus, "open", refuse)
    with Sampler(None, ["0"], None, interval_s=0.02) as sampler:
        pass
    assert str(sampler.record()["telemetry_problem"]).startswith(
        "telemetry incomplete: starting failed: OSError"
    )


def test_a_sampler_that_kept_up_has_no_problem() -> None:
    with Sampler(None, [], None, interval_s=0.02) as sampler:
        pass
    assert sampler.record()["telemetry_problem"] is None


BROKEN_SAMPLER = """
import pytest_profllm.run.telemetry as telemetry


def _no_descriptors(self):
    raise OSError(24, "Too many open files")


telemetry._TreeMeter.read = _no_descriptors  # every process reading fails, as under EMFILE
"""
SMALL_SUITE = """
server:
  model: Qwen/Qwen3-0.6B
benchmark:
  num_prompts: 20
  random_input_len: 8
  random_output_len: 60
  request_rate: 20
"""


def test_a_case_whose_telemetry_fails_keeps_its_record(
    pytester: pytest.Pytester, ports: str
) -> None:
    """Out of file descriptors: an EMFILE in the sampler thread once became a teardown error,
    and the out folder kept only logs/. The case now passes, its record and results.db are
    written, and the record says telemetry was incomplete."""
    from helpers import run_records, run_suites

    pytester.makeconftest(BROKEN_SAMPLER)
    (pytester.path / "bench_x.yaml").write_text(SMALL_SUITE)
    result = run_suites(pytester, ports, "-rA", timeout=120)
    (record,) = run_records(pytester)
    assert (pytester.path / "results" / "results.db").is_file()
    assert record["status"] == "passed", result.stdout.str()[-2000:]
    assert record["system"]["telemetry_problem"].startswith(
        "telemetry incomplete: sampling failed: OSError: [Errno 24] Too many open files"
    )
    assert record["results"]["completed"] == 20
    result.assert_outcomes(passed=1)
