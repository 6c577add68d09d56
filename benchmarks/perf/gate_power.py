"""How trustworthy the regression gate is on the simulated engine: false alarms on unchanged
runs, detection of known slowdowns (PROFLLM_SIM_SLOWDOWN), over many seeds, at the gate's
default settings (tolerance, confidence level, resamples: gates/spec.py).

    python benchmarks/perf/gate_power.py [--seeds 20] [--num-prompts 10,20] [--repeats 2,3]
                                         [--slowdowns 1.05,1.1,1.15]

For each seed, a baseline of R repeats runs on one simulator (slowdown 1.00), then the same
workload with another seed on a simulator slowed by each factor, and last on a fresh
unslowed simulator (the unchanged case, furthest in time from its baseline, as a later CI
run is). One simulator per slowdown serves every seed and configuration; each starts with one
discarded warm-up run. Every run's verdicts are those a suite with `repeat: R` and the gated
metrics below would get. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import requests

from pytest_profllm.gates.samples import RunSamples, latencies_from_requests
from pytest_profllm.gates.verdict import GateSettings, judge
from pytest_profllm.load.bench import load_settings, measure, run_load
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.plan.regression import (
    DEFAULT_CONFIDENCE,
    DEFAULT_LATENCY_TOLERANCE,
    DEFAULT_RESAMPLES,
    DEFAULT_TOLERANCE,
    gated_metric,
    parse_regression,
)
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.run.outcome import request_row
from pytest_profllm.sim.model_files import MODEL_DIR

# Gated as a suite would (default tolerances); a seed counts once whichever metric flags it.
GATED = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_e2el_ms", "mean_e2el_ms")
# Prefill-heavy, as an 8B model's batch of 512-token prompts is: the simulator's step times
# (what PROFLLM_SIM_SLOWDOWN multiplies) then outweigh its own per-step CPU overhead, which a
# shared host makes noisy. Prefix caching off: every repeat sends the same prompts.
WORKLOAD = {"random_input_len": 512, "random_output_len": 16, "request_rate": "inf"}
SERVER_ARGS = ["--max-num-batched-tokens", "1024", "--no-enable-prefix-caching"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def simulator(slowdown: float) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "PROFLLM_SIM_SLOWDOWN": str(slowdown)}
    server = subprocess.Popen(
        [sys.executable, "-m", "pytest_profllm.sim", "sim-8b", "--port", str(port), *SERVER_ARGS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the simulator did not start")
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def one_run(url: str, codec: TokenizerCodec, num_prompts: int, seed: int) -> RunSamples:
    config = BenchmarkConfig.model_validate({**WORKLOAD, "num_prompts": num_prompts, "seed": seed})
    prompts = make_prompts(config, codec)
    load = asyncio.run(run_load(load_settings(config, url, "sim-8b"), prompts))
    results, _ = measure(load, config, codec)
    rows = [request_row(i, o, load.clock_start) for i, o in enumerate(load.outcomes)]
    return RunSamples(f"{seed}", "", "", results, latencies_from_requests(rows))


def runs_for(
    slowdown: float, seeds: list[int], prompts: list[int], repeats: int, seed_offset: int
) -> dict[tuple[int, int], list[RunSamples]]:
    codec = TokenizerCodec.load(str(MODEL_DIR))
    out: dict[tuple[int, int], list[RunSamples]] = {}
    with simulator(slowdown) as url:
        one_run(url, codec, prompts[0], 999_999)  # warm-up, discarded
        for seed in seeds:
            for n in prompts:
                out[(seed, n)] = [
                    one_run(url, codec, n, seed_offset + seed) for _ in range(repeats)
                ]
    return out


def regressed(
    new: list[RunSamples], base: list[RunSamples], settings: GateSettings
) -> dict[str, bool]:
    return {
        name: judge(gated_metric(name, tolerance), new, base, settings).verdict == "regressed"
        for name, tolerance in parse_regression(list(GATED)).items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--num-prompts", default="10,20")
    parser.add_argument("--repeats", default="2,3")
    parser.add_argument("--slowdowns", default="1.05,1.1,1.15")
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    prompts = [int(p) for p in args.num_prompts.split(",")]
    repeat_counts = [int(r) for r in args.repeats.split(",")]
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    most = max(repeat_counts)
    settings = GateSettings()
    print(
        f"gate defaults: tolerance {DEFAULT_TOLERANCE:.0%} per repeat, "
        f"{DEFAULT_LATENCY_TOLERANCE:.0%} per request, confidence {DEFAULT_CONFIDENCE}, "
        f"{DEFAULT_RESAMPLES} resamples; gated: {', '.join(GATED)}"
    )
    print(f"workload: {WORKLOAD}, server: {' '.join(SERVER_ARGS)}; {args.seeds} seeds")
    began = time.monotonic()
    baseline = runs_for(1.0, seeds, prompts, most, 0)
    slowed = {factor: runs_for(factor, seeds, prompts, most, 100_000) for factor in slowdowns}
    unchanged = runs_for(1.0, seeds, prompts, most, 100_000)
    print(f"measured in {time.monotonic() - began:.0f} s")
    header = f"{'num_prompts':>11} {'repeat':>6} {'false alarms':>13}"
    header += "".join(f" {f'x{factor:g}':>8}" for factor in slowdowns) + "  smallest always caught"
    print(header)
    per_metric: dict[tuple[int, int, float], dict[str, int]] = {}

    def rate(
        runs: dict[tuple[int, int], list[RunSamples]], n: int, repeat: int, factor: float
    ) -> int:
        """Seeds whose runs were judged regressed (any gated metric)."""
        caught = 0
        counts = per_metric.setdefault((n, repeat, factor), dict.fromkeys(GATED, 0))
        for seed in seeds:
            verdicts = regressed(runs[(seed, n)][:repeat], baseline[(seed, n)][:repeat], settings)
            caught += any(verdicts.values())
            for name, hit in verdicts.items():
                counts[name] += hit
        return caught

    for n in prompts:
        for repeat in repeat_counts:
            alarms = rate(unchanged, n, repeat, 1.0)
            detected = [rate(slowed[factor], n, repeat, factor) for factor in slowdowns]
            always = [f for f, d in zip(slowdowns, detected, strict=True) if d == len(seeds)]
            line = f"{n:>11} {repeat:>6} {f'{alarms}/{len(seeds)}':>13}"
            line += "".join(f" {f'{100 * d / len(seeds):.0f}%':>8}" for d in detected)
            line += f"  {f'x{min(always):g}' if always else 'none'}"
            print(line)
    print("per metric (seeds flagged regressed):")
    for (n, repeat, factor), counts in per_metric.items():
        cells = ", ".join(f"{name} {count}" for name, count in counts.items())
        print(f"  n={n} repeat={repeat} x{factor:g}: {cells}")


if __name__ == "__main__":
    main()
