"""How far off is the client's TTFT when it is the bottleneck, and does it know?
`python benchmarks/perf/client_error.py [--streams 1000 2000 4000] [--hog]
[--client-processes 1 2] [--loop asyncio uvloop] [--vllm-python PATH]`.

Runs `profllm bench` (one client process) against the paced server (paced_server.py: first
token 50 ms after a request is read, then one every 10 ms) with all requests at once
(`request_rate: inf`, as many streams as requests), and sets each request's TTFT as the
client measured it against the server's own (its first token's write less its request's
arrival at the server's socket, the kernel's receive stamp, from the server's log): the
difference is what the client added, sending and reading. Prints per run: median and p99 of
that error, the messages the client read per second, its CPU (share of a core, and CPU time
per content message over the timed load), its event loop's p99 lag and run-queue wait share
(load/client_watch.py), the server's tick lateness and how late it read requests the kernel
had (its own, not counted in the error), and the load's validity with its reasons.

`--hog` runs a CPU hog pinned to the client's core (the client on core 0, the server and
the hog's host neighbours elsewhere): a client slowed on purpose, for the `client_saturated`
bounds (load/metrics.py). `--pin` pins the client to core 0 and the server to core 1
without a hog. Every process it starts is reaped, also on failure; every load is bounded in
requests and time. Not a pytest file.

`--client-processes 1 2` runs every stream count with the load spread over each number of
client processes (load/processes.py), and checks the merged record: every request completed
and read by the server once (`completed` against the server's count of requests and of
distinct request ids). `--loop asyncio uvloop` runs each under each event loop: `uvloop`
installs uvloop's loop policy in the bench process before it starts (one client process;
uvloop must be installed).

`--vllm-python PATH` also runs vLLM's own client once per stream count, `PATH -m
vllm.entrypoints.cli.main bench serve` (the Python of an environment with vLLM, whose `vllm bench
serve` runs), with the same requests: random dataset, the same input and output lengths,
`--ignore-eos`, `--request-rate inf`, pinned like ours (its own random prompts of those lengths,
not our prompts' tokens). Its client sends each request's id as
`X-Request-Id` (`--request-id-prefix vllm-`, then the request's index, the order of its
detailed result), so its TTFTs are joined with the server's per request as ours are; its ready
check is skipped (`--ready-check-timeout-sec 0`), so the server reads only the timed requests.
Should a version send no id the server logged, its TTFTs are set against the server's own
first-token delays sorted (distributions, not requests), and the row says `sorted`. Its row
names the client and version in the loop column; its CPU is the whole process's CPU time
(rusage, start-up and imports included, so no share nor per-message figure); vLLM's client has
no loop-lag or validity figures (`-`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SIM_TOKENIZER = ROOT / "pytest_profllm" / "sim" / "model"
RUN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pinned(core: int | None) -> Any:
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


@contextlib.contextmanager
def started(argv: list[str], core: int | None = None, port: int | None = None) -> Iterator[None]:
    """A process (waited for until `port` accepts connections, where given), always reaped."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=ROOT, preexec_fn=_pinned(core))
    try:
        deadline = time.monotonic() + 60
        while port is not None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv} did not start")
            time.sleep(0.1)
        yield
    finally:
        process.kill()
        process.wait()


def server_log(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/log", timeout=30) as response:
        log: dict[str, Any] = json.loads(response.read())
        return log


_UVLOOP_BENCH = (
    "import runpy, uvloop; uvloop.install(); "
    "runpy.run_module('pytest_profllm.cli', run_name='__main__', alter_sys=True)"
)


def bench(url: str, out: Path, streams: int, output_len: int, core: int | None,
          processes: int = 1, loop: str = "asyncio") -> dict[str, Any]:
    result = out / f"streams-{streams}.json"
    result.unlink(missing_ok=True)
    start = ["-c", _UVLOOP_BENCH] if loop == "uvloop" else ["-m", "pytest_profllm.cli"]
    argv = [sys.executable, *start, "bench", "--base-url", url,
            "--model", "paced", "--tokenizer", str(SIM_TOKENIZER),
            "--num-prompts", str(streams), "--random-input-len", "16",
            "--random-output-len", str(output_len), "--request-rate", "inf",
            "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", result.name, "--client-processes", str(processes)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, preexec_fn=_pinned(core), check=False)
    # profllm bench exits 3 where the load is invalid: its figures still come back.
    if done.returncode not in (0, 3) or not result.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"profllm bench failed ({done.returncode}): " + " | ".join(tail))
    figures: dict[str, Any] = json.loads(result.read_text())
    return figures


