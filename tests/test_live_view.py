"""The live view (`--profllm-live`): each running case's stage and progress, written
by the processes that run it into the session's live folder and drawn by the controller: on a
terminal one line per case, under xdist every worker's; without one a line per case every
30 s at most, and nothing with -q."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_invalid, run_suites

from pytest_profllm.load import live_status
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.session import live_view
from pytest_profllm.session.live_view import LogView, merge, resolve_mode

# A target rate no client keeps (a schedule lag under 0.1 us): every attempt is invalid for
# the host's sake, so the load is measured again.
PACED = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 4
  request_rate: 50
"""
# Two servers, each case long enough (40 requests at 10/s) for the view to draw them both.
TWO_SERVERS = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [0, 1]
benchmark:
  num_prompts: 40
  random_input_len: 16
  random_output_len: 8
  request_rate: 10
"""
CAPACITY = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: 8
  max_model_len: 2048
benchmark:
  kind: capacity
  num_prompts: 200
  random_input_len: 256
  random_output_len: 32
  slo: {p90_ttft_ms: 300, median_tpot_ms: 20}
  search: {low: 2, high: 200, precision: 10%, min_duration_s: 3}
"""
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _histories(folder: Path) -> dict[str, list[str]]:
    """Each case's stages as its worker's status file says (a finished case stays there)."""
    return {
        status["case"]: status["history"]
        for status in live_status.read_folder(folder)
        if status["worker"]
    }


