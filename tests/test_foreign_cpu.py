"""The host's share of a load's cores (hosts/foreign_cpu.py): others' CPU time on the cores a
load ran on, less the session's own, and the rule that makes such a load invalid."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from helpers import assert_invalid, run_records, run_suites
from hypothesis import given
from hypothesis import strategies as st

from pytest_profllm.hosts import foreign_cpu
from pytest_profllm.hosts.devices import usable_cores
from pytest_profllm.hosts.foreign_cpu import ForeignCpu, foreign_problem
from pytest_profllm.load.validity import InvalidKind
from pytest_profllm.options import parse_share


class Clocks:
    """The three readings a window takes, set by the test: wall seconds, the cores' busy
    seconds, the session's CPU seconds by process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wall = 100.0
        self.busy = 0.0
        self.ours: dict[tuple[int, float], float] = {}
        monkeypatch.setattr(time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(foreign_cpu, "_busy_seconds", lambda cores: self.busy)
        monkeypatch.setattr(foreign_cpu, "_session_seconds", lambda root, cores: dict(self.ours))


def test_others_time_is_the_cores_busy_time_less_the_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks = Clocks(monkeypatch)
    clocks.ours = {(1, 0.0): 5.0}
    window = ForeignCpu(frozenset({0, 1}), root=1)
    # 10 s on two cores: 20 core-seconds. Busy 12, of which the session's 7 (2 more of its
    # process, 5 of one it started meanwhile): others took 5 of 20.
    clocks.wall += 10
    clocks.busy += 12
    clocks.ours = {(1, 0.0): 7.0, (2, 1.0): 5.0}
    assert window.share() == 0.25
    # A process that ended is lost: its time counts as others' (errs towards busy).
    clocks.ours = {(2, 1.0): 5.0}
    assert window.share() == 0.35


def test_no_cores_or_no_time_is_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    clocks = Clocks(monkeypatch)
    assert ForeignCpu(frozenset(), root=1).share() is None
    assert ForeignCpu(frozenset({0}), root=1).share() is None  # no time passed
    clocks.wall += 1


@given(
    busy=st.floats(0, 1e4), ours=st.floats(0, 1e4), wall=st.floats(1e-3, 1e4),
    cores=st.integers(1, 64),
)
def test_the_share_is_a_fraction_whatever_the_counters_say(
    busy: float, ours: float, wall: float, cores: int
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        clocks = Clocks(monkeypatch)
        window = ForeignCpu(frozenset(range(cores)), root=1)
        clocks.wall += wall
        clocks.busy += busy
        clocks.ours = {(1, 0.0): ours}
        share = window.share()
        assert share is not None and 0 <= share <= 1


@contextlib.contextmanager
def hog_on(core: int) -> Iterator[int]:
    """A CPU hog pinned to `core`, a child of this test (so of its session, where the window's
    root is this process)."""
    hog = subprocess.Popen(
        [sys.executable, "-c", "import os, time\n"
         f"os.sched_setaffinity(0, {{{core}}})\n"
         "end = time.monotonic() + 600\n"
         "while time.monotonic() < end: pass"],
        start_new_session=True,
    )
    try:
        time.sleep(0.3)
        yield hog.pid
    finally:
        hog.kill()
        hog.wait(timeout=10)


NO_SESSION = 2**22 + 1  # a pid no process has (above Linux's default pid_max)


def test_a_hog_pinned_to_the_loads_core_is_seen() -> None:
    core = usable_cores()[-1]
    # The hog is this test's child: a session root elsewhere (none) makes it another's.
    with hog_on(core):
        window = ForeignCpu(frozenset({core}), root=NO_SESSION)
        time.sleep(1.0)
        share = window.share()
    # It ran the whole second on that core, whatever else ran there (more, if anything).
    assert share is not None and share >= 0.8, share


def test_the_sessions_own_work_on_the_core_is_not_others() -> None:
    core = usable_cores()[-1]
    with hog_on(core) as hog:
        # One window, two views of it: the hog as the session's (this process is the root)
        # and as another's. They differ by the hog's own time there, whatever else ran.
        hog_before = _cpu_seconds(hog)
        ours = ForeignCpu(frozenset({core}), root=os.getpid())
        theirs = ForeignCpu(frozenset({core}), root=NO_SESSION)
        started = time.monotonic()
        time.sleep(1.0)
        with_theirs, with_ours = theirs.share(), ours.share()
        hog_share = (_cpu_seconds(hog) - hog_before) / (time.monotonic() - started)
    assert with_ours is not None and with_theirs is not None
    assert hog_share > 0.05  # it ran
    assert with_theirs - with_ours == pytest.approx(hog_share, abs=0.06), (
        with_ours, with_theirs, hog_share)


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def test_over_the_bound_is_the_hosts_invalid_measurement() -> None:
    assert foreign_problem(0.1, 0.25) is None
    assert foreign_problem(None, 0.25) is None
    assert foreign_problem(0.9, None) is None
    problem = foreign_problem(0.42, 0.25)
    assert problem == ("host busy: processes outside the session used 42% of the load's "
                       "cores (bound 25%)")
    assert InvalidKind.FOREIGN_CPU.host_caused  # measured again, as a late client is


@pytest.mark.parametrize(("text", "share"), [("0.25", 0.25), ("25%", 0.25), ("1", 1.0),
                                             ("0%", 0.0)])
def test_a_share_is_a_fraction_or_a_percentage(text: str, share: float) -> None:
    assert parse_share(text) == share


@pytest.mark.parametrize("text", ["1.5", "150%", "-0.1", "nan", "lots"])
def test_a_share_outside_0_to_1_is_refused(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_share(text)


@pytest.mark.skipif(len(usable_cores()) < 2, reason="needs a core for the client")
def test_a_hog_on_the_clients_core_makes_the_case_the_hosts(
    pytester: pytest.Pytester, ports: str
) -> None:
    # A load of about two seconds, on the pool's load cores (the client on the first usable
    # core, the simulator on the next), with a hog outside the session pinned to the client's
    # core: the record keeps the share, and the case is invalid for the host's sake.
    pytester.makefile(
        ".yaml",
        bench_busy="server:\n  model: Qwen/Qwen3-8B\nbenchmark:\n  num_prompts: 16\n"
        "  random_input_len: 16\n  random_output_len: 8\n  request_rate: 8\n",
    )
    with hog_on(usable_cores()[0]):
        result = run_suites(pytester, ports, "--profllm-max-foreign-cpu=0.1",
                            "--profllm-remeasure=0", load_cores=True)
    assert_invalid(result, 1)
    result.stdout.fnmatch_lines(["*invalid measurement: *host busy: processes outside the "
                                 "session used *% of the load's cores (bound 10%)*"])
    (record,) = run_records(pytester)
    assert record["status"] == "invalid"
    assert record["runtime"]["load_cores"]["client"] == [usable_cores()[0]]
    # The hog had at least half the client's core: a quarter of the load's two cores.
    assert record["system"]["host_foreign_cpu_share"] >= 0.2


def test_a_change_found_on_a_busy_run_says_the_host_may_have_made_it() -> None:
    from pytest_profllm.gates.regression import describe
    from pytest_profllm.results.record import RegressionResult

    verdict = RegressionResult(metric="p99_ttft_ms", decision="regressed", tolerance=0.05,
                                higher_is_better=False, baseline=100.0, value=130.0,
                                change=0.3, ci_low=0.2, ci_high=0.4, confidence=0.99)
    assert "host busy" not in describe(verdict)
    verdict.host_busy = 0.62
    assert describe(verdict).endswith(
        "; host busy: processes outside the session used 62% of the load's cores, the change "
        "may be the host's")
