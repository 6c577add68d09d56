"""What the client adds to the server's own latency: `python benchmarks/perf/client_overhead.py`.

Starts the simulated engine (or takes `--base-url` of a running server, such as vLLM's CPU
build), runs `profllm bench` against it at each concurrency (default 1,
16 and 256; `--repeats` runs of each) and prints, per run, the client's mean TTFT and E2E
beside the server's (vLLM's `vllm:time_to_first_token_seconds` and
`vllm:e2e_request_latency_seconds` over the run's window) and their difference, the overhead
that `--profllm-max-client-overhead` bounds. Not a pytest file: it prints figures, and bounds
every run in requests and time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_TIMEOUT_S = 300
PROFLLM = [sys.executable, "-m", "pytest_profllm.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def simulator(workdir: Path) -> Iterator[str]:
    port = _free_port()
    argv = [sys.executable, "-m", "pytest_profllm.sim", "--model", "sim", "--port", str(port),
            "--max-num-seqs", "256"]
    with (workdir / "sim.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                url + "/health", timeout=1
            ) as answer:
                if answer.status == 200:
                    break
            time.sleep(0.2)
        else:
            raise SystemExit("the simulated engine did not answer /health within 60 s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(url: str, concurrency: int, prompts: int, output_len: int, workdir: Path,
          model: str = "sim", tokenizer: str | None = None) -> Any:
    out = workdir / f"c{concurrency}.json"
    argv = [*PROFLLM, "bench", "--base-url", url, "--model", model,
            *(["--tokenizer", tokenizer] if tokenizer else []),
            "--num-prompts", str(prompts), "--random-input-len", "128",
            "--random-output-len", str(output_len), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--result-dir", str(workdir), "--result-filename", out.name]
    done = subprocess.run(argv, check=False, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if not out.exists():  # say why, in one line
        print(f"# c={concurrency}: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
        return None
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--base-url", help="a running server to measure instead of a "
                        "simulated engine started here (vLLM's CPU build, say)")
    parser.add_argument("--model", default="sim", help="its served model name")
    parser.add_argument("--tokenizer", help="the model's tokenizer folder, where the server "
                        "is not the simulated engine (which tokenizes for the client)")
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    header = ("conc", "requests", "client TTFT", "server TTFT", "overhead TTFT",
              "client E2E", "server E2E", "overhead E2E", "verdict", "why")
    print(" | ".join(header))
    with tempfile.TemporaryDirectory() as folder, (
        contextlib.nullcontext(args.base_url) if args.base_url else simulator(Path(folder))
    ) as url:
        for concurrency in args.concurrency:
            prompts = max(32, 2 * concurrency)
            for _ in range(args.repeats):
                result = bench(url, concurrency, prompts, args.output_len, Path(folder),
                               args.model, args.tokenizer)
                if result is None:
                    print(f"{concurrency} | the run wrote no result")
                    continue
                cells = [concurrency, result.get("completed")] + [
                    result.get(key) for key in (
                        "mean_ttft_ms", "server_ttft_mean_ms", "client_overhead_ttft_ms",
                        "mean_e2el_ms", "server_e2el_mean_ms", "client_overhead_e2el_ms")
                ] + [result.get("verdict"), (result.get("invalid_reason") or "")[:90]]
                print(" | ".join(f"{c:.2f}" if isinstance(c, float) else str(c)
                                 for c in cells), flush=True)


if __name__ == "__main__":
    main()
