"""What each running case is doing now, for the live view (`--profllm-live`): its stage and its
load's progress, written by the process that runs it to a small JSON file of its own in the
session's live folder, which the controller reads (session/live_view.py).

Files rather than xdist's channel: client subprocesses report too (each its own share of the
requests), a worker that dies leaves what it said, and a live page can read the same folder.
Each process writes `<pid>.json` atomically (write, then rename) from a timer thread at most
twice a second and only when something changed: a request costs the client a few attribute
updates and an append, never a write.

The same files feed the results database's "Running now" page (browse/running_page.py): the
telemetry sampler's series so far (made by the function that makes the record's `series`, from
the same samples, when the file is written), the running medians over time (the last
`MAX_POINTS`), and each finished case's run id for
`FINISHED_KEEP_S`, so the page links to its run page.

A file names its writer (pid, the process's start time, host). Readers believe a file only as
far as `read_live` checked it: a regular file within limits.MAX_LIVE_FILE_BYTES, each field of
the type the writer writes (a number that is not finite reads as null), and the running cases
of a writer that is no longer alive dropped (a worker killed with -9 leaves its file behind);
a file that fails a check is skipped with a note, the others still read.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import socket
import stat
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pytest_profllm.limits import MAX_LIVE_FILE_BYTES, MAX_LIVE_FILES, load_json
from pytest_profllm.load.metrics import RequestOutcome

DIR_ENV = "PROFLLM_LIVE_DIR"  # the controller's folder; unset: the live view is off
CASE_ENV = "PROFLLM_LIVE_CASE"  # the running case's id, for the client processes it starts
WRITE_INTERVAL_S = 0.5
FINISHED = "finished"  # the stage of a case that ended: kept in its file, shown no more
_RECENT = 256  # the running medians are over the last this many requests
LIVE_FOLDER = "live"  # beside a results database: where its "Running now" page reads
MAX_POINTS = 600  # the running medians a file keeps per case (5 minutes at 2 a second)
FINISHED_KEEP_S = 60.0  # how long a finished case stays in its file, with its run id
# The telemetry series' fields a live file carries: what the "Running now" page draws.
POINT_FIELDS = ("t_s", "request_throughput", "output_throughput", "running", "waiting",
                "kv_cache_usage")


@dataclass
class CaseStatus:
    """One case as one process sees it; the controller merges the processes of a case."""

    case: str
    worker: str = ""
    stage: str = "starting"
    detail: str = ""
    stage_since: float = 0.0  # wall clock, so every process and the controller agree
    history: list[str] = field(default_factory=list)  # every stage entered, "stage: detail"
    warming_up: bool = False
    total: int = 0
    sent: int = 0
    done: int = 0
    failed: int = 0
    load_started: float | None = None  # wall clock
    last_sent: float | None = None  # wall clock: the achieved rate is over the sending
    target_rate: float | None = None  # req/s; None: as fast as it goes
    lag_s: float = 0.0  # how late the last request left against its schedule
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    running: float | None = None  # the server's own gauges, where it has /metrics
    waiting: float | None = None
    kv_cache_usage: float | None = None  # a fraction
    updated: float = 0.0
    run_id: str = ""  # the record's, for a link to its run page once it ended
    ended: float | None = None  # wall clock
    series_started: float | None = None  # wall clock of the telemetry series' origin
    # The telemetry sampler's series so far (telemetry.series's, POINT_FIELDS of them), and
    # the running medians as they went (t_s from series_started).
    series: list[dict[str, float | None]] = field(default_factory=list)
    latency: list[dict[str, float | None]] = field(default_factory=list)


class _Reporter:
    """This process's running cases, written by a daemon thread while any changed."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self.clock = clock
        self.cases: dict[str, CaseStatus] = {}
        self.ttft: dict[str, deque[float]] = {}
        self.tpot: dict[str, deque[float]] = {}
        # Each case's telemetry series as its sampler makes it: called when the file is written.
        self.sources: dict[str, Callable[[], list[dict[str, float | None]]]] = {}
        self.latency: dict[str, deque[dict[str, float | None]]] = {}
        self.lock = threading.Lock()
        # A plain flag, not an Event: a request sets it without taking a lock; the timer
        # looks at it twice a second.
        self.dirty = False
        self.path = folder / f"{os.getpid()}.json"
        self.writer = writer_identity()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="profllm-live", daemon=True)
        self.thread.start()

    def status(self, case: str) -> CaseStatus:
        found = self.cases.get(case)
        if found is None:
            found = self.cases[case] = CaseStatus(case, stage_since=self.clock())
            self.ttft[case], self.tpot[case] = deque(maxlen=_RECENT), deque(maxlen=_RECENT)
            self.latency[case] = deque(maxlen=MAX_POINTS)
        return found

    def forget(self, case: str) -> None:
        del self.cases[case], self.ttft[case], self.tpot[case]
        del self.latency[case]
        self.sources.pop(case, None)

    def changed(self) -> None:
        self.dirty = True

    def _loop(self) -> None:
        while True:
            time.sleep(WRITE_INTERVAL_S)  # at most two writes a second
            if self.dirty:
                self.dirty = False
                with contextlib.suppress(OSError):  # a folder gone at the session's end
                    self.write()

    def write(self) -> None:
        with self.lock:
            if self.closed:
                return
            now = self.clock()
            for name, status in self.cases.items():
                status.updated = now
                status.median_ttft_ms = _median_ms(self.ttft[name])
                status.median_tpot_ms = _median_ms(self.tpot[name])
                if (status.stage != FINISHED and status.series_started is not None
                        and status.median_ttft_ms is not None):
                    self.latency[name].append({
                        "t_s": now - status.series_started,
                        "median_ttft_ms": status.median_ttft_ms,
                        "median_tpot_ms": status.median_tpot_ms})
                if (source := self.sources.get(name)) is not None:
                    status.series = _points(source)
                status.latency = list(self.latency[name])
            payload = json.dumps({**self.writer, "cases": [asdict(s) for s in
                                                             self.cases.values()]})
            partial = self.path.with_suffix(".part")
            partial.write_text(payload)
            os.replace(partial, self.path)  # a reader sees the old file or the new, never half

    def close(self) -> None:
        with self.lock:
            self.closed = True
            with contextlib.suppress(OSError):
                self.path.unlink()


