"""How close the SLO capacity search lands to the true capacity, and in how many probes.

    python benchmarks/perf/capacity_search.py [--seeds 20] [--processes 2]

Each probe is a whole benchmark run through the simulator's scheduler and engine model on a
virtual clock (`pytest_profllm/sim/virtual.py`), so a search costs seconds of CPU. For each
configuration (model on device) and SLO set:

1. The true capacity by a dense sweep: the loads on a 1 % grid around the boundary, each
   measured on 8 seeds' requests pooled (eight times a probe's sample), the highest load
   below the first that misses an SLO.
2. The search, for a workload of 1,000 prompts (`pytest_profllm/load/capacity/`, the
   code a capacity case runs) with 20 seeds: its capacity's error against the truth, its
   probe count, and its false "meets": a probe that said "meets" at a load above the true
   capacity.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from pytest_profllm.load.capacity import (
    ProbeSamples,
    Slo,
    requests_per_probe,
    search,
    slos_of,
)
from pytest_profllm.plan.suite import CapacitySearch
from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.hardware import device_profile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.virtual import Request, ServerSettings, simulate

CONFIGURATIONS = (
    ("Qwen/Qwen3-8B", "H100-SXM", 256),
    ("meta-llama/Llama-3.1-8B-Instruct", "A100-80GB", 128),
    ("Qwen/Qwen3-30B-A3B", "H200", 256),
)
SLO_SETS = (
    {"p99_ttft_ms": 500.0, "p99_tpot_ms": 50.0},
    {"p90_ttft_ms": 250.0, "median_tpot_ms": 30.0},
)
INPUT_LEN, OUTPUT_LEN = 512, 64
SEARCH = CapacitySearch(low=1, high=200, precision=0.05, max_probes=12)
TRUTH_SEEDS = 8
NUM_PROMPTS = 1000  # the workload's num_prompts: a probe sends at least this many
POOL: ProcessPoolExecutor


@dataclass(frozen=True)
class Config:
    model: str
    device: str
    max_num_seqs: int

    def engine(self) -> EngineModel:
        return EngineModel(resolve_model(self.model), device_profile(self.device))

    def run(self, load: float, count: int, seed: int) -> ProbeSamples:
        rng = random.Random(seed)
        # Lengths vary by +-50 %, as a random dataset with range_ratio 0.5 draws them.
        requests = [
            Request(rng.randint(INPUT_LEN // 2, INPUT_LEN * 3 // 2),
                    rng.randint(OUTPUT_LEN // 2, OUTPUT_LEN * 3 // 2))
            for _ in range(count)
        ]
        outcome = simulate(self.engine(), requests, ServerSettings(max_num_seqs=self.max_num_seqs),
                           request_rate=load, seed=seed)
        return ProbeSamples(
            latencies={
                "ttft": np.asarray(outcome.ttft) * 1000,
                "tpot": np.asarray(outcome.tpot) * 1000,
                "e2el": np.asarray(outcome.e2el) * 1000,
                "itl": np.asarray(outcome.itl) * 1000,
            },
            completed=len(outcome.e2el),
            achieved_rate=len(outcome.e2el) / outcome.duration if outcome.duration else None,
            duration_s=outcome.duration,
        )


def _truth_run(args: tuple[Config, float, int, int]) -> ProbeSamples:
    config, load, count, seed = args
    return config.run(load, count, seed)


def meets(config: Config, slos: list[Slo], load: float, count: int) -> bool:
    jobs = [(config, load, count, 10_000 + seed) for seed in range(TRUTH_SEEDS)]
    pooled = list(POOL.map(_truth_run, jobs))
    for slo in slos:
        assert slo.latency is not None
        values = np.concatenate([p.latencies[slo.latency] for p in pooled])
        if float(slo.value(values)) > slo.target:
            return False
    return True


def true_capacity(config: Config, slos: list[Slo]) -> float:
    """The dense sweep: bisect to the boundary on pooled samples, then walk a 1 % grid from
    10 % below it to the first load that misses."""
    count = requests_per_probe(slos, NUM_PROMPTS)
    low, high = SEARCH.low, SEARCH.high
    if not meets(config, slos, low, count):
        return math.nan
    if meets(config, slos, high, count):
        return high
    while high / low > 1.02:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(config, slos, middle, count) else (low, middle)
    load = max(SEARCH.low, low * 0.9)
    best = load
    while load <= min(SEARCH.high, high * 1.1):
        if not meets(config, slos, load, count):
            break
        best = load
        load *= 1.01
    return best


def one_search(args: tuple[Config, dict[str, float], int]) -> tuple[float | None, int, list[float]]:
    config, block, seed = args
    result = search(config.run, slos_of(block), SEARCH, NUM_PROMPTS, seed=seed * 7919,
                    clock=_virtual_clock())
    said_meets = [p.load for p in result.probes if p.decision == "meets"]
    return result.capacity, len(result.probes), said_meets


def _virtual_clock() -> Callable[[], float]:
    # The budget in time is not what this measures: a clock that never advances.
    return lambda: 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    print(f"search: over request_rate in [{SEARCH.low:g}, {SEARCH.high:g}], precision "
          f"{SEARCH.precision:.0%}, at most {SEARCH.max_probes} probes, confidence "
          f"{SEARCH.confidence:.0%}; workload random {INPUT_LEN}/{OUTPUT_LEN} (+-50 %), "
          f"num_prompts {NUM_PROMPTS}")
    global POOL
    worst_error, worst_probes, false_meets, searches = 0.0, 0, 0, 0
    with ProcessPoolExecutor(args.processes) as pool:
        POOL = pool
        for model, device, seqs in CONFIGURATIONS:
            config = Config(model, device, seqs)
            for block in SLO_SETS:
                slos = slos_of(block)
                truth = true_capacity(config, slos)
                jobs = [(config, block, seed) for seed in range(args.seeds)]
                outcomes = list(pool.map(one_search, jobs))
                print(f"\n{model} on {device} (max_num_seqs {seqs}), SLO {block}: "
                      f"true capacity {truth:.2f} req/s")
                print(f"{'seed':>4} {'capacity':>9} {'error':>7} {'probes':>6} "
                      f"{'false meets':>11}")
                errors = []
                for seed, (capacity, probes, said) in enumerate(outcomes):
                    error = (capacity / truth - 1) if capacity else math.nan
                    wrong = sum(1 for load in said if load > truth * 1.0001)
                    errors.append(abs(error))
                    worst_error = max(worst_error, abs(error))
                    worst_probes = max(worst_probes, probes)
                    false_meets += wrong
                    searches += 1
                    shown = "-" if capacity is None else f"{capacity:.2f}"
                    print(f"{seed:4d} {shown:>9} {error:+7.1%} {probes:6d} {wrong:11d}")
                print(f"median |error| {statistics.median(errors):.1%}, "
                      f"max {max(errors):.1%}")
    print(f"\nall {searches} searches: worst |error| {worst_error:.1%}, most probes "
          f"{worst_probes}, false meets {false_meets}")


if __name__ == "__main__":
    main()
