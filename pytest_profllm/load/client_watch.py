"""The client watching itself over a load, in each client process: how late its event loop
ran, how much of a core it used, and how long it waited for one.

A client times each message when its event loop gets to the bytes (load/http.py). A loop
that is late (its own callbacks took the core, or the host gave the core to someone else)
stamps every message it reads late by as much, and neither the CPU share nor the schedule
lag shows it: on a busy host the client gets less than its core, so its CPU share stays
under 95 % exactly when it falls furthest behind, and at an infinite rate there is no
schedule to be late for. Three figures say it directly:

- the loop's lag: a callback due every `TICK_S` on the loop's own clock, and how late it
  ran. A tick that fell due while the loop was held up counts too, with its own lateness
  (a 25 ms stall: 25, 15 and 5 ms), so the lag's percentiles are over moments of the load,
  as the messages' arrivals are, not over the loop's turns;
- the CPU share: the loop thread's CPU time over the load's wall time;
- the run-queue wait share: the time the loop thread was ready to run and waited for a core
  (`/proc/thread-self/schedstat`, its second field, in ns) over the load's wall time. None
  where the kernel keeps no such figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TICK_S = 0.010  # the lag callback's period
# The loop thread's scheduler figures: ns on a core, ns waiting on a run queue, time slices.
SCHEDSTAT = Path("/proc/thread-self/schedstat")


@dataclass(frozen=True)
class WatchFigures:
    """What one client process saw of itself over one load (ms and shares of the wall
    time); the lag figures are None where no tick fell due (a load under `TICK_S`)."""

    wall_s: float
    ticks: int
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    lag_max_ms: float | None
    cpu_share: float | None
    runqueue_wait_share: float | None  # None: no /proc/thread-self/schedstat here

    @property
    def runnable_share(self) -> float | None:
        """The share of the load the loop thread ran or waited to run: how much of a core
        it wanted, whether or not the host gave it."""
        if self.cpu_share is None or self.runqueue_wait_share is None:
            return None
        return self.cpu_share + self.runqueue_wait_share


def read_schedstat(path: Path = SCHEDSTAT) -> tuple[int, int] | None:
    """The calling thread's ns on a core and ns waiting on a run queue, or None where the
    kernel does not say (no /proc, a kernel without schedstats)."""
    try:
        fields = path.read_text().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


class ClientWatch:
    """Watches the running loop from `start` to `stop`; `stop` returns the figures. It
    costs one callback per tick (about 100 a second) and 8 bytes per tick kept."""

    def __init__(self, tick_s: float = TICK_S, schedstat: Path = SCHEDSTAT) -> None:
        self._tick_s = tick_s
        self._schedstat = schedstat
        self._lags = array("d")  # seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._wall = 0.0
        self._cpu = 0.0
        self._sched: tuple[int, int] | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start watching `loop` (the running loop by default), from this thread."""
        self._loop = loop or asyncio.get_running_loop()
        self._sched = read_schedstat(self._schedstat)
        self._cpu = time.thread_time()
        self._wall = self._loop.time()
        self._due = self._wall + self._tick_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self._record(self._loop.time())
        self._handle = self._loop.call_at(self._due, self._tick)

    def _record(self, now: float) -> None:
        """The lateness of every tick due by `now`, and the next tick's time."""
        late = now - self._due
        if late < 0:
            return
        due = math.floor(late / self._tick_s) + 1  # this tick and those that fell due since
        self._lags.extend(late - index * self._tick_s for index in range(due))
        self._due += due * self._tick_s

    def stop(self) -> WatchFigures:
        assert self._loop is not None, "stop() before start()"
        now = self._loop.time()
        wall = now - self._wall
        cpu = time.thread_time() - self._cpu
        sched = read_schedstat(self._schedstat)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._record(now)  # a tick due now that the loop has not run yet
        lags = np.frombuffer(self._lags, dtype=np.float64) * 1000 if self._lags else None
        wait_share: float | None = None
        if self._sched is not None and sched is not None and wall > 0:
            cpu = (sched[0] - self._sched[0]) / 1e9  # the scheduler's own count, to the ns
            wait_share = max(0.0, (sched[1] - self._sched[1]) / 1e9 / wall)
        return WatchFigures(
            wall_s=wall,
            ticks=len(self._lags),
            lag_p50_ms=None if lags is None else float(np.median(lags)),
            # As the schedule lag's p99: the lower of the two samples around it, so that
            # with under a hundred ticks one moment's hiccup does not decide it alone.
            lag_p99_ms=None if lags is None else float(np.percentile(lags, 99, method="lower")),
            lag_max_ms=None if lags is None else float(lags.max()),
            cpu_share=max(0.0, cpu / wall) if wall > 0 else None,
            runqueue_wait_share=wait_share,
        )


@contextlib.asynccontextmanager
async def watching() -> AsyncIterator[list[WatchFigures]]:
    """Watch the running loop over the block; the list it yields holds the figures after."""
    figures: list[WatchFigures] = []
    watch = ClientWatch()
    watch.start()
    try:
        yield figures
    finally:
        figures.append(watch.stop())


def worst(figures: list[WatchFigures]) -> dict[str, float | None]:
    """The client's health figures from each process's: each lag figure of the latest loop,
    and the CPU and run-queue shares of the process that wanted the most of a core (a share
    is one process's, never a sum over processes). All None without figures (the virtual
    clock's client, a load no watch saw)."""

    def most(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        return max(known) if known else None

    busiest = max(
        figures,
        key=lambda f: f.runnable_share if f.runnable_share is not None else f.cpu_share or 0.0,
        default=None,
    )
    return {
        "client_loop_lag_p50_ms": most([f.lag_p50_ms for f in figures]),
        "client_loop_lag_p99_ms": most([f.lag_p99_ms for f in figures]),
        "client_loop_lag_max_ms": most([f.lag_max_ms for f in figures]),
        "client_cpu_share": None if busiest is None else busiest.cpu_share,
        "client_runqueue_wait_share": None if busiest is None else busiest.runqueue_wait_share,
    }
