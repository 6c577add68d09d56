"""Does a case that shares its server measure what a fresh server would?

    python benchmarks/perf/cold_cache.py [--engine sim|vllm] [--vllm-python PATH]

A suite of two `random` workloads (2,048 and 1,536 prompt tokens: with one seed the shorter
prompts would be prefixes of the longer) x `repeat: 3` at 8 req/s runs on one server with
prefix caching on (the default). Then each of its six cases runs again alone, on a fresh
server of its own (a server argument that changes nothing, `seed`, makes each configuration
another server), with the same prompts (the seed the shared case drew). Printed per case: the
median TTFT on the shared and on the fresh server, their difference, and the share of prompt
tokens the shared case found in the cache. `--engine vllm` runs vLLM's CPU build on a tiny
random-weight Llama (shorter prompts: 384 and 288 tokens, 2 req/s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run(folder: Path, suites: dict[str, str], args: list[str]) -> list[dict[str, Any]]:
    for name, text in suites.items():
        (folder / name).write_text(text)
    out = folder / "results"
    subprocess.run(
        [sys.executable, "-m", "pytest", str(folder), "-p", "no:cacheprovider", "-q",
         f"--profllm-out={out}", *args],
        cwd=folder, check=False, stdout=subprocess.DEVNULL,
    )
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    for path in folder.glob("bench_*.yaml"):
        path.unlink()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--vllm-python")
    args = parser.parse_args()
    extra = ["--profllm-engine", args.engine]
    if args.engine == "vllm":
        sys.path.insert(0, str(REPO / "tests"))
        import os

        from real_vllm import server_env, tiny_llama  # the tests' tiny model and environment

        if not args.vllm_python:
            raise SystemExit("--engine vllm needs --vllm-python (.ci/vllm-env.sh serve builds one)")
        os.environ.setdefault("PROFLLM_VLLM_CPU_PYTHON", args.vllm_python)
        work = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
        os.environ.update(server_env(work / "vllm-cache"))  # KV cache space, cache root
        model = tiny_llama(work / "model")
        server = f"  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n"
        lengths, rate, prompts = "[384, 288]", 2, 16
        extra += [f"--profllm-vllm-python={args.vllm_python}", "--profllm-startup-timeout=600"]
    else:
        server = "  model: Qwen/Qwen3-8B\n  max_model_len: 4096\n"
        lengths, rate, prompts = "[2048, 1536]", 8, 48
    workload = (f"  random_output_len: 32\n  num_prompts: {prompts}\n"
                f"  request_rate: {rate}\n")
    shared = run(
        Path(tempfile.mkdtemp(prefix="cold-cache-shared-")),
        {"bench_shared.yaml": f"server:\n{server}benchmark:\n  random_input_len: {lengths}\n"
         f"{workload}repeat: 3\n"},
        extra,
    )
    fresh_suites = {}
    for index, record in enumerate(shared):
        length = record["config"]["benchmark"]["random_input_len"]
        seed = record["runtime"]["prompt_seed"]
        fresh_suites[f"bench_fresh{index}.yaml"] = (
            f"server:\n{server}  seed: {1000 + index}\nbenchmark:\n"
            f"  random_input_len: {length}\n  seed: {seed}\n{workload}"
        )
    fresh = run(Path(tempfile.mkdtemp(prefix="cold-cache-fresh-")), fresh_suites, extra)
    fresh_by_seed = {r["runtime"]["prompt_seed"]: r for r in fresh}
    print(f"engine: {args.engine}")
    print("| case | shared: median TTFT ms | fresh: median TTFT ms | difference | "
          "cache hits (shared) | validity (shared) |")
    print("|---|---:|---:|---:|---:|---|")
    for record in shared:
        other = fresh_by_seed.get(record["runtime"]["prompt_seed"])
        mine = record["results"].get("median_ttft_ms")
        theirs = other["results"].get("median_ttft_ms") if other else None
        change = f"{(mine / theirs - 1):+.1%}" if mine and theirs else "-"
        hits = record["system"].get("server_prefix_cache_hit_rate")
        print(f"| {record['case_id']} | {mine or 0:.1f} | {theirs or 0:.1f} | {change} | "
              f"{'-' if hits is None else f'{hits:.1%}'} | {record['validity']} |")


if __name__ == "__main__":
    main()
