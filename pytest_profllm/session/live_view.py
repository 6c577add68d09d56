"""The live view of a session (`--profllm-live`), drawn by the controller from the status files
every process of the session writes (load/live_status.py).

On a terminal: one line per running case under pytest's own output, redrawn twice a second
with rich's `Live`. pytest's terminal reporter keeps writing what it writes; its writes go
through `_Passage`, which hands whole lines to rich to print above the live lines and shows
an unfinished one (the progress dots) as the first live line, so pytest's text is unchanged.
Without a terminal (CI logs): one summary line per running case every `LOG_EVERY_S`, at most;
nothing with `-q`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import pytest

from pytest_profllm.load import live_status
from pytest_profllm.options import LiveMode
from pytest_profllm.plan.case import printable

LOG_EVERY_S = 30.0
REFRESH_PER_SECOND = 2.0
LOAD_STAGES = ("loading", "searching", "remeasuring", "profiling")  # with a load's figures
_BAR_WIDTH = 12
# A terminal narrower than this draws each case's two most telling figures, without the bar.
NARROW_COLUMNS = 120


@dataclass
class RunningCase:
    """A case as the view shows it: its processes' statuses merged."""

    case: str
    worker: str
    stage: str
    detail: str
    stage_since: float
    warming_up: bool
    total: int
    sent: int
    done: int
    failed: int
    load_started: float | None
    last_sent: float | None
    target_rate: float | None
    lag_s: float
    median_ttft_ms: float | None
    median_tpot_ms: float | None
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None


def merge(statuses: list[dict[str, Any]]) -> list[RunningCase]:
    """One entry per running case: the stage from the process that runs it (the one that
    names its worker), the requests summed over its client processes."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for status in statuses:
        by_case.setdefault(str(status.get("case")), []).append(status)
    cases = []
    for name, parts in by_case.items():
        lead = max(parts, key=lambda part: (bool(part.get("worker")), len(part["history"])))
        if lead.get("stage") == live_status.FINISHED:
            continue
        ttfts = [p["median_ttft_ms"] for p in parts if p.get("median_ttft_ms") is not None]
        tpots = [p["median_tpot_ms"] for p in parts if p.get("median_tpot_ms") is not None]
        started = [p["load_started"] for p in parts if p.get("load_started") is not None]
        cases.append(RunningCase(
            # The files' text as the terminal shows it, never a control sequence of its own.
            case=printable(name),
            worker=printable(lead.get("worker", "")),
            stage=printable(lead["stage"]),
            detail=printable(lead.get("detail", "")),
            stage_since=lead.get("stage_since", 0.0),
            warming_up=any(p.get("warming_up") for p in parts),
            total=sum(p.get("total", 0) for p in parts),
            sent=sum(p.get("sent", 0) for p in parts),
            done=sum(p.get("done", 0) for p in parts),
            failed=sum(p.get("failed", 0) for p in parts),
            load_started=min(started) if started else None,
            last_sent=max((p["last_sent"] for p in parts if p.get("last_sent")), default=None),
            target_rate=lead.get("target_rate") or next(
                (p["target_rate"] for p in parts if p.get("target_rate")), None),
            lag_s=max(p.get("lag_s", 0.0) for p in parts),
            # A client process's share is a sample of the load: their medians' mean is near.
            median_ttft_ms=sum(ttfts) / len(ttfts) if ttfts else None,
            median_tpot_ms=sum(tpots) / len(tpots) if tpots else None,
            running=lead.get("running"),
            waiting=lead.get("waiting"),
            kv_cache_usage=lead.get("kv_cache_usage"),
        ))
    return sorted(cases, key=lambda case: (case.worker, case.case))


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def stage_text(case: RunningCase, now: float) -> str:
    """`starting qwen-tp1 (12s)`, `searching probe 3 at 8 req/s`, `loading (warming up)`."""
    text = f"{case.stage} {case.detail}".strip()
    if case.stage in ("waiting", "starting"):
        text += f" ({_duration(now - case.stage_since)})"
    if case.warming_up:
        text += " (warming up)"
    return text


def progress_text(case: RunningCase, now: float) -> str:
    """The load's figures in one string; empty outside a load (a finished load's figures
    would read as the next stage's)."""
    if not case.total or case.load_started is None or case.stage not in LOAD_STAGES:
        return ""
    elapsed = max(now - case.load_started, 1e-9)
    parts = [f"{case.done}/{case.total}"]
    if case.failed:
        parts.append(f"{case.failed} failed")
    # Against the target: whether the client keeps the schedule.
    target = f"/{case.target_rate:.3g}" if case.target_rate else ""
    parts.append(f"{_send_rate(case, now):.1f}{target} req/s")
    parts.append(f"lag {case.lag_s * 1000:.0f} ms")
    if case.median_ttft_ms is not None:
        parts.append(f"TTFT {case.median_ttft_ms:.0f} ms")
    if case.median_tpot_ms is not None:
        parts.append(f"TPOT {case.median_tpot_ms:.1f} ms")
    if case.running is not None or case.waiting is not None:
        parts.append(f"run {_count(case.running)} wait {_count(case.waiting)}")
    if case.kv_cache_usage is not None:
        parts.append(f"KV {case.kv_cache_usage * 100:.0f}%")
    if 0 < case.done < case.total:
        parts.append(f"~{_duration((case.total - case.done) * elapsed / case.done)} left")
    return "  ".join(parts)