def test_a_case_reports_its_stages_waiting_starting_loading_remeasuring(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "live"
    folder.mkdir()
    monkeypatch.setenv(live_status.DIR_ENV, str(folder))  # given: kept after the session
    pytester.makefile(".yaml", bench_lag=PACED)
    result = run_suites(pytester, ports, "-n", "0", "--profllm-max-schedule-lag", "0.0001",
                        "--profllm-remeasure", "1", gpus=1)
    assert_invalid(result, 1)  # invalid: the client cannot keep such a lag
    ((case, history),) = _histories(folder).items()
    assert case.endswith("::random")
    assert history == [
        "waiting: 1 GPU(s) and a port",
        "starting: qwen3-8b",
        "loading",
        "remeasuring: attempt 2",
        "finished",
    ]


def test_a_capacity_search_reports_each_probe_and_its_recheck(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "live"
    folder.mkdir()
    monkeypatch.setenv(live_status.DIR_ENV, str(folder))
    pytester.makefile(".yaml", bench_cap=CAPACITY)
    result = run_suites(pytester, ports, "--profllm-sim-clock", "virtual", cache=False)
    result.assert_outcomes(passed=1)
    ((_, history),) = _histories(folder).items()
    searching = [stage for stage in history if stage.startswith("searching: ")]
    assert searching[0] == "searching: probe 1 at 20 req/s"  # the bracket's middle first
    assert searching[-1].startswith("searching: re-check at ")
    assert history[-1] == "finished"
    numbers = [int(s.split()[2]) for s in searching[:-1]]
    assert numbers == sorted(numbers) and numbers[-1] > 2


def test_under_xdist_the_controller_draws_every_workers_cases(
    pytester: pytest.Pytester, ports: str
) -> None:
    """`on` draws the live lines also where the output is no terminal (here, a pipe)."""
    pytester.makefile(".yaml", bench_two=TWO_SERVERS)
    result = run_suites(pytester, ports, "-n", "2", "--profllm-live", "on", "-v")
    result.assert_outcomes(passed=2)
    text = _ANSI.sub("", result.stdout.str())
    drawn = [line for line in text.splitlines() if re.match(r"gw[01] .*::random loading", line)]
    assert {line[:3] for line in drawn} == {"gw0", "gw1"}
    # A pipe is 80 columns: the two most telling figures.
    assert any(re.search(r" \d+/40  (TTFT \d+ ms|[\d.]+ req/s)", line) for line in drawn)
    # pytest's own lines are there, whole, as without the view.
    result.stdout.fnmatch_lines(["*PASSED*qwen3-0.6b-s0::random*", "*2 passed*"])


def test_without_a_terminal_a_short_session_prints_no_live_line(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_two=TWO_SERVERS.replace("num_prompts: 40", "num_prompts: 4"))
    result = run_suites(pytester, ports, "-n", "2", "-q")
    result.assert_outcomes(passed=2)
    assert "profllm live" not in result.stdout.str()


@pytest.mark.parametrize(
    ("mode", "isatty", "quiet", "drawn"),
    [
        ("auto", True, False, "terminal"),
        ("auto", True, True, "terminal"),
        ("auto", False, False, "log"),
        ("auto", False, True, "off"),
        ("on", False, False, "terminal"),
        ("off", True, False, "off"),
        ("off", False, False, "off"),
    ],
)
def test_the_mode_and_the_output_decide_what_is_drawn(
    mode: Any, isatty: bool, quiet: bool, drawn: str
) -> None:
    assert resolve_mode(mode, isatty, quiet) == drawn


def _status(case: str, **fields: Any) -> dict[str, Any]:
    return {**live_status.CaseStatus(case).__dict__, **fields}


def _write(folder: Path, name: str, *statuses: dict[str, Any]) -> None:
    (folder / f"{name}.json").write_text(json.dumps({"cases": list(statuses)}))


def test_without_a_terminal_each_case_says_one_line_per_30_s_at_most(tmp_path: Path) -> None:
    now = [1000.0]
    said: list[list[str]] = []
    view = LogView(tmp_path, said.append, clock=lambda: now[0])
    running = _status("suite::a", worker="gw0", stage="loading", history=["loading"], total=10,
                      sent=5, done=4, load_started=990.0, target_rate=1.0)
    waiting = _status("suite::b", worker="gw1", stage="waiting", detail="1 GPU(s) and a port",
                      stage_since=1000.0, history=["waiting"])
    _write(tmp_path, "1", running)
    _write(tmp_path, "2", waiting)
    for moment in (1000.0, 1010.0, 1029.9):
        now[0] = moment
        assert view.tick() == []  # the first line comes 30 s after the case is first seen
    now[0] = 1030.0
    lines = view.tick()
    assert lines == [
        "profllm live: [gw0] suite::a: loading; 4/10  0.1/1 req/s  lag 0 ms  ~1m00s left",
        "profllm live: [gw1] suite::b: waiting 1 GPU(s) and a port (30s)",
    ]
    for moment in (1031.0, 1045.0, 1059.9):
        now[0] = moment
        assert view.tick() == []
    # A case that finished says nothing more; the other its next line.
    _write(tmp_path, "2", {**waiting, "stage": live_status.FINISHED})
    now[0] = 1060.0
    later = view.tick()
    assert len(later) == 1 and later[0].startswith("profllm live: [gw0] suite::a: loading; ")
    assert said == [lines, later]


def test_a_cases_client_processes_add_up_under_its_workers_stage() -> None:
    lead = _status("s::c", worker="gw0", stage="searching", detail="probe 2 at 8 req/s",
                   history=["waiting", "starting", "searching: probe 2 at 8 req/s"])
    shares = [
        _status("s::c", total=50, done=20, failed=1, load_started=5.0, target_rate=8.0,
                lag_s=0.002, median_ttft_ms=40.0),
        _status("s::c", total=50, done=30, load_started=4.0, target_rate=8.0, lag_s=0.004,
                median_ttft_ms=60.0),
    ]
    (case,) = merge([shares[0], lead, shares[1]])
    assert (case.worker, case.stage, case.detail) == ("gw0", "searching", "probe 2 at 8 req/s")
    assert (case.total, case.done, case.failed, case.load_started) == (100, 50, 1, 4.0)
    assert case.lag_s == 0.004 and case.median_ttft_ms == 50.0
    assert live_view.stage_text(case, 0.0) == "searching probe 2 at 8 req/s"


def test_a_load_reports_its_requests_from_a_timer_not_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(live_status.DIR_ENV, str(tmp_path))
    from pytest_profllm.load import prometheus_counters, stages

    with stages.running(prometheus_counters.CaseLabels("s::c", "s", "srv"), "gw3"):
        stages.enter("loading")
        progress = live_status.load_progress(3, 2.0)
        assert progress is not None
        answered = RequestOutcome(16, success=True, ttft=0.05, latency=0.25, output_tokens=5)
        for _ in range(3):
            progress.sent(RequestOutcome(16, intended_start=1.0, dispatch_time=1.001))
        progress.done(answered)
        progress.done(RequestOutcome(16))
        found = live_status.reporter()
        assert found is not None
        found.write()  # what the timer writes
        (status,) = live_status.read_folder(tmp_path)
        assert (status["worker"], status["stage"], status["done"], status["failed"]) == (
            "gw3", "loading", 2, 1)
        assert status["median_ttft_ms"] == pytest.approx(50.0)
        assert status["median_tpot_ms"] == pytest.approx(50.0)
        with stages.during("waiting", "load cores"):
            assert found.cases["s::c"].stage == "waiting"
        assert found.cases["s::c"].stage == "loading"
        live_status.warming_up(True)  # the client's warmups, before the measured load
        (case,) = merge([dataclasses.asdict(found.cases["s::c"])])
        assert live_view.stage_text(case, 0.0) == "loading (warming up)"
        live_status.warming_up(False)
    (status,) = live_status.read_folder(tmp_path)
    assert status["stage"] == live_status.FINISHED
    assert status["history"] == ["loading", "waiting: load cores", "loading", "finished"]


def test_pytests_writes_pass_through_whole_and_an_unfinished_line_waits(tmp_path: Path) -> None:
    """What pytest's writer writes while the view draws: its whole lines printed above the
    live lines as they were, its unfinished line (progress dots) drawn as the first live line,
    and written as it stood when the view stops."""
    import io

    class Writer:  # pytest's TerminalWriter, as far as the view touches it
        hasmarkup = True

        def __init__(self) -> None:
            self._file: Any = io.StringIO()

    writer, out = Writer(), io.StringIO()
    original = writer._file
    view = live_view.TerminalView(tmp_path, writer, out)
    view.start()
    try:
        assert writer._file is view.passage
        writer._file.write("bench_x.yaml ")
        writer._file.write(".")
        writer._file.write(".   [100%]\ncreated: 1/2\rcreated: 2/2 workers\n")
        writer._file.write("tail")
        assert view.passage.open_line == "tail"
    finally:
        view.stop()
    assert writer._file is original
    shown = _ANSI.sub("", out.getvalue())
    assert "bench_x.yaml ..   [100%]\n" in shown
    assert "created: 2/2 workers\n" in shown and "created: 1/2" not in shown
    assert original.getvalue() == "tail"  # the unfinished line, where pytest's writer writes


def test_a_cases_control_characters_are_drawn_escaped(tmp_path: Path) -> None:
    # A case id whose file part held a screen clear, a window title and a newline: the view
    # drew them raw at every redraw (any process may write a live file's text).
    hostile = "bench_a\x1b[2J\x1b]0;t\x07\nFAILED x.yaml::m::random"
    shown = "bench_a\\x1b[2J\\x1b]0;t\\x07\\x0aFAILED x.yaml::m::random"
    _write(tmp_path, "1", _status(hostile, worker="gw\x9b0", stage="loading",
                                  detail="probe\x7f 1", history=["loading"]))
    (case,) = merge(live_status.read_folder(tmp_path))
    assert (case.case, case.worker, case.detail) == (shown, "gw\\x9b0", "probe\\x7f 1")
    line = live_view.log_line(case, 0.0)
    assert line == f"profllm live: [gw\\x9b0] {shown}: loading probe\\x7f 1"

    class Writer:  # pytest's TerminalWriter, as far as the view touches it
        hasmarkup = False
        _file = io.StringIO()

    out = io.StringIO()
    view = live_view.TerminalView(tmp_path, Writer(), out)
    view.console.print(view.render())
    drawn = out.getvalue()
    # The newline is text on the case's line (a long id keeps its end): no line of its own.
    assert "0aFAILED x.yaml::m::random" in drawn
    assert not [line for line in drawn.splitlines() if line.startswith("FAILED")]
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", _ANSI.sub("", drawn))
    assert "\x1b[2J" not in drawn and "\x07" not in drawn


def test_a_narrow_terminal_keeps_the_two_most_telling_figures(tmp_path: Path) -> None:
    # tmux's default 80 columns: the bar and the long figures pushed the load's figures off
    # the line, leaving only the stage.
    now = time.time()
    _write(tmp_path, "1", _status("bench_smoke.yaml::qwen3-8b-seqs32::random-rate-inf",
                                  worker="gw0", stage="loading", history=["loading"], total=200,
                                  sent=150, done=120, load_started=now - 10.0,
                                  median_ttft_ms=52.4, median_tpot_ms=8.1, running=30.0,
                                  waiting=2.0, kv_cache_usage=0.4))

    class Writer:  # pytest's TerminalWriter, as far as the view touches it
        hasmarkup = False
        _file = io.StringIO()

    for width, wide in ((80, False), (160, True)):
        out = io.StringIO()
        view = live_view.TerminalView(tmp_path, Writer(), out)
        view.console.width = width
        view.console.print(view.render())
        (line,) = [row for row in _ANSI.sub("", out.getvalue()).splitlines() if "gw0" in row]
        assert len(line) <= width
        assert "120/200" in line and "TTFT 52 ms" in line
        assert ("━" in line or "─" in line) is wide
