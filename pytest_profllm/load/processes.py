"""The load spread over several client processes, for servers faster than one event loop.

Requests are dealt round-robin; every process gets the whole schedule's times for its share and
one start moment on the host's monotonic clock (`perf_counter` is CLOCK_MONOTONIC on Linux,
shared by all processes), so the merged outcomes read as if one client had sent them.
`max_concurrency` is split between the processes as evenly as it goes. Workers are plain
subprocesses (`python -m pytest_profllm.load.processes FD`) talking over a socket pair.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from pytest_profllm.hosts.descriptors import ClientCap
from pytest_profllm.load import live_status, loops
from pytest_profllm.load.client import open_pool, run_share, run_warmups
from pytest_profllm.load.client_watch import WatchFigures, watching
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult, LoadSettings, client_cores

_START_LEAD_S = 0.05  # from the go signal to the first send, so every process is waiting
_READY_TIMEOUT_S = 120.0


def run_in_processes(
    settings: LoadSettings, requests: Sequence[PromptRequest], offsets: Sequence[float]
) -> LoadResult:
    count = min(settings.client_processes, len(requests))
    ranks = deal(requests, count)
    # Plain subprocesses over socket pairs: multiprocessing's spawn would leave its resource
    # tracker running for the rest of the caller's life.
    workers: list[tuple[subprocess.Popen[bytes], Connection]] = []
    try:
        for rank in range(count):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen(
                [sys.executable, "-m", "pytest_profllm.load.processes", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
            )
            theirs.close()
            pipe = Connection(ours.detach())
            workers.append((process, pipe))
            indices = [i for i, dealt in enumerate(ranks) if dealt == rank]
            limit = _share(settings.max_concurrency, rank, count)
            share = ([requests[i] for i in indices], [offsets[i] for i in indices], indices)
            pipe.send((settings, share, limit, rank == 0))
        for process, pipe in workers:
            if not pipe.poll(_READY_TIMEOUT_S) or pipe.recv() != "ready":
                raise RuntimeError(f"client process {process.pid} did not get ready")
        started_at = time.time()
        start = time.perf_counter() + _START_LEAD_S
        for _, pipe in workers:
            pipe.send(start)
        outcomes: list[RequestOutcome | None] = [None] * len(requests)
        cpu_seconds = 0.0
        watch: list[WatchFigures] = []
        deadline = settings.request_timeout_s + offsets[-1] + _READY_TIMEOUT_S
        for process, pipe in workers:
            if not pipe.poll(deadline):
                raise RuntimeError(f"client process {process.pid} sent no result")
            indices, share_outcomes, cpu, figures = pipe.recv()
            cpu_seconds += cpu
            watch.append(figures)
            for index, outcome in zip(indices, share_outcomes, strict=True):
                outcomes[index] = outcome
        duration = time.perf_counter() - start
    finally:
        for process, pipe in workers:
            pipe.close()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    merged = [outcome for outcome in outcomes if outcome is not None]
    return LoadResult(
        merged,
        duration,
        started_at,
        start,
        cpu_seconds=cpu_seconds,
        # A request that waited for another was due when its outcome says (client.py).
        intended_offsets=(
            [outcome.intended_start - start for outcome in merged]
            if any(request.after is not None for request in requests) else list(offsets)
        ),
        processes=count,
        watch=watch,
        cores=client_cores(),
    )


def deal(requests: Sequence[PromptRequest], count: int) -> list[int]:
    """Which process sends each request: round-robin, except that a request that waits for
    another (a trace line's parent) goes with it, so that one event loop sees both."""
    ranks: list[int] = []
    turn = 0
    for request in requests:
        if request.after is not None:
            ranks.append(ranks[request.after])
        else:
            ranks.append(turn % count)
            turn += 1
    return ranks


def _share(limit: int | None, rank: int, count: int) -> int | None:
    if limit is None:
        return None
    return max(1, limit // count + (1 if rank < limit % count else 0))


async def _load(
    pipe: Connection, settings: LoadSettings, requests: Sequence[PromptRequest],
    offsets: Sequence[float], indices: Sequence[int], limit: int | None, warm: bool,
) -> tuple[list[RequestOutcome], float, WatchFigures]:
    """This process's share of the load, on one event loop from its warmups to its end: the
    pool is opened before "ready" (off the clock, as in one process: client.open_pool), and
    the loop waits for the start in `pipe.recv()`, with nothing else to run meanwhile."""
    if warm and settings.num_warmups and requests:
        await run_warmups(settings, requests[0])
    pool = await open_pool(settings, offsets, limit)
    pipe.send("ready")
    start: float = pipe.recv()
    cpu_start = time.thread_time()
    async with watching() as figures:
        outcomes = await run_share(settings, requests, offsets, indices, start, limit, pool)
    return outcomes, time.thread_time() - cpu_start, figures[0]


def _worker(fd: int) -> None:
    pipe = Connection(fd)
    settings, (requests, offsets, indices), limit, warm = pipe.recv()
    # This process's own descriptors bound its connections (it inherited the open-file limit).
    cap = ClientCap.now()
    if cap.limits(limit or len(requests)):
        limit = cap.connections
    outcomes, cpu, figures = loops.run(
        _load(pipe, settings, requests, offsets, indices, limit, warm)
    )
    pipe.send((indices, outcomes, cpu, figures))
    pipe.close()
    live_status.close()  # its share is done: a later load's counts must not add to these


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
