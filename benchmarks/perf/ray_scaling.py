"""Wall time of one suite on a Ray cluster of 1 node and of 2 nodes, and what Ray adds per case.

The suite has four servers at tensor parallel 2 (each fills one node of 2 logical GPUs) with
two request-rate-bound cases each, on the simulated engine. It runs three ways:

- on this host without Ray, with a pool of 2 GPUs: the servers one after another (baseline);
- with `--profllm-ray` on a cluster of 1 node of 2 GPUs: also one after another;
- with `--profllm-ray` on a cluster of 2 such nodes: two servers at a time (aim: close to 2x).

The clusters are started before the timed runs, as an existing cluster would be. Each run
prints pytest's whole wall time and the span of its servers (first start to last stop, from the
records): the rest is pytest's own start and end, and with Ray, connecting to the cluster. What
Ray adds per case is (span on 1 node - span on this host) / cases; what it adds once per run is
the difference of the rest. Every node of these clusters is on this host, so the servers'
start-ups still take turns (one at a time per host) and the clients and servers share its CPUs.

    python benchmarks/perf/ray_scaling.py [--prompts 16] [--rate 4] [--ports 64800-65199]

Needs `pip install -e ".[ray]"`. Run on demand (not collected by pytest); it uses its own lease
folder.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from ray_cluster import local_cluster  # noqa: E402  (a helper of the tests)

SUITE = """
server:
  model: sim-ray-scaling
  tensor_parallel_size: 2
  max_num_seqs: [8, 16, 32, 64]
benchmark:
  num_prompts: {prompts}
  request_rate: {rate}
  random_input_len: 64
  random_output_len: [16, 24]
thresholds:
  completed: {{min: {prompts}}}
"""
CASES = 8
NODE_GPUS = 2


def run_suite(root: Path, name: str, ports: str, extra: list[str]) -> tuple[float, float]:
    """pytest's wall time and its servers' span, in seconds."""
    out = root / f"results-{name}"
    command = [
        sys.executable, "-m", "pytest", str(root), "-q", "-p", "no:cacheprovider",
        f"--profllm-gpus={NODE_GPUS}", f"--profllm-ports={ports}", f"--profllm-out={out}",
        f"--rootdir={root}", "--profllm-max-schedule-lag=1000", *extra,
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - started
    records = [json.loads(path.read_text()) for path in out.glob("*.json")]
    passed = sum(record["status"] == "passed" for record in records)
    if done.returncode != 0 or passed != CASES:
        sys.exit(f"{name}: pytest exit {done.returncode}, {passed}/{CASES} passed\n{done.stdout}")
    nodes = {record["runtime"].get("node_id") for record in records}
    runtimes = [record["runtime"] for record in records]
    span = max(r["server_stopped_at"] for r in runtimes) - min(
        r["server_started_at"] for r in runtimes
    )
    used = len(nodes - {None})
    print(f"{name:<20} wall {wall:6.1f} s   servers {span:6.1f} s   ({used} Ray node(s) used)")
    return wall, span


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--ports", default="64800-65199")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profllm-ray-scaling-") as tmp:
        root = Path(tmp)
        (root / "bench_scaling.yaml").write_text(SUITE.format(prompts=args.prompts, rate=args.rate))
        os.environ["PROFLLM_POOL_DIR"] = str(root / "pool")  # the clusters' nodes inherit it
        print(f"{CASES} cases, 4 servers at tp 2, {args.prompts} prompts at {args.rate:g} req/s")
        baseline = run_suite(root, "this host, no Ray", args.ports, [])
        walls = {}
        for nodes in (1, 2):
            with local_cluster(nodes, NODE_GPUS) as cluster:
                walls[nodes] = run_suite(
                    root, f"Ray, {nodes} node(s)", args.ports, [f"--profllm-ray={cluster.address}"]
                )
        (wall_1, span_1), (wall_2, span_2) = walls[1], walls[2]
        print(
            f"speed-up, 2 nodes over 1: wall {wall_1 / wall_2:.2f}x, servers {span_1 / span_2:.2f}x"
        )
        print(f"Ray adds per case: {(span_1 - baseline[1]) / CASES:+.2f} s")
        once = (wall_1 - span_1) - (baseline[0] - baseline[1])
        print(f"Ray adds once per run (connecting, submitting, leaving): {once:+.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
