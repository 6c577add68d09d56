"""What one simulated-engine process costs the host: its CPU share at 64 and 256 streams.

    python benchmarks/perf/sim_cpu.py [--model Qwen/Qwen3-8B] [--device H100-SXM]

Starts the simulator (a real server process on loopback), drives it with `profllm bench` at
each concurrency, and prints the server's CPU time over the run's wall time (100 % = one core)
beside the token rate it streamed. Target: under 50 % of one core at 256 concurrent streams,
so that `pytest -n 4` on 2 cores measures the harness, not CPU contention. Not a pytest file:
every load is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[2]
SIM_TOKENIZER = ROOT / "pytest_profllm" / "sim" / "model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the simulator exited with {process.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise SystemExit("the simulator did not answer /health")


def measure(url: str, model: str, pid: int, streams: int, prompts: int, out: Path) -> None:
    server = psutil.Process(pid)
    argv = [
        sys.executable, "-m", "pytest_profllm.cli", "bench", "--base-url", url, "--model", model,
        "--tokenizer", str(SIM_TOKENIZER), "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "256",
        "--num-prompts", str(prompts), "--max-concurrency", str(streams),
        "--save-result", "--result-dir", str(out), "--result-filename", f"c{streams}.json",
    ]  # fmt: skip
    cpu = server.cpu_times()
    began = time.monotonic()
    subprocess.run(argv, check=True, timeout=600, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.monotonic() - began
    after = server.cpu_times()
    used = (after.user + after.system) - (cpu.user + cpu.system)
    result = json.loads((out / f"c{streams}.json").read_text())
    print(
        f"{streams:8d} {prompts:8d} {result['output_throughput']:12.0f} "
        f"{result['median_tpot_ms']:10.1f} {used / wall * 100:10.1f} %"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--device", default="H100-SXM")
    parser.add_argument("--prompts-per-stream", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pytest_profllm.sim", args.model, "--port", str(port),
            "--sim-device", args.device]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, process)
        print(f"simulator: {args.model} on {args.device}; 128 in / 256 out tokens per request")
        print(
            f"{'streams':>8} {'requests':>8} {'out tok/s':>12} {'TPOT ms':>10} {'server CPU':>12}"
        )
        with tempfile.TemporaryDirectory() as out:
            for streams in (64, 256):
                measure(url, args.model, process.pid, streams, streams * args.prompts_per_stream,
                        Path(out))  # fmt: skip
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()
