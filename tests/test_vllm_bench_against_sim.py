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

pytestmark = [pytest.mark.vllm_python, needs_vllm_python]


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


def test_vllm_replays_a_timed_trace_as_we_do(sim_url: str, tmp_path: Path) -> None:
    """vLLM's parser takes our rendered timed_trace options, and its client sends what ours
    sends for the same trace: as many requests, of the same lengths, sharing as much."""
    from test_trace import _prefix_counters

    from pytest_profllm.load.bench import run_bench
    from pytest_profllm.load.vllm_command import vllm_bench_serve_argv
    from pytest_profllm.plan.suite import BenchmarkConfig

    # Spaced so each request ends before the next starts: sharing, not timing, sets the hits.
    lines = [
        {"ts": 250 * i, "in": 16 * (2 + i % 3) - i % 5, "out": 2 + i % 3,
         "ids": [100 + i % 2, 200 + i % 3, 300 + i, 400 + i][: 2 + i % 3]}
        for i in range(12)
    ]  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = BenchmarkConfig(
        dataset_name="timed_trace", dataset_path=str(trace), num_prompts=len(lines),
        timed_trace_sec_multiplier=0.001, timed_trace_label_timestamp="ts",
        timed_trace_label_input_length="in", timed_trace_label_output_length="out",
        timed_trace_label_hash_ids="ids",
    )  # fmt: skip
    argv = [
        VLLM_PYTHON, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        *vllm_bench_serve_argv(config, base_url=sim_url, model="sim", tokenizer=str(MODEL_DIR)),
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "vllm.json",
    ]  # fmt: skip
    before = _prefix_counters(sim_url)
    done = subprocess.run(
        argv, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    assert done.returncode == 0, tail
    theirs = json.loads((tmp_path / "vllm.json").read_text())
    middle = _prefix_counters(sim_url)
    ours = run_bench(config, sim_url, "sim", tokenizer=str(MODEL_DIR), save_detailed=True).result
    after = _prefix_counters(sim_url)
    assert theirs["completed"] == ours["completed"] == len(lines), tail
    assert theirs["input_lens"] == ours["input_lens"] == [line["in"] for line in lines]
    assert theirs["output_lens"] == ours["output_lens"] == [line["out"] for line in lines]
    # The same sharing: the prefix cache found as many tokens for each client's requests.
    assert middle[1] - before[1] == after[1] - middle[1] > 0


def test_vllm_bench_serve_runs_our_even_lora_mix_on_the_simulators_adapters(
    port_range: str, tmp_path: Path
) -> None:
    """An evenly weighted `lora_mix` is vLLM's `--lora-modules ... --lora-assignment`: its
    client takes our argv and the simulator serves each adapter it names."""
    from helpers import simulator

    from pytest_profllm.load.vllm_command import unrendered, vllm_bench_serve_argv
    from pytest_profllm.plan.suite import BenchmarkConfig

    config = BenchmarkConfig(
        num_prompts=NUM_PROMPTS, random_input_len=32, random_output_len=4,
        lora_mix={"a": 1, "b": 1, "c": 1}, lora_assignment="round_robin",
    )  # fmt: skip
    assert unrendered(config) == []
    assert unrendered(config.model_copy(update={"lora_mix": {"a": 2, "b": 1}})) == ["lora_mix"]
    first = int(port_range.split("-")[0]) + 80
    server = ("sim", "--enable-lora", "--lora-modules", "a=/a", "b=/b", "c=/c", "--max-loras", "2")
    with simulator(first, tmp_path / "sim.log", *server) as url:
        argv = vllm_bench_serve_argv(config, base_url=url, model="sim", tokenizer=str(MODEL_DIR))
        assert argv[argv.index("--lora-modules"):][:6] == [
            "--lora-modules", "a", "b", "c", "--lora-assignment", "round-robin"
        ]
        done = subprocess.run(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv,
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "lora.json"],
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    assert done.returncode == 0, tail
    result = json.loads((tmp_path / "lora.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), tail
