"""How much of a load's cores processes outside the session used while the load ran: the
host's share of what was measured.

The kernel counts each core's busy time whoever ran there (psutil's per-CPU times, from
/proc/stat). Over a load's window, the busy time of its cores (the client's, and a server's
where it holds cores) less the CPU time of the session's own processes that may run there is
what others took: `host_foreign_cpu_share`, a fraction of those cores' time (0 to 1).

Per-process CPU time has no per-core split. A session process allowed on the load's cores and
on others (a server starting, the controller) is counted as though it ran on the load's cores
alone, so the share errs low: a quiet host is never called busy for the session's own work.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import psutil

# `--profllm-max-foreign-cpu`'s default: off. benchmarks/perf/foreign_cpu.py, with a CPU hog
# pinned to each core of a 2-core host in turn, measured shares of 0.42 to 0.95 of the load's
# cores while the smoke suite's medians moved 2.7 % at most and its throughputs 1.4 % (the
# simulated engine kept its pace; the schedule-lag and client-overhead rules judge the cases
# where the host does move the figures). So a high share alone is no reason to call a case
# invalid; a change the gate finds on such a run is named with it (`FOREIGN_NOTE_SHARE`).
DEFAULT_MAX_FOREIGN_CPU = 1.0
# Over this share, a change the gate finds says the host was busy: the change may be its.
FOREIGN_NOTE_SHARE = 0.25
FOREIGN_PREFIX = "host busy: processes outside the session used"


def session_root() -> int:
    """The session's first process: an xdist worker's controller, else this process."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


def _busy_seconds(cores: frozenset[int]) -> float:
    per_core = psutil.cpu_times(percpu=True)
    busy = 0.0
    for core in cores:
        if core < len(per_core):
            times = per_core[core]
            # Idle and I/O wait are not work; guest time is already inside user time.
            busy += (
                times.user
                + times.nice
                + times.system
                + getattr(times, "irq", 0.0)
                + getattr(times, "softirq", 0.0)
                + getattr(times, "steal", 0.0)
            )
    return busy


def _session_seconds(root: int, cores: frozenset[int]) -> dict[tuple[int, float], float]:
    """CPU seconds of each session process allowed on any of `cores`, by (pid, start time)."""
    seconds: dict[tuple[int, float], float] = {}
    with contextlib.suppress(psutil.Error):
        top = psutil.Process(root)
        for process in [top, *top.children(recursive=True)]:
            with contextlib.suppress(psutil.Error, OSError):
                if cores.isdisjoint(process.cpu_affinity() or ()):
                    continue
                used = process.cpu_times()
                seconds[(process.pid, process.create_time())] = used.user + used.system
    return seconds


@dataclass
class ForeignCpu:
    """A window over a load's cores: `share()` at its end."""

    cores: frozenset[int]
    root: int = field(default_factory=session_root)
    _wall: float = 0.0
    _busy: float = 0.0
    _ours: dict[tuple[int, float], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._wall = time.monotonic()
        self._busy = _busy_seconds(self.cores)
        self._ours = _session_seconds(self.root, self.cores)

    def share(self) -> float | None:
        """Others' share of the cores' time since the window opened (None: no cores, or no
        time passed)."""
        wall = time.monotonic() - self._wall
        if not self.cores or wall <= 0:
            return None
        busy = _busy_seconds(self.cores) - self._busy
        now = _session_seconds(self.root, self.cores)
        # A process started in the window counts from 0; one that ended is lost (counted as
        # others': rare during a load, and it only errs towards "busy" by its own time).
        ours = sum(max(0.0, used - self._ours.get(key, 0.0)) for key, used in now.items())
        return round(min(1.0, max(0.0, (busy - ours) / (wall * len(self.cores)))), 4)


def foreign_problem(share: float | None, bound: float | None) -> str | None:
    """Why a load measured the host: others used more than `bound` of its cores (None: within
    the bound, no bound, or not measured)."""
    if share is None or bound is None or share <= bound:
        return None
    return f"{FOREIGN_PREFIX} {share:.0%} of the load's cores (bound {bound:.0%})"