def _median_ms(values: deque[float]) -> float | None:
    return statistics.median(values) * 1000 if values else None


_reporter: _Reporter | None = None
_reporter_lock = threading.Lock()


def reporter() -> _Reporter | None:
    """This process's reporter, None where the live view is off."""
    global _reporter
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    with _reporter_lock:
        if _reporter is None or _reporter.folder != Path(folder):
            _reporter = _Reporter(Path(folder))
        return _reporter


def _current() -> tuple[_Reporter, CaseStatus] | None:
    found, case = reporter(), os.environ.get(CASE_ENV)
    if found is None or not case:
        return None
    return found, found.status(case)


@contextlib.contextmanager
def running(case: str, worker: str, run_id: str = "") -> Iterator[None]:
    """The case's status for this process and the client processes it starts; it is marked
    finished when it ends (and written at once, so the view drops it without waiting), and
    kept so, with its run id, for FINISHED_KEEP_S."""
    found = reporter()
    if found is None:
        yield
        return
    os.environ[CASE_ENV] = case
    with found.lock:
        if case in found.cases:  # a repeat of the same case starts afresh
            found.forget(case)
        status = found.status(case)
        status.worker, status.run_id = worker, run_id
    try:
        yield
    finally:
        set_stage(FINISHED)
        os.environ.pop(CASE_ENV, None)
        with found.lock:
            now = found.clock()
            found.cases[case].ended = now
            # A finished case stays a minute, for its link: the file holds what runs now.
            for name in [n for n, s in found.cases.items() if s.stage == FINISHED
                         and n != case and now - (s.ended or 0.0) > FINISHED_KEEP_S]:
                found.forget(name)
        with contextlib.suppress(OSError):
            found.write()


def set_stage(stage: str, detail: str = "") -> None:
    """The running case entered `stage` (`detail`: which probe, which lease)."""
    current = _current()
    if current is None:
        return
    found, status = current
    with found.lock:
        status.stage, status.detail, status.stage_since = stage, detail, found.clock()
        status.history.append(f"{stage}: {detail}" if detail else stage)
        if stage != "loading" and stage != FINISHED:
            status.warming_up = False
        if stage in ("searching", "remeasuring"):  # a new load comes: the last one's figures go
            status.total = status.sent = status.done = status.failed = 0
    found.changed()


def server_state(running: float | None, waiting: float | None, kv: float | None) -> None:
    """The server's queues and KV-cache use, as its last /metrics scrape said."""
    current = _current()
    if current is None:
        return
    found, status = current
    # A NaN gauge (a server's KV cache before its first step) would make the file not JSON.
    status.running, status.waiting, status.kv_cache_usage = (
        _finite(running), _finite(waiting), _finite(kv))
    found.changed()


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def series_start(source: Callable[[], list[dict[str, float | None]]]) -> None:
    """A telemetry sampler started for the running case: `source` gives its series so far
    (telemetry.series over its samples), called at most twice a second, when the file is
    written; the case's earlier series goes (a load measured again has a series of its own)."""
    current = _current()
    if current is None:
        return
    found, status = current
    with found.lock:
        status.series_started = found.clock()
        status.series = []
        found.sources[status.case] = source
        found.latency[status.case].clear()
    found.changed()


