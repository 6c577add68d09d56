"""How faithfully a timed trace is replayed: the send times against the trace's, and the
requests per second against the trace's.

    python benchmarks/perf/trace_replay.py [--requests 10000] [--rate 30] [--speedups 1 10]
        [--client-processes 2]

A trace of `--requests` requests (`synthetic_trace`: a rate that swings over a minute, with
bursts; outputs cut to 2-8 tokens so the server's streaming does not crowd the client's CPU
on a small host) is replayed against the simulated engine at each speed-up. Printed per
speed-up: the p50/p99/max difference between each request's scheduled and actual send time,
and the correlation of requests per second sent against the trace's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pytest_profllm.load.bench import load_settings, run_load
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.trace import synthetic_trace, trace_lines
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.model_files import MODEL_DIR


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_sim(port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "pytest_profllm.sim", "sim", "--port", str(port),
            "--max-num-seqs", "1024"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the simulated engine did not start")


def replay(trace: Path, base_url: str, speedup: float, count: int, processes: int) -> None:
    config = BenchmarkConfig(
        dataset_name="timed_trace", dataset_path=str(trace), num_prompts=count,
        timed_trace_sec_multiplier=0.001, trace_speedup=speedup,
        client_processes=processes,
    )  # fmt: skip
    requests = make_prompts(config, TokenizerCodec.load(str(MODEL_DIR)))
    load = asyncio.run(run_load(load_settings(config, base_url, "sim"), requests))
    intended = np.array(load.intended_offsets)
    sent = np.array([outcome.start_time - load.clock_start for outcome in load.outcomes])
    late_ms = (sent - intended) * 1000
    failed = sum(not outcome.success for outcome in load.outcomes)
    seconds = int(np.ceil(max(intended.max(), sent.max()))) + 1
    wanted = np.bincount(intended.astype(int), minlength=seconds)
    achieved = np.bincount(np.clip(sent, 0, None).astype(int), minlength=seconds)
    correlation = float(np.corrcoef(wanted, achieved)[0, 1])
    print(
        f"speed-up {speedup:g}: {len(requests)} requests over {intended.max():.1f} s "
        f"(peak {wanted.max()} req/s), {failed} failed; send time - scheduled: p50 "
        f"{np.percentile(late_ms, 50):.2f} ms, p99 {np.percentile(late_ms, 99):.2f} ms, max "
        f"{late_ms.max():.2f} ms; per-second counts correlation {correlation:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=30.0, help="the trace's mean req/s")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="the client's processes (one event loop falls behind past about "
                        "300 req/s on a 2-core host shared with the server)")
    parser.add_argument("--speedups", type=float, nargs="+", default=[1.0, 10.0])
    args = parser.parse_args()
    entries = synthetic_trace(args.requests, args.rate, seed=1)
    rng = np.random.default_rng(1)
    for entry in entries:
        entry["output_length"] = int(rng.integers(2, 9))
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.jsonl"
        trace.write_text(trace_lines(entries))
        print(f"host: {os.cpu_count()} CPUs; trace: {json.dumps(entries[0])[:80]}...")
        for speedup in args.speedups:
            port = free_port()
            sim = start_sim(port)  # a fresh server per replay: no cache or queue carried over
            try:
                replay(trace, f"http://127.0.0.1:{port}", speedup, args.requests,
                       args.client_processes)
            finally:
                sim.terminate()
                sim.wait(timeout=30)


if __name__ == "__main__":
    main()
