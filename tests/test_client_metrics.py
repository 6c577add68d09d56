"""The client's own Prometheus metrics (`--profllm-metrics-port`): one endpoint for
the session, fed by every xdist worker, whose counters at the end of a case equal its record.
Shown on the simulated engine at -n 2, scraped from a hook after the last record is written
and before the session ends."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import records as records_in
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

from conftest import shared_ports, sim_processes
from pytest_profllm.load import prometheus_counters
from pytest_profllm.options import parse_metrics_port
from pytest_profllm.session import metrics_endpoint

SUITE = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [0, 1]
benchmark:
  num_prompts: 6
  random_input_len: 16
  random_output_len: 8
  max_concurrency: 2
thresholds:
  failed: {max: 1}
"""
# After the last record is written (the controller writes each as its case ends), before
# the endpoint stops (pytest_unconfigure).
SCRAPE_HOOK = """
import urllib.request
import pytest

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    port = session.config.getoption("profllm_metrics_port")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        open("scrape.txt", "wb").write(answer.read())
"""

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _ports(worker_id: str, half: int) -> tuple[str, int]:
    """50 ports of this file's block (conftest.py's `shared_ports`) and a metrics port: the
    first half for the module's session, the second for the test that runs its own."""
    block = int(shared_ports("client_metrics", worker_id).split("-")[0]) + half * 50
    return f"{block}-{block + 39}", block + 45