def changed() -> None:
    """Something the file shows changed (the sampler took a sample)."""
    current = _current()
    if current is not None:
        current[0].changed()


def _points(source: Callable[[], list[dict[str, float | None]]]
            ) -> list[dict[str, float | None]]:
    try:
        points = source()
    except Exception:  # any: the live page's series never costs the case its telemetry
        return []
    return [{name: point.get(name) for name in POINT_FIELDS} for point in points]


def warming_up(on: bool) -> None:
    current = _current()
    if current is None:
        return
    current[1].warming_up = on
    current[0].changed()


class LoadProgress:
    """One load's requests as they go, in this process: a listener of its requests
    (load/request_observer.py), a few updates per request."""

    def __init__(self, found: _Reporter, status: CaseStatus, total: int, rate: float) -> None:
        self._found, self._status = found, status
        self._ttft, self._tpot = found.ttft[status.case], found.tpot[status.case]
        with found.lock:
            status.total, status.sent, status.done, status.failed = total, 0, 0, 0
            status.load_started, status.last_sent, status.lag_s = found.clock(), None, 0.0
            status.target_rate = rate if math.isfinite(rate) else None
            self._ttft.clear()
            self._tpot.clear()
        found.changed()

    def sent(self, outcome: RequestOutcome) -> None:
        self._status.sent += 1
        self._status.last_sent = self._found.clock()
        self._status.lag_s = outcome.schedule_lag
        self._found.changed()

    def done(self, outcome: RequestOutcome) -> None:
        status = self._status
        status.done += 1
        if not outcome.success:
            status.failed += 1
        else:
            ttft, output_tokens = outcome.ttft, outcome.output_tokens or 0
            self._ttft.append(ttft)
            if output_tokens > 1:  # vLLM's TPOT: (E2EL - TTFT) / (output - 1)
                self._tpot.append((outcome.latency - ttft) / (output_tokens - 1))
        self._found.changed()

    def lost(self, outcome: RequestOutcome) -> None:
        """A request never sent: done, and failed, as the load's record counts it."""
        self._status.done += 1
        self._status.failed += 1
        self._found.changed()


def load_progress(total: int, rate: float) -> LoadProgress | None:
    """A tracker of the running case's load in this process, None where the view is off."""
    current = _current()
    return None if current is None else LoadProgress(*current, total, rate)


def close() -> None:
    """This process's file removed (a client process whose share of a load ended: a later
    load's counts must not add to its)."""
    if _reporter is not None:
        _reporter.close()


def writer_identity() -> dict[str, Any]:
    """What a reader tells this process by: its pid, its start time (a later process given the
    same pid started later) and its host (a folder written from another host cannot be
    checked from here)."""
    try:
        started: float | None = psutil.Process().create_time()
    except psutil.Error:
        started = None
    return {"pid": os.getpid(), "started": started, "host": socket.gethostname()}


# A process's start time as two readers compute it may differ by a clock tick (Linux counts
# from boot in ticks); a pid reused within a second of its last owner's start is not looked for.
_SAME_START_S = 1.0


def writer_alive(pid: int | None, started: float | None, host: str | None) -> bool:
    """Whether the process that wrote a file still runs. A file from another host, or one
    without a pid (written before files named their writer), is believed; one without a start
    time is checked by its pid alone."""
    if pid is None or (host is not None and host != socket.gethostname()):
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped
            return False
        return started is None or abs(process.create_time() - started) < _SAME_START_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's process: it runs
        return True


@dataclass
class LiveRead:
    """The cases of a live folder's files that passed the checks, each with every field of
    CaseStatus, and a note (one line) for each file or case left out."""

    cases: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Refused(ValueError):
    """A live file that fails a check: why, in a few words."""


