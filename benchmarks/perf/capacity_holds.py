"""Does a capacity found on the real-time simulated engine hold when checked independently?

    python benchmarks/perf/capacity_holds.py [--seqs 32 64] [--slo p90_ttft_ms=400 ...]
    python benchmarks/perf/capacity_holds.py --check 8=9.35 64=20.1 [--slo p90_ttft_ms=400]

For each batch limit and SLO: a capacity search (`profllm bench --slo`'s code,
`load/capacity/probes.py:search_server`) against a fresh simulated server, in real time; then, for
0.8x and 1.3x the capacity found, a plain benchmark (`load/bench.py:run_bench`) with prompts no
probe sent, each against a fresh server of its own. The capacity holds when the SLO is met at
0.8x and missed at 1.3x. Qwen3-8B on the simulator's H100-SXM, 512 prompt and 64 output tokens.

With `--check SEQS=CAPACITY ...`, no search: the checks alone, of capacities found elsewhere
(a pytest session's records, on a host another program kept busy), for the first `--slo`.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from sim_server import simulator  # this folder's

from pytest_profllm.load.bench import run_bench
from pytest_profllm.load.capacity import requests_per_probe, search_server, slos_of
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig
from pytest_profllm.sim.model_files import MODEL_DIR

MODEL = "Qwen/Qwen3-8B"
WORKLOAD = {"dataset_name": "random", "random_input_len": 512, "random_output_len": 64}
SEARCH = {"over": "request_rate", "low": 2, "high": 400, "precision": 0.05, "max_probes": 12,
          "max_time_s": 1800}
CHECK_FACTORS = (0.8, 1.3)
CHECK_SECONDS = 30  # a check sends at least this long, and at least an SLO probe's requests


def fresh_server(max_num_seqs: int) -> contextlib.AbstractContextManager[str]:
    return simulator(MODEL, "--max-num-seqs", str(max_num_seqs), "--max-model-len", "4096")


def check(max_num_seqs: int, slo: str, target: float, rate: float, seed: int) -> tuple[float, str]:
    """The SLO statistic at `rate` on a fresh server with fresh prompts, and its verdict."""
    needed = requests_per_probe(slos_of({slo: target}), 200)
    config = BenchmarkConfig.model_validate({
        **WORKLOAD, "request_rate": rate, "seed": seed,
        "num_prompts": max(needed, round(rate * CHECK_SECONDS)),
    })
    with fresh_server(max_num_seqs) as url:
        done = run_bench(config, url, MODEL, tokenizer=str(MODEL_DIR))
    value = float(done.result[slo])
    verdict = "met" if value <= target else "missed"
    if done.invalid_reason:
        verdict += f" (invalid: {done.invalid_reason})"
    return value, verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--slo", nargs="+", default=["p90_ttft_ms=400", "p99_ttft_ms=400"])
    parser.add_argument("--check", nargs="+", metavar="SEQS=CAPACITY", default=[],
                        help="check these capacities (req/s) instead of searching")
    args = parser.parse_args()
    if args.check:
        check_found(args.check, args.slo[0])
        return
    print("| max_num_seqs | SLO | capacity (req/s) [bracket] | probes | search s | "
          "0.8x: value, verdict | 1.3x: value, verdict |")
    print("|---:|---|---|---:|---:|---|---|")
    for seqs in args.seqs:
        for pair in args.slo:
            name, _, bound = pair.partition("=")
            config = CapacityConfig.model_validate({
                **WORKLOAD, "kind": "capacity", "slo": {name: float(bound)}, "search": SEARCH,
                "num_prompts": 200,
            })
            started = time.monotonic()
            with fresh_server(seqs) as url:
                found = search_server(config, url, MODEL, tokenizer=str(MODEL_DIR)).found
            took = time.monotonic() - started
            if found.capacity is None:
                print(f"| {seqs} | {name} < {bound} | none ({found.limit}) | "
                      f"{len(found.probes)} | {took:.0f} | - | - |", flush=True)
                continue
            cells = []
            for index, factor in enumerate(CHECK_FACTORS):
                value, verdict = check(seqs, name, float(bound), factor * found.capacity,
                                       seed=1_000_003 + index)
                cells.append(f"{value:.0f} ms, {verdict}")
            print(f"| {seqs} | {name} < {bound} | {found.capacity:.1f} [{found.low:.1f}, "
                  f"{found.high if found.high is None else round(found.high, 1)}] | "
                  f"{len(found.probes)} | {took:.0f} | {cells[0]} | {cells[1]} |", flush=True)


def check_found(found: list[str], slo: str) -> None:
    """0.8x and 1.3x of capacities found elsewhere, each on a fresh server."""
    name, _, bound = slo.partition("=")
    print("| max_num_seqs | SLO | capacity (req/s) | 0.8x: value, verdict | 1.3x: value, verdict |")
    print("|---:|---|---:|---|---|")
    for pair in found:
        seqs, _, capacity = pair.partition("=")
        cells = []
        for index, factor in enumerate(CHECK_FACTORS):
            value, verdict = check(int(seqs), name, float(bound), factor * float(capacity),
                                   seed=1_000_003 + index)
            cells.append(f"{value:.0f} ms, {verdict}")
        print(f"| {seqs} | {name} < {bound} | {float(capacity):.2f} | {cells[0]} | {cells[1]} |",
              flush=True)


if __name__ == "__main__":
    main()
