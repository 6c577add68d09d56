"""How trustworthy the regression gate is on the simulated engine: false alarms on unchanged
runs, detection of known slowdowns (PROFLLM_SIM_SLOWDOWN), over many seeds, at the gate's
default settings (tolerance, confidence level, resamples: plan/regression.py).

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
import time
from contextlib import AbstractContextManager

from sim_server import simulator  # this folder's

from pytest_profllm.gates.regression import GateSettings, judge_regression
from pytest_profllm.gates.samples import RunSamples, latencies_from_requests
from pytest_profllm.load.bench import load_settings, measure, run_load
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.server_state import empty_caches
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
# shared host makes noisy. Prefix caching on (vLLM's default), as a suite measures it: each
# run draws prompts of its own and starts from an emptied cache (--no-prefix-caching: off).
WORKLOAD = {"random_input_len": 512, "random_output_len": 16, "request_rate": "inf"}
SERVER_ARGS = ["--max-num-batched-tokens", "1024"]
REPEAT_SEEDS = 1000  # repeat r of seed s draws from seed s + r * REPEAT_SEEDS


def fresh_simulator(slowdown: float) -> AbstractContextManager[str]:
    return simulator("sim-8b", *SERVER_ARGS, env={"PROFLLM_SIM_SLOWDOWN": str(slowdown)})


def one_run(url: str, codec: TokenizerCodec, num_prompts: int, seed: int) -> RunSamples:
    config = BenchmarkConfig.model_validate({**WORKLOAD, "num_prompts": num_prompts, "seed": seed})
    prompts = make_prompts(config, codec)
    state = empty_caches(url, config)
    if state.state != "emptied":
        raise SystemExit(f"the simulator's prefix cache: {state.describe()}")
    load = asyncio.run(run_load(load_settings(config, url, "sim-8b"), prompts))
    results, _ = measure(load, config, codec)
    rows = [request_row(i, o, load.clock_start) for i, o in enumerate(load.outcomes)]
    return RunSamples(f"{seed}", "", "", results, latencies_from_requests(rows))


def runs_for(
    slowdown: float, seeds: list[int], prompts: list[int], repeats: int, seed_offset: int
) -> dict[tuple[int, int], list[RunSamples]]:
    codec = TokenizerCodec.load(str(MODEL_DIR))
    out: dict[tuple[int, int], list[RunSamples]] = {}
    with fresh_simulator(slowdown) as url:
        one_run(url, codec, prompts[0], 999_999)  # warm-up, discarded
        for seed in seeds:
            for n in prompts:
                out[(seed, n)] = [
                    one_run(url, codec, n, seed_offset + seed + r * REPEAT_SEEDS)
                    for r in range(repeats)
                ]
    return out


def regressed(
    new: list[RunSamples], base: list[RunSamples], settings: GateSettings
) -> dict[str, bool]:
    return {
        name: judge_regression(
            gated_metric(name, tolerance), new, base, settings
        ).verdict == "regressed"
        for name, tolerance in parse_regression(list(GATED)).items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--num-prompts", default="10,20")
    parser.add_argument("--repeats", default="2,3")
    parser.add_argument("--slowdowns", default="1.05,1.1,1.15")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="serve with prefix caching off (vLLM's default is on)")
    args = parser.parse_args()
    if args.no_prefix_caching:
        SERVER_ARGS.append("--no-enable-prefix-caching")
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
