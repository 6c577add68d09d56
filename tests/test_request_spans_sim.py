"""Each request's own story on the simulated engine: the spans it exports agree with its own
request log, and a suite run with --profllm-trace-requests (or by default: auto traces the
simulated engine) joins them to its request rows."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from pathlib import Path

import pytest
from helpers import assert_invalid, run_records, run_suites, simulator

from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.load.trace_join import take_spans


def test_the_simulators_spans_tell_what_its_request_log_does(
    port_range: str, tmp_path: Path
) -> None:
    log = tmp_path / "emissions.jsonl"
    env = {**os.environ, "PROFLLM_SIM_EMISSION_LOG": str(log), "OTEL_BSP_SCHEDULE_DELAY": "50"}
    first = int(port_range.split("-")[0]) + 50
    with SpanReceiver() as receiver, simulator(
        first, tmp_path / "sim.log", "sim", "--otlp-traces-endpoint", receiver.url, env=env
    ) as url:
        key = receiver.expect()
        settings = LoadSettings(base_url=url, model="sim", request_rate=200.0, trace_key=key)
        prompts = [PromptRequest(prompt="hello there " * 4, prompt_len=9, output_len=3 + i % 4)
                   for i in range(12)]
        load = asyncio.run(run_load(settings, prompts))
        joined = take_spans(receiver, key, load.outcomes, wait_s=5)
    assert joined.figures["server_spans_joined_share"] == 1.0
    timelines = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        timelines[entry["request_id"]] = entry["timeline"]
    for index, (row, outcome) in enumerate(zip(joined.rows, load.outcomes, strict=True)):
        t = timelines[f"profllm-{index}"]
        assert row["trace_id"] == outcome.trace_id
        expected = {
            "server_ttft_ms": t["first_token"] - t["arrived"],
            "server_e2el_ms": t["last_token"] - t["arrived"],
            "server_queue_ms": t["scheduled"] - t["queued"],
            "server_prefill_ms": t["first_token"] - t["scheduled"],
            "server_decode_ms": t["last_token"] - t["first_token"],
            "server_inference_ms": t["last_token"] - t["scheduled"],
        }
        for name, seconds in expected.items():
            assert row[name] == pytest.approx(seconds * 1000, abs=1e-6), name
        assert row["server_completion_tokens"] == outcome.output_tokens == 3 + index % 4
        # The client's clock runs around the server's.
        assert row["client_overhead_ttft_ms"] > -1.0
        assert row["client_overhead_e2el_ms"] > -1.0
    assert receiver.counts.refused_malformed == receiver.counts.refused_too_large == 0


SUITE = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 40
  random_input_len: 32
  random_output_len: 4
  request_rate: 80
"""


def test_a_traced_suite_joins_every_requests_span_to_its_row(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_spans=SUITE)
    result = run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    system, results, view = record["system"], record["results"], record["server_view"]
    assert view["server_spans_joined_share"] >= 0.99
    assert view["spans_problem"] is None
    assert record["validity"] == "valid", record["validity_reasons"]
    with gzip.open(pytester.path / "results" / f"{record['run_id']}.requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f]
    ttfts = [row["server_ttft_ms"] for row in rows if row["server_ttft_ms"] is not None]
    assert len(ttfts) >= 0.99 * len(rows) == 0.99 * 40
    # The spans' mean is the server's /metrics mean over the same window.
    assert sum(ttfts) / len(ttfts) == pytest.approx(system["server_ttft_mean_ms"], rel=0.01)
    p50, p99 = results["client_overhead_ttft_p50_ms"], results["client_overhead_ttft_p99_ms"]
    assert -1.0 < p50 <= p99
    print(f"joined {view['server_spans_joined_share']:.3f}, span mean TTFT "
          f"{sum(ttfts) / len(ttfts):.3f} ms, /metrics mean {system['server_ttft_mean_ms']:.3f}, "
          f"client overhead p50 {p50:.3f} ms, p99 {p99:.3f} ms")


def test_a_default_run_traces_the_simulated_engine(
    pytester: pytest.Pytester, ports: str
) -> None:
    # --profllm-trace-requests auto (the default): the simulated engine's servers are traced,
    # and its spans are awaited only until they are in (it sends them as it goes idle).
    suite = SUITE.replace("num_prompts: 40", "num_prompts: 8")
    pytester.makefile(".yaml", bench_spans=suite)
    run_suites(pytester, ports, "-n", "0").assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    view = record["server_view"]
    assert view["server_spans_joined_share"] == 1.0
    assert view["spans_problem"] is None
    assert view["span_receiver"]["spans_kept"] == 8
    assert record["results"]["client_overhead_ttft_p99_ms"] is not None
    with gzip.open(pytester.path / "results" / f"{record['run_id']}.requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f]
    assert all(row["server_ttft_ms"] is not None for row in rows)


def test_untraced_rows_say_why(pytester: pytest.Pytester, ports: str) -> None:
    suite = SUITE.replace("num_prompts: 40", "num_prompts: 4")
    pytester.makefile(".yaml", bench_spans=suite)
    run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests=off").assert_outcomes(
        passed=1
    )
    (record,) = run_records(pytester)
    assert record["server_view"]["spans_problem"] == (
        "not traced: --profllm-trace-requests is off"
    )
    assert record["server_view"]["server_spans_joined_share"] is None
    assert record["results"].get("client_overhead_ttft_p99_ms") is None


# A client stalled on purpose, as a host that starves it would: while the load runs, its
# event loop is blocked for 250 ms out of every 300 (time.sleep in a task beside the load),
# so the requests in flight then wait for their first token's bytes. A CPU hog on the
# client's core was measured too (benchmarks/perf/client_overhead_tail.py), and on a busy
# host its effect overlaps the quiet runs', so it would make a flaky test: this stall is
# the same wherever the test runs.
STALLED_CLIENT = """
import asyncio
import time

from pytest_profllm.run import serve

_real = serve.run_load


async def _stalled(settings, prompts):
    async def stall():
        while True:
            await asyncio.sleep(0.05)
            time.sleep(0.25)

    task = asyncio.ensure_future(stall())
    try:
        return await _real(settings, prompts)
    finally:
        task.cancel()


serve.run_load = _stalled
"""


def test_a_client_made_tail_is_measured_again_then_invalid(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(STALLED_CLIENT)
    pytester.makefile(".yaml", bench_spans=SUITE)
    # The mean's bound set out of reach: what makes the case invalid is its tail.
    result = run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests",
                        "--profllm-remeasure", "1", "--profllm-max-client-overhead", "100000",
                        "--profllm-max-client-overhead-tail",
                        f"{DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS:g}")
    assert_invalid(result, 1)
    (record,) = run_records(pytester)
    assert record["server_view"]["server_spans_joined_share"] >= 0.99
    assert len(record["attempts"]) == 2  # host-caused: measured once again
    assert record["results"]["client_overhead_ttft_p99_ms"] > DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS
    (why,) = record["validity_reasons"]
    assert why.count("to a request's TTFT at p99") == 2 and "mean TTFT" not in why


def test_the_tails_bound_is_the_sessions_to_set(pytester: pytest.Pytester, ports: str) -> None:
    """The same stalled client, both bounds set out of reach: a valid case."""
    pytester.makeconftest(STALLED_CLIENT)
    pytester.makefile(".yaml", bench_spans=SUITE.replace("num_prompts: 40", "num_prompts: 20"))
    result = run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests",
                        "--profllm-max-client-overhead", "100000",
                        "--profllm-max-client-overhead-tail", "100000")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["validity"] == "valid"
    assert record["results"]["client_overhead_ttft_p99_ms"] > DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS


POOLING = """
server:
  model: Qwen/Qwen3-Embedding-0.6B
  runner: pooling
benchmark:
  backend: openai-embeddings
  num_prompts: 24
  random_input_len: 32
  random_batch_size: 3
  max_concurrency: 4
"""


def test_a_pooling_requests_inputs_each_export_a_span_of_its_trace(
    pytester: pytest.Pytester, ports: str
) -> None:
    """As vLLM runs each input of an embeddings request as an engine request of its own, the
    simulator exports a span per input, all of the request's trace id: the request's row
    gets the span that ended last (the request's end), the others count as duplicates."""
    pytester.makefile(".yaml", bench_pooled=POOLING)
    result = run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    view = record["server_view"]
    assert view["server_spans_joined_share"] == 1.0 and view["spans_problem"] is None
    counts = view["span_receiver"]
    assert counts["spans_kept"] == 8 and counts["spans_duplicate"] == 16
    assert counts["refused_malformed"] == counts["refused_too_large"] == 0
    with gzip.open(pytester.path / "results" / f"{record['run_id']}.requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 8
    for row in rows:
        assert row["server_completion_tokens"] == 0
        assert row["client_overhead_ttft_ms"] is None  # a pooling request has no TTFT
        # The request's whole time holds its last input's: the client's clock around it.
        assert row["client_overhead_e2el_ms"] > -1.0
    assert record["results"]["client_overhead_e2el_p50_ms"] is not None


# A malformed and an oversized export sent to the session's receiver while the case's load
# runs (as its spans are awaited): the record counts them, and the case's spans still join.
JUNK_EXPORTS = """
import gzip
import urllib.error
import urllib.request

from pytest_profllm.run import serve

_real = serve.take_spans


def _post(url, body, headers):
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=10).read()
    except urllib.error.HTTPError:
        pass


def _with_junk(receiver, key, outcomes, *args, **kwargs):
    if receiver is not None:
        protobuf = {"Content-Type": "application/x-protobuf"}
        _post(receiver.url, b"\\x0a\\xff\\xff no export", protobuf)
        _post(receiver.url, gzip.compress(b"\\0" * (receiver.max_body_bytes + 1)),
              {"Content-Encoding": "gzip"})
    return _real(receiver, key, outcomes, *args, **kwargs)


serve.take_spans = _with_junk
"""


def test_refused_exports_are_counted_in_the_record(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makeconftest(JUNK_EXPORTS)
    pytester.makefile(".yaml", bench_spans=SUITE.replace("num_prompts: 40", "num_prompts: 10"))
    result = run_suites(pytester, ports, "-n", "0", "--profllm-trace-requests")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    counts = record["server_view"]["span_receiver"]
    assert counts["refused_malformed"] == 1 and counts["refused_too_large"] == 1
    assert counts["spans_kept"] == 10 and counts["exports"] >= 1
    assert counts["spans_received"] == (counts["spans_kept"] + counts["spans_unexpected"]
                                        + counts["spans_over_limit"] + counts["spans_duplicate"])
    assert record["server_view"]["server_spans_joined_share"] == 1.0
