"""Each request's own story on real vLLM: a case on vLLM's CPU build with
--profllm-trace-requests. vLLM exports an `llm_request` span per finished request to the
session's receiver (load/span_receiver.py), the case joins nearly every one to its request
row (load/trace_join.py), and the spans' TTFTs are the very values vLLM's `/metrics` TTFT
histogram observed over the load: their mean is the histogram's sum/count over the window.

Marked `real_vllm`: skipped (one line) without PROFLLM_VLLM_CPU_PYTHON.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import run_records
from real_vllm import (
    plugin_run_on_vllm,
    require_vllm_cpu_python,
    shared_tiny_llama,
)

pytestmark = pytest.mark.real_vllm


@pytest.fixture
def vllm_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """The tiny Llama, and a plugin run's environment on vllm-cpu; no process working in the
    run's folder outlives the test (a leftover fails it)."""
    require_vllm_cpu_python()
    model = shared_tiny_llama(tmp_path_factory)
    with plugin_run_on_vllm(pytester.path, monkeypatch, tmp_path):
        yield model


def test_vllm_exports_a_span_per_request_that_its_histograms_agree_with(
    pytester: pytest.Pytester, ports: str, vllm_run: Path
) -> None:
    model = vllm_run
    pytester.makefile(".yaml", bench_traced=(
        f"server:\n  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n"
        "  max_num_seqs: 8\n"
        "benchmark:\n  num_prompts: 60\n  random_input_len: 32\n  random_output_len: 8\n"
        "  ignore_eos: true\n  request_rate: 20\n"
    ))
    python = require_vllm_cpu_python()
    result = pytester.runpytest_subprocess(
        f"--profllm-vllm-python={python}", "--profllm-engine=vllm", f"--profllm-ports={ports}",
        "--profllm-out=results", "--profllm-startup-timeout=600", "-p", "no:cacheprovider",
        "-n", "0", "--profllm-trace-requests", "--profllm-max-client-overhead=100000",
        "--profllm-max-client-overhead-tail=100000", timeout=900,
    )
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    system, results, view = record["system"], record["results"], record["server_view"]
    assert view["spans_problem"] is None, view["spans_problem"]
    share = view["server_spans_joined_share"]
    assert share >= 0.99
    with gzip.open(pytester.path / "results" / f"{record['run_id']}.requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == results["completed"] == 60
    ttfts = [row["server_ttft_ms"] for row in rows if row["server_ttft_ms"] is not None]
    assert len(ttfts) >= 0.99 * len(rows)
    # vLLM's span carries the request's first_token_latency, the value its TTFT histogram
    # observed: the same requests' mean, as the histogram's sum/count over the load.
    span_mean = sum(ttfts) / len(ttfts)
    metrics_mean = system["server_ttft_mean_ms"]
    assert span_mean == pytest.approx(metrics_mean, rel=0.01)
    assert all(row["server_completion_tokens"] == 8 for row in rows)
    assert all(row["client_overhead_ttft_ms"] > -1.0 for row in rows)
    counts = view["span_receiver"]
    assert counts["spans_kept"] >= 0.99 * 60
    assert counts["refused_malformed"] == counts["refused_too_large"] == 0
    print(f"real vLLM: joined {share:.3f}, span mean TTFT {span_mean:.3f} ms, /metrics mean "
          f"{metrics_mean:.3f} ms ({(span_mean / metrics_mean - 1) * 100:+.3f} %), client "
          f"overhead p50 {results['client_overhead_ttft_p50_ms']:.3f} ms, p99 "
          f"{results['client_overhead_ttft_p99_ms']:.3f} ms; receiver {counts}")