@pytest.fixture(scope="module")
def scraped(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, test_pool_dir: Path
) -> Iterator[tuple[Samples, dict[int, dict[str, Any]], set[tuple[str, str, tuple[str, ...]]]]]:
    folder = tmp_path_factory.mktemp("client_metrics")
    (folder / "bench_metrics.yaml").write_text(SUITE)
    (folder / "conftest.py").write_text(SCRAPE_HOOK)
    ports, metrics_port = _ports(worker_id, 0)
    env = {
        **os.environ,
        "PROFLLM_SIM_FAULTS": "close_request=3@seed=1",  # one failed request in one case
        "PROFLLM_POOL_DIR": str(test_pool_dir),
    }
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
            f"--profllm-ports={ports}", "--profllm-out=results",
            f"--profllm-metrics-port={metrics_port}", "--profllm-max-schedule-lag=1000"]
    try:
        done = subprocess.run(
            argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        leaked = sim_processes(ports)
        for process in leaked:
            process.kill()
    assert not leaked, "a server outlived the run"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families((folder / "scrape.txt").read_text()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
            labels = tuple(sorted(k for k in sample.labels if k != "le"))
            families.add((family.name, family.type, labels))
    records = {r["config"]["server"]["seed"]: r for r in records_in(folder / "results")}
    # The endpoint stopped with the session.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", metrics_port), timeout=2).close()
    yield samples, records, families


def _value(samples: Samples, name: str, case: str, **labels: str) -> float:
    return sum(
        value
        for found, value in samples.get(name, [])
        if found.get("case") == case and all(found.get(k) == v for k, v in labels.items())
    )


def test_a_cases_counters_equal_its_record(scraped: Any) -> None:
    samples, records, _ = scraped
    assert set(records) == {0, 1}
    for record in records.values():
        case, results = record["case_id"], record["results"]
        assert _value(samples, "profllm_client_requests_completed_total", case) == (
            results["completed"]
        )
        assert _value(samples, "profllm_client_requests_failed_total", case) == results["failed"]
        assert _value(samples, "profllm_client_requests_sent_total", case) == (
            results["completed"] + results["failed"]
        )
        assert _value(samples, "profllm_client_input_tokens_total", case) == (
            results["total_input_tokens"]
        )
        assert _value(samples, "profllm_client_output_tokens_total", case) == (
            results["total_output_tokens"]
        )
        assert _value(samples, "profllm_client_time_to_first_token_seconds_count", case) == (
            results["completed"]
        )
        assert _value(samples, "profllm_client_requests_in_flight", case) == 0
    # The faulty case's failure is counted under a reason.
    assert records[1]["results"]["failed"] == 1
    failed = [
        labels for labels, value in samples["profllm_client_requests_failed_total"] if value
    ]
    assert [labels["case"] for labels in failed] == [records[1]["case_id"]]
    assert failed[0]["reason"]


# Every kind of load a case runs more than once: a serve case and a conversation case each
# measured again (the schedule-lag bound is one no client meets, so every load is invalid for
# the host's sake), and a capacity search, whose probes each run (and run again) a load.
SERVER = """
server:
  model: Qwen/Qwen3-0.6B
  enable_prompt_tokens_details: true
"""
MANY_LOADS = {
    "bench_serve.yaml": "benchmark: {num_prompts: 4, random_input_len: 16, random_output_len: 4,"
    " request_rate: 40}",
    "bench_conversation.yaml": "benchmark: {backend: openai-chat, dataset_name: conversation,"
    " num_prompts: 2, conversation_turns: 3, conversation_input_len: 16,"
    " conversation_output_len: 4, conversation_think_time_s: 0, max_concurrency: 2}",
    "bench_capacity.yaml": "benchmark: {kind: capacity, num_prompts: 8, random_input_len: 16,"
    " random_output_len: 4, slo: {median_ttft_ms: 2000}, search: {over: request_rate, low: 10,"
    " high: 20, precision: 50%, max_probes: 2, min_duration_s: 0.1}}",
}


def _sent_by(record: dict[str, Any]) -> dict[str, int]:
    """What a case's loads sent, by its record: the capacity search's every run, else every
    attempt (one where it was measured once)."""
    keys = prometheus_counters.REQUEST_TOTALS
    if record.get("capacity"):
        return {key: record["capacity"]["requests_sent"][key] for key in keys}
    return {key: sum(attempt[key] for attempt in record["attempts"]) for key in keys}


def test_counters_add_up_the_loads_every_attempt_and_probe_sent(
    tmp_path: Path, worker_id: str, test_pool_dir: Path
) -> None:
    for name, benchmark in MANY_LOADS.items():
        (tmp_path / name).write_text(SERVER + benchmark + "\n")
    (tmp_path / "conftest.py").write_text(SCRAPE_HOOK)
    ports, metrics_port = _ports(worker_id, 1)
    env = {**os.environ, "PROFLLM_POOL_DIR": str(test_pool_dir)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
            f"--profllm-ports={ports}", "--profllm-out=results",
            f"--profllm-metrics-port={metrics_port}", "--profllm-max-schedule-lag=0.000001",
            "--profllm-remeasure=1"]
    try:
        done = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
            check=False,
        )
    finally:
        leaked = sim_processes(ports)
        for process in leaked:
            process.kill()
    assert not leaked, "a server outlived the run"
    assert (tmp_path / "scrape.txt").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    samples: Samples = {}
    for family in text_string_to_metric_families((tmp_path / "scrape.txt").read_text()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    records = records_in(tmp_path / "results")
    assert len(records) == 3, done.stdout[-3000:]
    kinds = set()
    for record in records:
        case, sent = record["case_id"], _sent_by(record)
        bench = record["config"]["benchmark"]
        kinds.add(f"{bench.get('kind') or 'serve'} {bench.get('dataset_name')}")
        if not record.get("capacity"):
            assert len(record["attempts"]) == 2, case  # measured again: two loads
        assert sent["completed"] > record["results"]["completed"], case  # more than the kept
        assert _value(samples, "profllm_client_requests_completed_total", case) == (
            sent["completed"]
        ), case
        assert _value(samples, "profllm_client_requests_failed_total", case) == sent["failed"]
        assert _value(samples, "profllm_client_input_tokens_total", case) == (
            sent["total_input_tokens"]
        ), case
        assert _value(samples, "profllm_client_output_tokens_total", case) == (
            sent["total_output_tokens"]
        ), case
        assert _value(samples, "profllm_client_requests_in_flight", case) == 0
    assert kinds == {"capacity random", "serve conversation", "serve random"}


def test_the_endpoints_names_and_labels(scraped: Any) -> None:
    _, records, families = scraped
    case_labels = ("case", "server", "suite")
    expected = {
        ("profllm_client_requests_sent", "counter", case_labels),
        ("profllm_client_requests_completed", "counter", case_labels),
        ("profllm_client_requests_failed", "counter", ("case", "reason", "server", "suite")),
        ("profllm_client_input_tokens", "counter", case_labels),
        ("profllm_client_output_tokens", "counter", case_labels),
        ("profllm_client_requests_in_flight", "gauge", case_labels),
        ("profllm_client_schedule_lag_seconds", "gauge", case_labels),
        ("profllm_case_stage", "gauge", ("case", "server", "stage", "suite")),
        ("profllm_client_time_to_first_token_seconds", "histogram", case_labels),
        ("profllm_client_time_per_output_token_seconds", "histogram", case_labels),
        ("profllm_client_inter_token_latency_seconds", "histogram", case_labels),
        ("profllm_client_e2e_request_latency_seconds", "histogram", case_labels),
    }
    # The live gauges go with the process that set them: scraped after the session, its
    # workers have ended (a running worker's are in test_a_killed_workers_case_leaves_its_stage).
    live = {name for name, kind, _ in expected if kind == "gauge"}
    assert {found for found in expected if found[0] not in live} <= families
    assert not live & {name for name, _, _ in families}
    samples = scraped[0]
    record = records[0]
    labels = {k: v for k, v in samples["profllm_client_requests_sent_total"][0][0].items()}
    assert labels["suite"] == record["suite"]
    # vLLM's TTFT bounds, from 1 ms to 2560 s.
    bounds = {
        found["le"] for found, _ in samples["profllm_client_time_to_first_token_seconds_bucket"]
    }
    assert {"0.001", "2560.0", "+Inf"} <= bounds and len(bounds) == 23


def test_a_taken_metrics_port_is_one_line(tmp_path: Path, test_pool_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
             f"--profllm-metrics-port={port}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "PROFLLM_POOL_DIR": str(test_pool_dir)},
        )
    assert done.returncode == 4  # pytest's usage error
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert str(port) in errors[0] and "--profllm-metrics-port" in errors[0]
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("text", ["0", "65536", "http", "-1", ""])
def test_a_metrics_port_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--profllm-metrics-port"):
        parse_metrics_port(text)


def test_a_metrics_port_parses() -> None:
    assert parse_metrics_port(" 9400 ") == 9400


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), max_size=300))
def test_a_requests_itls_land_in_the_buckets_observe_puts_them_in(samples: list[float]) -> None:
    """The per-request binning (one write per bucket) agrees with one observe() per sample."""
    bounds = prometheus_counters.INTER_TOKEN_LATENCY_BUCKETS
    one_by_one = Histogram("one_by_one", "", registry=None, buckets=bounds)
    binned = Histogram("binned", "", registry=None, buckets=bounds)
    for sample in samples:
        one_by_one.observe(sample)
    prometheus_counters._observe_many(binned, samples)
    assert [b.get() for b in binned._buckets] == [b.get() for b in one_by_one._buckets]
    assert binned._sum.get() == pytest.approx(one_by_one._sum.get())


