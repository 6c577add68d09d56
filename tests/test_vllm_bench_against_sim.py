"""vLLM's own client, `vllm bench serve` (0.33.0), completes every request against the
simulated engine, on the completions and the chat endpoint, with the shipped model folder as
its tokenizer.

vLLM runs in a Python of its own, named by PROFLLM_VLLM_PYTHON (`.ci/run` sets it); without
one these tests are skipped and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import VLLM_PYTHON, needs_vllm_python

from pytest_profllm.sim.model_files import MODEL_DIR

NUM_PROMPTS = 12

pytestmark = needs_vllm_python


@pytest.mark.parametrize(
    "backend",
    [["--backend", "vllm"], ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]],
    ids=["completions", "chat"],
)
def test_vllm_bench_serve_completes_every_request(
    sim_url: str, tmp_path: Path, backend: list[str]
) -> None:
    argv = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *backend,
        "--base-url", sim_url, "--model", "sim", "--tokenizer", str(MODEL_DIR),
        "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--seed", "1",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    assert done.returncode == 0, tail
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == NUM_PROMPTS, tail
    assert result["failed"] == 0, tail
    assert result["total_output_tokens"] == NUM_PROMPTS * 16
    assert result["median_ttft_ms"] > 0 and result["median_tpot_ms"] > 0