def read_live(folder: Path) -> LiveRead:
    """Every process's cases in `folder` (the first MAX_LIVE_FILES `*.json` by name). A file
    that vanished between the listing and the read is skipped silently (its process ended);
    one that is not a regular file, is over MAX_LIVE_FILE_BYTES, is not JSON or has a field
    of the wrong type is skipped with a note; a dead writer's running cases are dropped with
    a note (its finished ones stay, for their minute)."""
    found = LiveRead()
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError as error:
        found.notes.append(f"{folder}: cannot be listed: {error.strerror or error}")
        return found
    if len(paths) > MAX_LIVE_FILES:
        found.notes.append(f"{folder}: {len(paths):,} live files; the first "
                           f"{MAX_LIVE_FILES:,} read")
    for path in paths[:MAX_LIVE_FILES]:
        try:
            writer, cases = _checked(load_json(_read_bounded(path), what=path.name,
                                               max_bytes=MAX_LIVE_FILE_BYTES))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:  # _Refused, json's and the limits' are too
            why = error.strerror if isinstance(error, OSError) and error.strerror else error
            found.notes.append(_one_line(f"{path.name}: skipped: {why}"))
            continue
        if writer_alive(writer.get("pid"), writer.get("started"), writer.get("host")):
            found.cases.extend(cases)
            continue
        for case in cases:
            if case["stage"] == FINISHED:
                found.cases.append(case)
            else:
                found.notes.append(_one_line(
                    f"{path.name}: process {writer['pid']} ended while {case['case']} was "
                    f"{case['stage']}: not running"))
    return found


def read_folder(folder: Path) -> list[dict[str, Any]]:
    """The cases of `read_live(folder)`."""
    return read_live(folder).cases


def _read_bounded(path: Path) -> bytes:
    # Not through a link, and nothing but a regular file: a link to /dev/zero or a FIFO
    # would read without end or block. O_NONBLOCK: opening a FIFO does not wait for a writer.
    if path.is_symlink():
        raise _Refused("a symbolic link, not a regular file")
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise _Refused("not a regular file")
        data = handle.read(MAX_LIVE_FILE_BYTES + 1)
    if len(data) > MAX_LIVE_FILE_BYTES:
        raise _Refused(f"over the {MAX_LIVE_FILE_BYTES:,} bytes a live file may have")
    return data


def _one_line(text: str, limit: int = 300) -> str:
    # A note quotes names from the file: never a line break, never a control character.
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


# The largest count a file may give: a JSON integer beyond it is no count this module wrote.
_MAX_COUNT = 2**53


def _number(value: Any, name: str) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Refused(f"{name} is {_kind(value)}, not a number")
    number = float(value) if isinstance(value, int) and abs(value) <= _MAX_COUNT else value
    if isinstance(number, int):
        raise _Refused(f"{name} is an integer beyond {_MAX_COUNT}")
    return number if math.isfinite(number) else None


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _field(kind: str, value: Any, name: str) -> Any:
    """`value` checked against the writer's type `kind` (CaseStatus's annotation)."""
    if kind == "str":
        if not isinstance(value, str):
            raise _Refused(f"{name} is {_kind(value)}, not a string")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise _Refused(f"{name} is {_kind(value)}, not true or false")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _MAX_COUNT:
            raise _Refused(f"{name} is {_kind(value)}, not a count")
        return value
    if kind in ("float", "float | None"):
        return None if value is None else _number(value, name)
    if kind == "list[str]":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise _Refused(f"{name} is not a list of strings")
        return value
    if kind == "list[dict[str, float | None]]":
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise _Refused(f"{name} is not a list of points")
        return [{key: None if item is None else _number(item, f"{name}.{key}")
                 for key, item in point.items()} for point in value]
    raise AssertionError(f"CaseStatus.{name}: no check for {kind}")


# Each field the writer writes, by its annotation's text (this module's annotations are
# strings); every one has a check above (a test reads each).
_FIELDS = {spec.name: str(spec.type) for spec in dataclasses.fields(CaseStatus)}
_DEFAULTS = asdict(CaseStatus(""))


def _checked(document: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The file's writer (pid, started, host: each None where the file lacks it) and its
    cases, each with every CaseStatus field (a missing one, or a null where the writer
    writes a number, at its default); _Refused where a field has the wrong type."""
    if not isinstance(document, dict) or not isinstance(document.get("cases"), list):
        raise _Refused("not a live file (no list of cases)")
    writer: dict[str, Any] = {}
    for name, kind in (("pid", "int"), ("started", "float | None"), ("host", "str")):
        value = document.get(name)
        writer[name] = None if value is None else _field(kind, value, name)
    if writer["pid"] is not None and writer["pid"] <= 0:
        raise _Refused(f"pid is {writer['pid']}")
    cases = []
    for index, case in enumerate(document["cases"]):
        if not isinstance(case, dict):
            raise _Refused(f"cases[{index}] is {_kind(case)}, not an object")
        if not isinstance(case.get("case"), str) or not case["case"]:
            raise _Refused(f"cases[{index}].case is not a case id")
        status = {}
        for name, kind in _FIELDS.items():
            value = _field(kind, case[name], f"cases[{index}].{name}") if case.get(
                name) is not None else None
            status[name] = value if value is not None or kind.endswith("| None") else (
                copy.deepcopy(_DEFAULTS[name]))
        cases.append(status)
    return writer, cases