# A process of the session in miniature: it records a case's stage and one request of a
# generation case and of a pooling case, then waits to be killed (at most 60 s).
RECORDING = """
import json, os, sys, time
from pytest_profllm.load import prometheus_counters as pc
from pytest_profllm.load.metrics import RequestOutcome
for case, pooled in (("gen", False), ("pool", True)):
    os.environ[pc.LABELS_ENV] = json.dumps({"case": case, "suite": "s", "server": "v"})
    pc.set_stage("loading")
    recorder = pc.recorder()
    recorder.sent(RequestOutcome(16))
    recorder.done(RequestOutcome(16, success=True, ttft=0.01, latency=0.2, pooled=pooled,
                                 output_tokens=None if pooled else 4, itl=[0.05] * 3))
print("ready", flush=True)
time.sleep(60)
"""


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _endpoint() -> Iterator[metrics_endpoint.MetricsEndpoint]:
    endpoint = metrics_endpoint.start("127.0.0.1", _free_port())
    try:
        yield endpoint
    finally:
        endpoint.stop(linger_s=0)


@contextlib.contextmanager
def _recording(folder: str) -> Iterator[subprocess.Popen[str]]:
    """RECORDING in a process of its own, ready; killed and reaped whatever happens."""
    process = subprocess.Popen([sys.executable, "-c", RECORDING], text=True,
                               stdout=subprocess.PIPE,
                               env={**os.environ, prometheus_counters.DIR_ENV: folder})
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_killed_workers_case_leaves_its_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    # After kill -9 of an xdist worker, /metrics showed its case in its stage (1) for the
    # rest of the session: its live gauges stayed in the folder.
    monkeypatch.delenv(prometheus_counters.DIR_ENV, raising=False)
    with _endpoint() as endpoint, _recording(endpoint.folder) as worker:
        before = _scrape(endpoint.url)
        assert _value(before, "profllm_case_stage", "gen", stage="loading") == 1
        assert {tuple(sorted(labels)) for name in ("profllm_case_stage",
                "profllm_client_requests_in_flight", "profllm_client_schedule_lag_seconds")
                for labels, _ in before[name]} == {
            ("case", "server", "stage", "suite"), ("case", "server", "suite")}
        assert _value(before, "profllm_client_requests_in_flight", "gen") == 0
        worker.kill()  # not reaped yet: a zombie, as xdist leaves a killed worker a while
        for _ in range(100):
            after = _scrape(endpoint.url)
            if not _value(after, "profllm_case_stage", "gen", stage="loading"):
                break
            time.sleep(0.1)
        assert _value(after, "profllm_case_stage", "gen", stage="loading") == 0
        # What it counted stays counted.
        assert _value(after, "profllm_client_requests_completed_total", "gen") == 1
        assert not (Path(endpoint.folder) / f"process_{worker.pid}.json").exists()
    # The folder's process notes tell a later process given the pid from the one that wrote.
    folder = tempfile.mkdtemp()
    try:
        (Path(folder) / f"gauge_livemax_{os.getpid()}.db").write_bytes(b"")
        (Path(folder) / prometheus_counters.process_file_name(os.getpid())).write_text(
            json.dumps({"started": psutil.Process().create_time() - 3600.0}))
        assert metrics_endpoint.drop_dead_processes(folder) == [os.getpid()]
        assert os.listdir(folder) == []
    finally:
        shutil.rmtree(folder)


