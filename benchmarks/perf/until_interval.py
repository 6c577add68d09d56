"""Is a run that stops when sure right about where its statistic lies?

    python benchmarks/perf/until_interval.py [--hog] [--rate 20] [--half-width 0.05]

A serve case on the simulated engine runs with `until: {metric: p99_ttft_ms, half_width:
0.05}` (rounds of `--round` requests, at most `--max-prompts`), and the script prints how many
requests it took, in how many rounds, what ended it (interval or cap) and the interval. Then
an independent rerun: a fresh server (another server key), a fixed `num_prompts` equal to
what the first run took, another seed; printed is its p99 TTFT and whether it lies inside the
first run's interval. The interval is a statement about the server's p99 at this load; a
rerun's p99 is itself an estimate with its own noise, so even a right interval holds a rerun's
value less often than its confidence says.

`--hog` pins the pytest run (its client, and the simulator it starts) and one busy-looping
process to the same core: a busy host. The load average at the start and end is printed,
since the host may be shared.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SERVER = "server: {{model: sim-8b, max_num_seqs: 32, seed: {server_seed}}}\n"
WORKLOAD = (
    "benchmark:\n  dataset_name: random\n  random_input_len: 128\n  random_output_len: 16\n"
    "  request_rate: {rate}\n  seed: {seed}\n  num_prompts: {num_prompts}\n"
)
UNTIL = ("  until: {{metric: p99_ttft_ms, half_width: {half_width}, max_prompts: {max_prompts},"
         " round_prompts: {round_prompts}}}\n")


def hog(core: int) -> None:
    """Busy-loop on `core` until killed."""
    os.sched_setaffinity(0, {core})
    while True:
        pass


def run(suite: str, ports: str, core: int | None) -> dict[str, Any]:
    """One pytest run of `suite` on the simulator; its one record."""
    folder = Path(tempfile.mkdtemp(prefix="until-interval-"))
    (folder / "bench_until.yaml").write_text(suite)
    out = folder / "results"
    subprocess.run(
        [sys.executable, "-m", "pytest", str(folder), "-p", "no:cacheprovider", "-q",
         f"--profllm-out={out}", f"--profllm-ports={ports}", "--profllm-engine=sim",
         # One attempt: on a shared host the judge may find a load invalid (printed), and a
         # load in rounds run again whole doubles the script's time.
         "--profllm-no-load-cores", "--profllm-remeasure=0"],
        cwd=folder, check=False, stdout=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None,
    )
    (record,) = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hog", action="store_true", help="a busy loop on the client's core")
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s (default 20)")
    parser.add_argument("--half-width", type=float, default=0.05)
    parser.add_argument("--max-prompts", type=int, default=4000)
    parser.add_argument("--round", type=int, default=500, help="requests per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ports", default=os.environ.get("PROFLLM_PERF_PORTS", "35500-35599"))
    args = parser.parse_args()
    core = 0 if args.hog else None
    hogging = None
    if args.hog:
        hogging = multiprocessing.Process(target=hog, args=(0,), daemon=True)
        hogging.start()
    try:
        print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}"
              f"{'; a busy loop on core 0 with the run' if args.hog else ''}")
        started = time.monotonic()
        first = run(SERVER.format(server_seed=1)
                    + WORKLOAD.format(rate=args.rate, seed=args.seed, num_prompts=args.round)
                    + UNTIL.format(half_width=args.half_width, max_prompts=args.max_prompts,
                                   round_prompts=args.round), args.ports, core)
        stop = first["until"]
        print(f"until run: {stop['requests']} requests in {stop['rounds']} rounds, stopped by "
              f"the {stop['stopped_by']}; p99 TTFT {stop['value']:.2f} ms, "
              f"{stop['confidence']:.0%} interval {stop['ci_low']:.2f} .. {stop['ci_high']:.2f}"
              f" ms (+-{stop['relative_half_width']:.2%}, asked +-{args.half_width:.0%}); "
              f"validity {first['validity']} {first['validity_reasons'] or ''}")
        rerun = run(SERVER.format(server_seed=2)
                    + WORKLOAD.format(rate=args.rate, seed=args.seed + 1000,
                                      num_prompts=stop["requests"]), args.ports, core)
        p99 = rerun["results"]["p99_ttft_ms"]
        inside = stop["ci_low"] <= p99 <= stop["ci_high"]
        print(f"rerun: fresh server, {rerun['results']['completed']} requests, seed "
              f"{args.seed + 1000}: p99 TTFT {p99:.2f} ms, "
              f"{'inside' if inside else 'OUTSIDE'} the interval "
              f"({(p99 / stop['value'] - 1):+.2%} from the until run's); validity "
              f"{rerun['validity']} {rerun['validity_reasons'] or ''}")
        print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
              f"{time.monotonic() - started:.0f} s in all")
    finally:
        if hogging is not None:
            hogging.kill()
            hogging.join()


if __name__ == "__main__":
    main()