VLLM_ID_PREFIX = "vllm-"


def vllm_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout.strip()


def vllm_bench(python: str, url: str, out: Path, streams: int, output_len: int,
               core: int | None) -> tuple[dict[str, Any], float]:
    """vLLM's `bench serve` result for the same load, and the CPU time (s) its process used."""
    result = out / f"vllm-streams-{streams}.json"
    result.unlink(missing_ok=True)
    argv = [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "vllm", "--base-url", url, "--model", "paced",
            "--tokenizer", str(SIM_TOKENIZER), "--dataset-name", "random",
            "--num-prompts", str(streams), "--random-input-len", "16",
            "--random-output-len", str(output_len), "--ignore-eos", "--request-rate", "inf",
            "--request-id-prefix", VLLM_ID_PREFIX, "--ready-check-timeout-sec", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
            "--result-filename", result.name]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, preexec_fn=_pinned(core), check=False,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not result.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): " + " | ".join(tail))
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    figures: dict[str, Any] = json.loads(result.read_text())
    return figures, cpu_s


def errors_ms(result: dict[str, Any], log: dict[str, Any],
              prefix: str = "profllm-") -> tuple[list[float], list[float]]:
    """Each completed request's TTFT as the client measured it less the server's own (what
    the client and the way there and back added), and of it the reading side: how long after
    the server wrote the first token the client stamped it (perf_counter is the host's
    monotonic clock in both processes). The rest is the sending side. The server's own TTFT
    runs from the kernel's stamp of the request's arrival at its socket (`arrived`), so its
    lateness in reading the request is its own, not the client's."""
    added, reading = [], []
    arrived = log.get("arrived") or log["read"]
    rows = zip(result["ttfts"], result["start_times"], result["errors"], strict=True)
    for index, (ttft, start, error) in enumerate(rows):
        request_id = f"{prefix}{index}"
        if error or request_id not in log["first"]:
            continue
        first = log["first"][request_id]
        added.append((ttft - (first - arrived[request_id])) * 1000)
        reading.append((start + ttft - first) * 1000)
    return added, reading


def sorted_errors_ms(result: dict[str, Any], log: dict[str, Any]) -> list[float]:
    """Where no request can be joined: the client's TTFTs against the server's first-token
    delays, both sorted (the i-th fastest against the i-th fastest)."""
    ttfts = sorted(t for t, e in zip(result["ttfts"], result["errors"], strict=True) if not e)
    arrived = log.get("arrived") or log["read"]
    served = sorted(first - arrived[rid] for rid, first in log["first"].items()
                    if rid in arrived)
    return [(ttft - own) * 1000 for ttft, own in zip(ttfts, served, strict=False)]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def counted_once(streams: int, result: dict[str, Any], log: dict[str, Any]) -> str:
    """`completed / server's requests / distinct ids`, each to be `streams`."""
    return f"{result['completed']}/{log['requests']}/{len(log['read'])}" + (
        "" if result["completed"] == log["requests"] == len(log["read"]) == streams else " !"
    )


def read_lateness_ms(log: dict[str, Any]) -> str:
    """How late the server read requests after the kernel had them, median / p99 (ms)."""
    arrived = log.get("arrived") or {}
    late = [(log["read"][rid] - at) * 1000 for rid, at in arrived.items() if rid in log["read"]]
    return _median_p99(late)


