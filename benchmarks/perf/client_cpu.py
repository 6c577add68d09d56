"""Where the load client's CPU goes, per message and per burst, read on the CPU clock (a shared
host slows the wall clock far more than it changes CPU time per message):
`python benchmarks/perf/client_cpu.py [--streams 1000 2000] [--rounds 3] [--no-pool]`.

Runs the client's own load loop (`client.run_share`, in this process, on `load/loops.py`'s
loop) against the paced server (paced_server.py; 20 tokens per stream, all streams at once),
the server pinned to core 1 and this process to core 0 where the host has two cores. Prints
per round: the loop thread's CPU time over the timed load per content message, and the CPU
time from the load's start until its first and its last request went out (the send burst),
with their wall times. `--no-pool` leaves the connections to the requests, as before
`client.open_pool`. Every load is bounded in requests and time, and the server is reaped,
also on failure. Not a pytest file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pytest_profllm.load import client, http, loops  # noqa: E402
from pytest_profllm.load.prompt import PromptRequest  # noqa: E402
from pytest_profllm.load.schedule import LoadSettings  # noqa: E402

LOAD_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {core})


class SendMarks:
    """The CPU and wall time of the first and the last request written, from the load's start."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []
        self._send = http._Connection.send

    def __enter__(self) -> SendMarks:
        marks = self.times
        send = self._send

        def marked(connection: http._Connection, *args: Any) -> None:
            marks.append((time.thread_time(), time.perf_counter()))
            send(connection, *args)

        http._Connection.send = marked  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        http._Connection.send = self._send  # type: ignore[method-assign]


async def one_load(settings: LoadSettings, streams: int, pool: bool) -> str:
    requests = [PromptRequest(prompt="hello " * 16, prompt_len=16, output_len=20)] * streams
    offsets = [0.0] * streams
    # Without the pool, called as before it was (so that a checkout without it runs too).
    on: dict[str, Any] = {"client": await client.open_pool(settings, offsets)} if pool else {}
    with SendMarks() as marks:
        cpu_start = time.thread_time()
        start = time.perf_counter()
        outcomes = await asyncio.wait_for(
            client.run_share(settings, requests, offsets, range(streams), start, **on),
            LOAD_TIMEOUT_S,
        )
        cpu = time.thread_time() - cpu_start
        wall = time.perf_counter() - start
    messages = sum(len(outcome.message_times) for outcome in outcomes)
    done = sum(outcome.success for outcome in outcomes)
    (first_cpu, first_wall), (last_cpu, last_wall) = marks.times[0], marks.times[-1]
    return (
        f"| {streams:,} | {'yes' if pool else 'no'} | {done} | {messages:,} "
        f"| {cpu * 1e6 / max(1, messages):.1f} | {cpu * 1000:.0f} / {wall * 1000:.0f} "
        f"| {(first_cpu - cpu_start) * 1000:.0f} / {(first_wall - start) * 1000:.0f} "
        f"| {(last_cpu - cpu_start) * 1000:.0f} / {(last_wall - start) * 1000:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1000, 2000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-pool", action="store_true", help="no connections opened ahead")
    args = parser.parse_args()
    port = free_port()
    paced = ROOT / "benchmarks" / "perf" / "paced_server.py"
    server = subprocess.Popen(
        [sys.executable, str(paced), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: _pin(1),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the paced server did not start")
            time.sleep(0.1)
        _pin(0)
        settings = LoadSettings(base_url=f"http://127.0.0.1:{port}", model="paced")
        print(f"load average before: {os.getloadavg()[0]:.2f}; loop: {loops.name()}")
        print("| streams | pool opened ahead | completed | messages | CPU per message (µs) "
              "| load CPU / wall (ms) | first send CPU / wall (ms) | last send CPU / wall (ms) |")
        print("|---|---|---|---|---|---|---|---|")
        for _ in range(args.rounds):
            for streams in args.streams:
                print(loops.run(one_load(settings, streams, not args.no_pool)), flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