def telling_text(case: RunningCase, now: float) -> str:
    """The load's two most telling figures, for a narrow terminal (tmux's default is 80
    columns): how far it is, and the median TTFT where known, else the send rate."""
    if not progress_text(case, now):
        return ""
    count = f"{case.done}/{case.total}"
    if case.median_ttft_ms is not None:
        return f"{count}  TTFT {case.median_ttft_ms:.0f} ms"
    return f"{count}  {_send_rate(case, now):.1f} req/s"


def _send_rate(case: RunningCase, now: float) -> float:
    """Sent, not done, over the sending: whether the client keeps the schedule."""
    assert case.load_started is not None
    sending = (case.last_sent if case.sent >= case.total and case.last_sent else now)
    return case.sent / max(sending - case.load_started, 1e-9)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def log_line(case: RunningCase, now: float) -> str:
    """One line of a log without a terminal."""
    where = f"[{case.worker}] " if case.worker else ""
    progress = progress_text(case, now)
    return f"profllm live: {where}{case.case}: {stage_text(case, now)}" + (
        f"; {progress}" if progress else ""
    )


def resolve_mode(mode: LiveMode, isatty: bool, quiet: bool) -> Literal["terminal", "log", "off"]:
    """What the view draws: on a terminal its live lines; without one (a CI log) a line per
    running case now and then, and nothing with -q; `on` the live lines wherever it writes;
    `off` nothing."""
    if mode == "off":
        return "off"
    if isatty or mode == "on":
        return "terminal"
    return "off" if quiet else "log"


