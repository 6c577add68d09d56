"""How much the telemetry sampler costs: time per sample (psutil over the server's process
tree and the client, a /metrics scrape, NVML where present) against a running simulator.

    python benchmarks/perf/telemetry_overhead.py [SECONDS] [INTERVAL_S]

Prints figures; asserts nothing (speed targets are read, not gated, on shared machines).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import requests

from pytest_profllm.run.telemetry import Sampler


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pytest_profllm.sim", "Qwen/Qwen3-8B", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the simulator did not start")
            time.sleep(0.1)
        began_cpu = time.process_time()
        with Sampler(server.pid, ["0"], f"http://127.0.0.1:{port}/metrics", interval) as sampler:
            time.sleep(seconds)
        cpu = time.process_time() - began_cpu
        count = len(sampler.samples)
        print(f"samples: {count} in {seconds:.1f} s at {interval} s interval")
        print(f"time per sample: {1000 * sampler.sample_seconds / (count + 2):.2f} ms")
        print(f"sampler wall share: {100 * sampler.sample_seconds / seconds:.2f} % of one core")
        print(f"this process's CPU while sampling: {100 * cpu / seconds:.2f} % of one core")
        nvml = sampler.summary()["peak_gpu_memory_mib"] is not None
        print(f"NVML: {'yes' if nvml else 'absent'}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
