"""How close `pytest -n 4` on four GPUs comes to the ideal wall time for a mixed-tp matrix.

Runs, on the simulated engine with 4 virtual GPUs, a suite of six server configurations
(tensor parallel 1, 2 and 4) with several cases each, then reads the records:

    ideal = max(sum over servers of GPUs x lifetime / GPUs in the pool, sum of start-up times)

where a server's lifetime (start to stop) is its start-up plus its cases, the time it holds its
GPUs, and start-ups count serially because servers start one at a time per host. The ratio
ideal / wall time says how much the pool, the scheduler and the serial starts lose. Aim: 0.8.

    python benchmarks/perf/pool_walltime.py [--workers 4] [--prompts 80] [--rate 20]

Run on demand (not collected by pytest). It uses its own lease folder and ports 23000-23999.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUITE = """
server:
  model: sim-walltime
  tensor_parallel_size: [4, 2, 1]
  max_num_seqs: [16, 32]
benchmark:
  num_prompts: {prompts}
  request_rate: {rate}
  random_input_len: 64
  random_output_len: [16, 24, 32]
thresholds:
  completed: {{min: {prompts}}}
"""
GPUS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=80)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profllm-walltime-") as tmp:
        root = Path(tmp)
        suite = SUITE.format(prompts=args.prompts, rate=args.rate)
        (root / "bench_walltime.yaml").write_text(suite)
        command = [
            sys.executable, "-m", "pytest", str(root), "-q", "-p", "no:cacheprovider",
            "-n", str(args.workers), f"--profllm-gpus={GPUS}", "--profllm-ports=23000-23999",
            f"--profllm-out={root / 'results'}", f"--rootdir={root}",
        ]
        env = {**os.environ, "PROFLLM_POOL_DIR": str(root / "pool")}
        launched = time.time()
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        finished = time.time()
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], sep="\n")
            print(f"pytest exited {run.returncode}")
            return 1
        records = [json.loads(p.read_text()) for p in (root / "results").glob("*.json")]
    report(records, launched, finished, args.workers)
    return 0


def report(records: list[dict[str, Any]], launched: float, finished: float, workers: int) -> None:
    wall = finished - launched
    servers: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        runtime = record["runtime"]
        key = (runtime["worker"], runtime["server_key"], runtime["server_started_at"])
        server = servers.setdefault(key, {**runtime, "cases": 0, "label": record["case_id"]})
        server["cases"] += 1
    print(f"{len(records)} cases, {len(servers)} server starts, {workers} workers, {GPUS} GPUs")
    print(f"{'server':<44} {'gpus':>4} {'start s':>8} {'life s':>7} {'cases':>5} {'wait s':>7}")
    gpu_seconds = 0.0
    starts = 0.0
    for server in sorted(servers.values(), key=lambda s: s["server_started_at"]):
        life = server["server_stopped_at"] - server["server_started_at"]
        start = server["server_ready_at"] - server["server_started_at"]
        gpu_seconds += len(server["gpus"]) * life
        starts += start
        label = server["label"].split("::")[1]
        print(
            f"{label:<44} {len(server['gpus']):>4} {start:>8.2f} {life:>7.2f} "
            f"{server['cases']:>5} {server['lease_wait_s']:>7.2f}"
        )
    first = min(s["server_started_at"] for s in servers.values())
    last = max(s["server_stopped_at"] for s in servers.values())
    ideal = max(gpu_seconds / GPUS, starts)
    print(f"GPU-seconds held: {gpu_seconds:.1f}; serial start-ups: {starts:.1f} s")
    print(f"ideal wall time: {ideal:.1f} s")
    print(f"measured: servers' span {last - first:.1f} s, whole pytest run {wall:.1f} s")
    print(
        f"  of which pytest before the first server start {first - launched:.1f} s, "
        f"after the last server stop {finished - last:.1f} s"
    )
    print(f"efficiency (ideal / servers' span): {ideal / (last - first):.2f}")
    print(f"efficiency (ideal / whole run):     {ideal / wall:.2f}   (aim: 0.80)")


if __name__ == "__main__":
    sys.exit(main())