class LogView:
    """Without a terminal: each running case's line every `every_s`, at most, from a thread
    that ticks once a second; `tick` is the whole of it, with the clock injected for tests."""

    def __init__(
        self,
        folder: Path,
        write: Callable[[list[str]], None],
        clock: Callable[[], float] = time.time,
        every_s: float = LOG_EVERY_S,
    ) -> None:
        self.folder, self.write, self.clock, self.every_s = folder, write, clock, every_s
        self.first_seen: dict[str, float] = {}
        self.last_said: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> list[str]:
        now = self.clock()
        lines = []
        cases = merge(live_status.read_folder(self.folder))
        for case in cases:
            seen = self.first_seen.setdefault(case.case, now)
            since = self.last_said.get(case.case, seen)
            if now - since >= self.every_s:
                self.last_said[case.case] = now
                lines.append(log_line(case, now))
        if lines:
            self.write(lines)
        return lines

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(1.0):
                with contextlib.suppress(Exception):  # the view never costs the session
                    self.tick()

        self._thread = threading.Thread(target=loop, name="profllm-live-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class _Passage:
    """The file pytest's terminal writer writes to while the live lines are drawn: whole lines
    go above them through rich (one lock: rich's console's), an unfinished line waits in
    `open_line` and is drawn as the first live line until pytest ends it."""

    def __init__(self, original: IO[str], console: Any) -> None:
        self.original, self.console = original, console
        self.open_line = ""

    def write(self, text: str) -> int:
        from rich.text import Text  # deferred: rich only where the view draws

        with self.console:  # rich's lock: a refresh never draws between our writes
            *whole, self.open_line = (self.open_line + text).split("\n")
            for line in whole:
                self.console.print(Text.from_ansi(_shown(line)), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        self.console.file.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, fileno: the terminal's
        return getattr(self.original, name)


def _shown(line: str) -> str:
    """What a terminal shows of a line pytest rewrote with carriage returns (xdist's
    `initialized: 1/2 workers`): its last part."""
    return line.rsplit("\r", 1)[-1]


class TerminalView:
    """On a terminal: rich's Live, transient (it leaves nothing when it stops)."""

    def __init__(self, folder: Path, writer: Any, out: IO[str]) -> None:
        from rich.console import Console  # deferred: rich only where the view draws
        from rich.live import Live  # deferred: rich only where the view draws

        self.folder, self.writer = folder, writer
        # Colours as pytest's own (--color=no, NO_COLOR).
        self.console = Console(file=out, force_terminal=True, soft_wrap=True,
                               no_color=not writer.hasmarkup)
        self.passage = _Passage(writer._file, self.console)
        self.live = Live(
            get_renderable=self.render,
            console=self.console,
            refresh_per_second=REFRESH_PER_SECOND,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def render(self) -> Any:
        from rich.console import Group  # deferred: rich only where the view draws
        from rich.text import Text  # deferred: rich only where the view draws

        now = time.time()
        try:
            cases = merge(live_status.read_folder(self.folder))
        except Exception:  # the view never costs the session
            cases = []
        width = self.console.width
        # Under NARROW_COLUMNS the bar and the long figures would push the load's figures
        # out of the line: no bar, and the two most telling figures.
        narrow = width < NARROW_COLUMNS
        keep = width // 3
        lines = [Text.from_ansi(_shown(self.passage.open_line), no_wrap=True)]
        for case in cases:
            name = case.case if len(case.case) <= keep else "…" + case.case[-keep:]
            figures = telling_text(case, now) if narrow else progress_text(case, now)
            line = Text.assemble(
                (f"{case.worker} " if case.worker else "", "dim"),
                (name, "bold"),
                " ",
                (stage_text(case, now), "cyan"),
                " ",
                "" if narrow else _bar(case),
                "" if narrow else " ",
                figures,
            )
            line.no_wrap, line.overflow = True, "ellipsis"
            line.truncate(width, overflow="ellipsis")
            lines.append(line)
        return Group(*lines)

    def start(self) -> None:
        # pytest's writer offers no public way to write elsewhere: its file is swapped for
        # the passage for the view's life, and put back when it stops.
        self.writer._file = self.passage
        self.live.start()

    def stop(self) -> None:
        self.live.stop()
        self.writer._file = self.passage.original
        if self.passage.open_line:  # pytest's unfinished line, as it would have stood
            self.passage.original.write(self.passage.open_line)
            self.passage.original.flush()


def _bar(case: RunningCase) -> Any:
    from rich.text import Text  # deferred: rich only where the view draws

    if not case.total or case.stage not in LOAD_STAGES:
        return Text("")
    filled = round(_BAR_WIDTH * case.done / case.total)
    bar = Text("━" * filled, style="green") + Text("─" * (_BAR_WIDTH - filled), style="dim")
    return bar


@dataclass
class LiveSession:
    """The controller's part: the folder the processes write to, and the view drawing it."""

    folder: Path
    owned: bool  # made here (removed at the end), not given through the environment
    out: IO[str] | None = None  # our own descriptor of the terminal, closed at the end
    view: TerminalView | LogView | None = None

    def stop(self) -> None:
        if self.view is not None:
            self.view.stop()
            self.view = None
        if self.out is not None:
            with contextlib.suppress(OSError):
                self.out.close()
            self.out = None
        if self.owned:
            os.environ.pop(live_status.DIR_ENV, None)
            os.environ.pop(SET_BY_SESSION_ENV, None)
            shutil.rmtree(self.folder, ignore_errors=True)


# The live folder a session set for its own processes: a session that inherits it (one run
# by a test of an enclosing session) makes its own instead of writing into that one.
SET_BY_SESSION_ENV = "PROFLLM_LIVE_DIR_OF_SESSION"


def folder_of(db_path: Path) -> Path:
    """The live folder of a results database: `live/` beside it, where its "Running now" page
    (browse/running_page.py) reads what runs."""
    return db_path.parent / live_status.LIVE_FOLDER


def start(config: pytest.Config, mode: LiveMode, db_path: Path | None = None
          ) -> LiveSession | None:
    """The live view for this session, started where `mode` and the output say it draws;
    the folder is set in the environment before xdist starts the workers, which inherit it.
    With a results database (`db_path`) the processes write beside it, for its "Running now"
    page, also where nothing is drawn (-q, `| cat -q`); `off` writes nothing."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return None
    writer = config.get_terminal_writer()
    quiet = config.get_verbosity() < 0
    drawn = resolve_mode(mode, _isatty(writer._file), quiet)
    if mode == "off" or (drawn == "off" and db_path is None):
        return None
    given = os.environ.get(live_status.DIR_ENV)
    if given and given == os.environ.get(SET_BY_SESSION_ENV):
        # An enclosing session's folder (a session that runs pytest, as this project's tests
        # do): inherited, not given; writing there would show our cases in its view.
        given = None
    if given:
        folder = Path(given)
    elif db_path is not None:
        folder = folder_of(db_path)
    else:
        folder = Path(tempfile.mkdtemp(prefix="profllm-live-"))
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[live_status.DIR_ENV] = os.environ[SET_BY_SESSION_ENV] = str(folder)
    live = LiveSession(folder, owned=not given)
    if drawn == "off":
        return live
    # The terminal itself, not fd 1: while a case runs in this process (-n 0) pytest
    # captures fd 1, and the view must not end up in the case's captured output.
    out = _terminal_of(writer._file)
    if out is not writer._file:
        live.out = out
    if drawn == "terminal":
        view: TerminalView | LogView = TerminalView(folder, writer, out)
    else:
        lock = threading.Lock()
        seen = [0]  # how far pytest's unfinished line went when we last wrote

        def write(lines: list[str]) -> None:
            with lock:
                # Off pytest's unfinished line (its progress dots), once per stretch of it:
                # pytest does not know we ended it, and a line it did not extend is ended.
                width = writer.width_of_current_line
                ended = "\n" if width and width != seen[0] else ""
                seen[0] = width
                out.write(ended + "\n".join(lines) + "\n")
                out.flush()

        view = LogView(folder, write)
    view.start()
    live.view = view
    return live


def _isatty(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):
        return False


def _terminal_of(file: Any) -> IO[str]:
    try:
        return os.fdopen(os.dup(file.fileno()), "w", buffering=1, encoding="utf-8",
                         errors="replace")
    except (AttributeError, OSError, ValueError):  # no descriptor (an in-process pytester)
        return file if file is not None else sys.stdout
