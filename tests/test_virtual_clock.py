"""`--profllm-sim-clock virtual`: simulated cases run in-process on the virtual clock (no server,
no port), under -n 2; their records say so, and the gate never compares them with real-time
runs. A capacity case searches on it and keeps its bracket; workloads it does not model are
skipped with one line."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import pytest
from helpers import cases_of, run_records, run_suites, write_suite
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.load.bench import measure
from pytest_profllm.load.conversation import Conversations
from pytest_profllm.load.prompt import Codec
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.run.serve import codec_for
from pytest_profllm.run.virtual import VirtualEngine, virtual_prompts

SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [4, 16]
  max_model_len: 2048
benchmark:
  num_prompts: 40
  random_input_len: 200
  random_output_len: 20
  request_rate: [10, inf]
  max_concurrency: 16
thresholds:
  completed: {min: 40}
"""

CAPACITY = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: 8
  max_model_len: 2048
benchmark:
  kind: capacity
  num_prompts: 200
  random_input_len: 256
  random_output_len: 32
  slo: {p90_ttft_ms: 300, median_tpot_ms: 20}
  search: {low: 2, high: 200, precision: 10%, min_duration_s: 3}
"""


def test_a_suite_on_the_virtual_clock(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_v=SUITE)
    result = run_suites(pytester, ports, "-n", "2", "--profllm-engine", "sim",
                        "--profllm-sim-clock", "virtual", cache=False)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*engine: sim (--profllm-sim-clock virtual*"])
    records = run_records(pytester)
    assert len(records) == 4
    for record in records:
        assert record["engine"]["clock"] == "virtual"
        assert record["status"] == "passed" and record["validity"] == "valid"
        assert "no server" in record["server_view"]["problem"]
        # No server was started: no port, no process, no log.
        runtime = record["runtime"]
        assert runtime["port"] is None and runtime["server_pid"] is None
        assert runtime["server_log"] is None
        results = record["results"]
        assert results["completed"] == 40 and results["failed"] == 0
        assert results["total_input_tokens"] > 0 and results["total_output_tokens"] == 40 * 20
        assert results["request_throughput"] > 0 and results["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < results[f"median_{metric}_ms"] <= results[f"p99_{metric}_ms"]
        assert results["median_ttft_ms"] < results["median_e2el_ms"]
        # What a virtual run does not have is null, never made up.
        system = record["system"]
        assert system["mean_gpu_utilization"] is None and system["peak_server_rss_mib"] is None
        assert results["client_cpu_percent"] is None
        assert system["sim_steps"] > 0
        # The KV cache the engine model sized, as a server's /metrics would say it.
        assert system["server_kv_block_size"] == 16 and system["server_num_gpu_blocks"] > 0
        assert system["server_kv_cache_tokens"] == 16 * system["server_num_gpu_blocks"]
    # Under the burst, the larger batch limit carries more: the engine model decides.
    burst = {r["config"]["server"]["max_num_seqs"]: r["results"] for r in records
             if r["config"]["benchmark"]["request_rate"] == "inf"}
    assert burst[16]["output_throughput"] > burst[4]["output_throughput"]
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = set(db.execute("SELECT engine_clock, device FROM benchmark_runs"))
    # The device column keeps predictions apart from the real-time simulator's `virtual`
    # rows on every dashboard, and names the GPU modelled.
    assert rows == {("virtual", "virtual clock: H100-SXM")}


def test_the_fingerprint_keeps_virtual_and_real_apart() -> None:
    record: dict[str, Any] = {
        "engine": {"name": "sim", "version": "0.1.0", "clock": "real"},
        "config": {"server": {"model": "m"}, "benchmark": {"num_prompts": 4}},
        "system": {}, "runtime": {},
    }
    virtual = copy.deepcopy(record)
    virtual["engine"]["clock"] = "virtual"
    before = copy.deepcopy(record)
    del before["engine"]["clock"]  # a record written before the clock was recorded
    assert digests(virtual)[0] != digests(record)[0]
    assert digests(virtual)[1] != digests(record)[1]  # also with any engine version
    assert digests(record) == digests(before)  # real-time runs keep their baselines


def test_a_capacity_case_on_the_virtual_clock(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_cap=CAPACITY)
    result = run_suites(pytester, ports, "--profllm-sim-clock", "virtual", cache=False)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    search = record["capacity"]
    low, high = search["bracket"]
    assert record["engine"]["clock"] == "virtual" and record["validity"] == "valid"
    assert low is not None and high is not None and low < high <= low * 1.1 + 1e-9
    assert record["results"]["capacity"] == search["capacity"] == low
    assert search["limit"] in ("p90_ttft_ms", "median_tpot_ms")
    assert search["recheck"]["decision"] != "misses"
    # p90 needs 200 requests a probe; each probe is a run of the engine model.
    assert all(p["requests"] >= 200 for p in search["probes"])
    assert record["results"]["completed"] >= 200


def test_workloads_it_does_not_model_are_skipped(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_skip="""
        server: {model: Qwen/Qwen3-8B}
        benchmark:
          dataset_name: conversation
          backend: openai-chat
          num_prompts: 4
        """, bench_acc="""
        server: {model: Qwen/Qwen3-8B, enable_tokenizer_info_endpoint: true}
        benchmark: {kind: accuracy, task: profllm_arithmetic_mc, limit: 4}
        """, bench_chat="""
        server: {model: Qwen/Qwen3-8B}
        benchmark:
          backend: openai-chat
          num_prompts: 4
          random_input_len: 32
          random_output_len: 4
        """)
    result = run_suites(pytester, ports, "--profllm-sim-clock", "virtual", "-rs", cache=False)
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*--profllm-sim-clock virtual: conversations*not modelled*"])
    # Before: the accuracy case ran lm-eval against a server that was never started.
    result.stdout.fnmatch_lines(["*--profllm-sim-clock virtual: an accuracy case asks a "
                                 "server for answers*"])
    assert "Traceback" not in result.stdout.str()


def test_virtual_clock_with_vllm_is_a_usage_error(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_x=SUITE)
    result = run_suites(pytester, ports, "--profllm-engine", "vllm",
                        "--profllm-sim-clock", "virtual", cache=False)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--profllm-sim-clock virtual*cannot be used with "
                                 "--profllm-engine vllm*"])


def test_a_bad_ini_clock_is_a_usage_error(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_x=SUITE)
    pytester.makeini("[pytest]\nprofllm_sim_clock = fast\n")
    result = run_suites(pytester, ports, cache=False)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option profllm_sim_clock: 'fast' is not one of real, "
                                 "virtual*"])


@functools.cache
def _engine(max_num_seqs: int) -> tuple[VirtualEngine, BenchmarkConfig, Codec]:
    with tempfile.TemporaryDirectory() as folder:
        path = write_suite(Path(folder), f"""
            server: {{model: Qwen/Qwen3-8B, max_num_seqs: {max_num_seqs}, max_model_len: 4096}}
            benchmark: {{num_prompts: 4, random_input_len: 16, random_output_len: 4}}
            """)
        (case,) = cases_of(path)
    assert isinstance(case.benchmark, BenchmarkConfig)
    return VirtualEngine.of(case, None), case.benchmark, codec_for(case, "sim", "")


@settings(max_examples=40, deadline=None)
@given(
    max_num_seqs=st.sampled_from([1, 4, 32]),
    num_prompts=st.integers(1, 40),
    input_len=st.integers(1, 600),
    output_len=st.integers(1, 48),
    rate=st.sampled_from([math.inf, 2.0, 20.0, 200.0]),
    concurrency=st.one_of(st.none(), st.integers(1, 16)),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_virtual_load_is_what_the_client_would_measure(
    max_num_seqs: int, num_prompts: int, input_len: int, output_len: int, rate: float,
    concurrency: int | None, seed: int,
) -> None:
    """Whatever the suite's workload, every request is answered once, in order of its own
    times, with the tokens asked for, never before its schedule sends it and never more at
    once than max_concurrency; and the figures come out as the client computes them."""
    engine, base, codec = _engine(max_num_seqs)
    bench = base.model_copy(update={
        "num_prompts": num_prompts, "random_input_len": input_len,
        "random_output_len": output_len, "request_rate": rate, "max_concurrency": concurrency,
        "seed": seed, "random_range_ratio": 0.5,
    })
    prompts = virtual_prompts(bench, codec, None)
    assert not isinstance(prompts, Conversations)
    load, _ = engine.run(prompts, bench, codec)
    assert len(load.outcomes) == num_prompts
    for prompt, outcome in zip(prompts, load.outcomes, strict=True):
        assert outcome.success and outcome.status == 200
        assert outcome.output_tokens == prompt.output_len
        assert outcome.prompt_len == prompt.prompt_len
        assert outcome.start_time >= outcome.intended_start
        assert 0 < outcome.ttft <= outcome.latency
        assert len(outcome.itl) == prompt.output_len - 1
        assert outcome.end_time <= load.duration + 1e-9
    if concurrency is not None:
        events = sorted([(o.start_time, 1) for o in load.outcomes]
                        + [(o.end_time, -1) for o in load.outcomes], key=lambda e: (e[0], e[1]))
        assert max(itertools.accumulate(step for _, step in events)) <= concurrency
    results, _ = measure(load, bench, codec)
    assert results["completed"] == num_prompts and results["failed"] == 0
    assert results["total_output_tokens"] == sum(p.output_len for p in prompts)
    assert results["median_e2el_ms"] >= results["median_ttft_ms"] > 0