def row(streams: int, result: dict[str, Any], log: dict[str, Any], processes: int = 1,
        loop: str = "asyncio") -> str:
    errors, reading = errors_ms(result, log)
    events = (result["total_output_tokens"] or 0) / result["duration"]
    # CPU time per message: far less sensitive to a shared host than any wall-clock figure.
    cpu_s = result["client_cpu_percent"] / 100 * processes * result["duration"]
    per_message_us = cpu_s / max(1, result["total_output_tokens"] or 0) * 1e6
    wait = result.get("client_runqueue_wait_share")
    reason = result.get("invalid_reason") or ""
    return (
        f"| {streams:,} | {processes} | {loop} | {counted_once(streams, result, log)} "
        f"| {statistics.median(errors):.1f} / {percentile(errors, 0.99):.1f} "
        f"| {statistics.median(reading):.1f} / {percentile(reading, 0.99):.1f} "
        f"| {events:,.0f} | {result['client_cpu_percent']:.0f} % | {per_message_us:.1f} "
        f"| {result['client_loop_lag_p99_ms']:.1f} / {result['client_loop_lag_max_ms']:.1f} "
        f"| {'-' if wait is None else f'{wait:.2f}'} "
        f"| {log['tick_lateness_p99_ms']:.1f} | {read_lateness_ms(log)} "
        f"| {result['validity']} | {reason} |"
    )


def _median_p99(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} / {percentile(values, 0.99):.1f}" if values else "-"


def vllm_row(streams: int, version: str, result: dict[str, Any], cpu_s: float,
             log: dict[str, Any]) -> str:
    errors, reading = errors_ms(result, log, VLLM_ID_PREFIX)
    joined = "per request, joined by X-Request-Id"
    if not errors:
        errors, reading, joined = sorted_errors_ms(result, log), [], "sorted, not joined"
    ids = sum(1 for rid in log["read"] if rid.startswith(VLLM_ID_PREFIX)) if reading else len(
        log["read"]
    )
    completed = f"{result['completed']}/{log['requests']}/{ids}" + (
        "" if result["completed"] == log["requests"] == ids == streams else " !"
    )
    events = (result["total_output_tokens"] or 0) / result["duration"]
    return (
        f"| {streams:,} | 1 | vllm {version} | {completed} "
        f"| {_median_p99(errors)} | {_median_p99(reading)} | {events:,.0f} "
        f"| {cpu_s:.1f} s CPU, whole process | - | - | - "
        f"| {log['tick_lateness_p99_ms']:.1f} | {read_lateness_ms(log)} | - | {joined} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--output-len", type=int, default=20)
    parser.add_argument("--hog", action="store_true", help="a CPU hog on the client's core")
    parser.add_argument("--pin", action="store_true", help="client on core 0, server on 1")
    parser.add_argument("--client-processes", type=int, nargs="+", default=[1])
    parser.add_argument("--loop", nargs="+", default=["asyncio"], choices=["asyncio", "uvloop"])
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="also run vLLM's `bench serve` from this Python, per stream count")
    args = parser.parse_args()
    pin = args.pin or args.hog
    client_core, server_core = (0, 1) if pin else (None, None)
    version = vllm_version(args.vllm_python) if args.vllm_python else ""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = [sys.executable, str(ROOT / "benchmarks" / "perf" / "paced_server.py"),
              "--port", str(port)]
    print(f"load average before: {os.getloadavg()[0]:.2f}; hog on the client's core: {args.hog}")
    print("| streams | client processes | loop | completed / read / ids "
          "| TTFT error median / p99 (ms) | of it, reading (ms) | messages/s "
          "| client CPU | CPU per message (µs) "
          "| loop lag p99 / max (ms) | run-queue wait share | server tick lateness p99 (ms) "
          "| server read lateness median / p99 (ms) | validity | reasons |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        stack.enter_context(started(server, server_core, port))
        if args.hog:
            stack.enter_context(started([sys.executable, "-c", "while True: pass"],
                                        client_core))
        for streams in args.streams:
            for processes in args.client_processes:
                for loop in args.loop:
                    server_log(url)  # forget the warm-up's and earlier runs' requests
                    result = bench(url, Path(folder), streams, args.output_len, client_core,
                                   processes, loop)
                    print(row(streams, result, server_log(url), processes, loop), flush=True)
            if version:
                server_log(url)
                theirs, cpu_s = vllm_bench(args.vllm_python, url, Path(folder), streams,
                                           args.output_len, client_core)
                print(vllm_row(streams, version, theirs, cpu_s, server_log(url)), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
