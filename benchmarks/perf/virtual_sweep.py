"""A sweep of a thousand server configurations on the virtual clock, on this host's cores.

    python benchmarks/perf/virtual_sweep.py [--out DIR] [-n 2] [--prompts 200]

One suite: five models x four tensor-parallel sizes x ten batch limits (`max_num_seqs`) x five
`max_num_batched_tokens`, 1,000 configurations, each with one serve case (vLLM's random
dataset, 512 in / 128 out with +-50 % lengths, `--prompts` requests at 16 req/s). It runs as a
user would run it: `pytest SUITE --profllm-sim-clock virtual -n 2 --profllm-out DIR`, then
the records are counted in the session's results.db. Printed: the wall time of the session
(collection, 1,000 engines built and stepped, 1,000 records written and loaded), the cases
per second, and the spread of output throughput the sweep found.

Target: minutes on 2 cores. Run on demand (not collected by pytest), under `nice` on a shared
host.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct",
          "Qwen/Qwen3-14B", "Qwen/Qwen3-32B")
TENSOR_PARALLEL = (1, 2, 4, 8)
MAX_NUM_SEQS = (8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
MAX_BATCHED_TOKENS = (2048, 4096, 8192, 16384, 32768)
SUITE = """\
name: sweep
description: "1,000 server configurations on the virtual clock (benchmarks/perf/virtual_sweep.py)"
server:
  model: {models}
  tensor_parallel_size: {tp}
  max_num_seqs: {seqs}
  max_num_batched_tokens: {tokens}
  max_model_len: 4096
benchmark:
  dataset_name: random
  num_prompts: {prompts}
  random_input_len: 512
  random_output_len: 128
  random_range_ratio: 0.5
  request_rate: 16
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the records here (default: a temp dir)")
    parser.add_argument("-n", "--workers", default="2", help="pytest-xdist workers")
    parser.add_argument("--prompts", type=int, default=200, help="requests per case")
    args = parser.parse_args()
    out = (args.out or Path(tempfile.mkdtemp(prefix="profllm-sweep-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "bench_sweep.yaml"
    suite.write_text(SUITE.format(models=list(MODELS), tp=list(TENSOR_PARALLEL),
                                  seqs=list(MAX_NUM_SEQS), tokens=list(MAX_BATCHED_TOKENS),
                                  prompts=args.prompts))
    configurations = (len(MODELS) * len(TENSOR_PARALLEL) * len(MAX_NUM_SEQS)
                      * len(MAX_BATCHED_TOKENS))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
            "--rootdir", str(out), "--profllm-sim-clock", "virtual",
            "--profllm-out", str(out / "results"), "-n", args.workers]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=out, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    wall = time.perf_counter() - started
    tail = [line for line in done.stdout.splitlines() if line.strip()][-1:]
    print(f"{configurations} configurations, one case each, -n {args.workers}: {wall:.1f} s "
          f"wall ({configurations / wall:.1f} cases/s); pytest: {' '.join(tail)}")
    db = out / "results" / "results.db"
    if not db.is_file():
        print(done.stdout[-3000:], done.stderr[-3000:])
        return 1
    connection = sqlite3.connect(db)
    count, valid, low, high = connection.execute(
        "SELECT count(*), sum(validity = 'valid'), min(output_throughput), "
        "max(output_throughput) FROM benchmark_runs WHERE engine_clock = 'virtual'").fetchone()
    best = connection.execute(
        "SELECT configuration, output_throughput FROM benchmark_runs "
        "ORDER BY output_throughput DESC LIMIT 1").fetchone()
    connection.close()
    print(f"records in results.db: {count} ({valid} valid); output throughput "
          f"{low:.0f} .. {high:.0f} tok/s; highest: {best[0]} ({best[1]:.0f} tok/s)")
    return 0 if count == configurations else 1


if __name__ == "__main__":
    sys.exit(main())