def test_a_pooling_case_has_no_token_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pooling request has no first token (its record has no TTFT): no TTFT series.
    monkeypatch.delenv(prometheus_counters.DIR_ENV, raising=False)
    with _endpoint() as endpoint, _recording(endpoint.folder):
        samples = _scrape(endpoint.url)
    for name in ("time_to_first_token", "time_per_output_token", "inter_token_latency"):
        series = {labels["case"] for labels, _ in samples[f"profllm_client_{name}_seconds_count"]}
        assert series == {"gen"}, name
    assert _value(samples, "profllm_client_e2e_request_latency_seconds_count", "pool") == 1


def test_the_endpoint_waits_for_a_scrape_that_missed_the_finals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The endpoint closed as the session ended: a scraper never saw the last cases' finals.
    monkeypatch.delenv(prometheus_counters.DIR_ENV, raising=False)
    endpoint = metrics_endpoint.start("127.0.0.1", _free_port())
    scraped: list[Samples] = []
    try:
        _scrape(endpoint.url)  # a scraper is there; then the last case ends
        with _recording(endpoint.folder):
            pass
        stopper = threading.Thread(target=endpoint.stop, kwargs={"linger_s": 60.0})
        started = time.monotonic()
        stopper.start()
        time.sleep(0.2)
        assert stopper.is_alive()  # lingering
        scraped.append(_scrape(endpoint.url))
        stopper.join(30)
        assert not stopper.is_alive() and time.monotonic() - started < 30
    finally:
        endpoint.stop(linger_s=0)
    assert _value(scraped[0], "profllm_client_requests_completed_total", "gen") == 1
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=2).close()
    # A scraper that saw the finals, or none at all: the endpoint stops at once; one that
    # missed them and does not come back is waited for linger_s at most.
    for scrape_last, linger_s in ((True, 60.0), (None, 60.0), (False, 0.3)):
        endpoint = metrics_endpoint.start("127.0.0.1", _free_port())
        try:
            if scrape_last is not None:
                _scrape(endpoint.url)
            with _recording(endpoint.folder):
                pass
            if scrape_last:
                _scrape(endpoint.url)
            started = time.monotonic()
            endpoint.stop(linger_s=linger_s)
            assert time.monotonic() - started < 10, (scrape_last, linger_s)
        finally:
            endpoint.stop(linger_s=0)
