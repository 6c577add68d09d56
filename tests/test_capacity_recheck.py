"""The capacity search's re-check (load/capacity/search.py `Recheck`): one more run at the capacity
after the search, which a server that changed while it was searched misses. On fake probes
whose truth is known (steady and drifting servers), as a property over generated response
curves, and through a real pytest run against the simulator's `drift` fault
(sim/faults.py)."""

from __future__ import annotations

import sqlite3
from typing import Any

import numpy as np
import pytest
from helpers import assert_invalid, run_records, run_suites
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pytest_profllm.browse.run_capacity import recheck_verdict
from pytest_profllm.browse.run_page import run_page
from pytest_profllm.load.capacity import ProbeRun, ProbeSamples, search, slos_of
from pytest_profllm.plan.suite import CapacitySearch
from pytest_profllm.sim.batching import ConstantStepCost
from pytest_profllm.sim.cost import StepWork
from pytest_profllm.sim.faults import DriftingCost, parse_faults

BASE_MS = 50.0


class Server:
    """A server whose TTFT grows as 1 / (1 - load / capacity), and whose capacity shrinks
    with the requests it has served: capacity / (1 + drift * served). Its samples depend on
    the load and the requests only (the same shape every run), so whether a load meets is
    the truth's answer, not luck's."""

    def __init__(self, capacity: float, drift: float = 0.0, noise: float = 0.1,
                 failing_above: float | None = None) -> None:
        self.capacity, self.drift, self.noise = capacity, drift, noise
        self.failing_above = failing_above  # requests fail above this load
        self.served = 0
        self.calls: list[tuple[float, float]] = []  # (load, the capacity it met)

    def now(self) -> float:
        return self.capacity / (1 + self.drift * self.served)

    def p90_ms(self, load: float, count: int, capacity: float | None = None) -> float:
        """The p90 TTFT a run of `count` requests at `load` measures (now, by default)."""
        return float(np.percentile(self.ttft_ms(load, count, capacity or self.now()), 90))

    def ttft_ms(self, load: float, count: int, capacity: float) -> Any:
        utilisation = min(load / capacity, 0.999)
        shape = np.random.default_rng(0).lognormal(0.0, self.noise, count)
        return BASE_MS / (1 - utilisation) * shape

    def __call__(self, load: float, count: int, seed: int) -> ProbeSamples:
        capacity = self.now()
        self.calls.append((load, capacity))
        self.served += count
        ttft = self.ttft_ms(load, count, capacity)
        failed = 0
        if self.failing_above is not None and load > self.failing_above:
            failed, ttft = count // 10, ttft[count // 10:]
        return ProbeSamples(
            latencies={"ttft": ttft, "tpot": np.full(ttft.size, 10.0), "itl": np.empty(0),
                       "e2el": ttft + 100},
            completed=ttft.size,
            failed=failed,
            achieved_rate=load,
            duration_s=count / load,
        )


SEARCH = CapacitySearch(low=1, high=200, min_duration_s=1)


def test_a_steady_server_agrees_with_its_capacity() -> None:
    server = Server(40.0)
    found = search(server, slos_of({"p90_ttft_ms": 300.0}), SEARCH, 100, clock=lambda: 0.0)
    assert found.capacity is not None and found.recheck is not None
    assert found.recheck.agrees and found.changed() is None
    assert found.recheck.probe.load == found.capacity
    assert server.calls[-1][0] == found.capacity  # the last run was the re-check
    # Kept apart from the search's probes, which are what it decided on.
    assert all(probe is not found.recheck.probe for probe in found.probes)
    record = found.as_record()["recheck"]
    assert record["agrees"] is True and record["decision"] == "meets"
    assert record["readings"][0]["slo"] == "p90_ttft_ms"
    assert "re-check meets" in found.describe()


def test_a_server_that_slows_as_it_serves_says_it_changed() -> None:
    # Its capacity halves over 1,000 requests: the search's answer holds for the server it
    # began with, not for the one it ends with.
    server = Server(150.0, drift=0.001)
    found = search(server, slos_of({"p90_ttft_ms": 300.0}), SEARCH, 100, clock=lambda: 0.0)
    assert found.capacity is not None and found.recheck is not None
    # What the finding saw: a number the server no longer carries.
    assert server.p90_ms(found.capacity, found.recheck.probe.requests) > 300
    assert found.recheck.agrees is False and found.recheck.probe.decision == "misses"
    line = found.changed()
    assert line is not None and "\n" not in line
    assert line.startswith("the server changed during the search: the capacity it found, "
                           f"{found.capacity:.4g} req/s, missed when run again after it: "
                           "p90_ttft_ms ")
    assert "where the search measured" in line
    assert found.describe() == line
    assert found.as_record()["recheck"]["agrees"] is False


def test_failed_requests_at_the_capacity_on_the_recheck_disagree() -> None:
    server = Server(150.0)
    slos = slos_of({"p90_ttft_ms": 300.0})
    found = search(server, slos, SEARCH, 100, clock=lambda: 0.0,
                   recheck=Server(150.0, failing_above=0.5))
    assert found.recheck is not None and not found.recheck.agrees
    assert found.changed() is not None
    assert found.changed().endswith("missed when run again after it: "  # type: ignore[union-attr]
                                    f"{found.recheck.probe.reason}")


def test_on_an_engine_that_cannot_change_a_missed_recheck_lowers_the_capacity() -> None:
    # The virtual clock: the search's probes met at the capacity, a sample of other requests
    # there misses (here: a recheck server with less capacity stands for that sample). Not a
    # changed server: the capacity falls to the highest load below it that met.
    slos = slos_of({"p90_ttft_ms": 300.0})
    steady = search(Server(150.0), slos, SEARCH, 100, clock=lambda: 0.0)
    found = search(Server(150.0), slos, SEARCH, 100, clock=lambda: 0.0,
                   recheck=Server(100.0), steady_engine=True)
    assert steady.capacity is not None and found.recheck is not None
    missed = found.recheck.probe.load
    assert missed == steady.capacity and not found.recheck.agrees
    assert found.changed() is None and found.recheck.steady_engine
    met_below = [p.load for p in found.probes if p.decision == "meets" and p.load < missed]
    assert met_below and found.capacity == found.low == max(met_below)
    assert found.high == missed and found.limit == found.recheck.probe.reason
    assert found.kept().load == found.capacity  # its figures are the load it keeps
    assert found.describe().startswith(f"capacity {found.capacity:.4g} req/s (bracket ")
    assert f"the re-check at {missed:.4g} req/s missed; re-check misses)" in found.describe()
    record = found.as_record()["recheck"]
    assert record["agrees"] is False and record["steady_engine"] is True
    # The run page tells it as what it is, not as a server that changed.
    verdict = recheck_verdict(record)
    assert verdict.startswith("it missed: the engine cannot change")
    assert "server changed" not in verdict
    assert recheck_verdict({**record, "steady_engine": False}).startswith(
        "it missed: the server changed during the search")


def test_no_capacity_no_recheck() -> None:
    server = Server(0.5)
    found = search(server, slos_of({"median_ttft_ms": 100.0}), SEARCH, 40, clock=lambda: 0)
    assert found.capacity is None and found.recheck is None and found.changed() is None
    assert found.as_record()["recheck"] is None


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.floats(0.5, 400.0),
    drift=st.one_of(st.just(0.0), st.floats(0.0, 0.01)),
    slo_ms=st.floats(60.0, 3000.0),
    noise=st.floats(0.0, 0.3),
    over=st.sampled_from(["request_rate", "max_concurrency"]),
    precision=st.sampled_from(["2%", "5%", "25%"]),
    confirm=st.integers(1, 3),
    max_probes=st.integers(2, 12),
    failing_above=st.one_of(st.none(), st.none(), st.floats(0.5, 300.0)),
)
def test_the_answer_lies_in_its_bracket_and_a_disagreeing_recheck_is_a_change(
    capacity: float, drift: float, slo_ms: float, noise: float, over: str, precision: str,
    confirm: int, max_probes: int, failing_above: float | None,
) -> None:
    server = Server(capacity, drift, noise, failing_above)
    search_settings = CapacitySearch.model_validate({
        "over": over, "low": 1, "high": 200, "precision": precision, "confirm": confirm,
        "max_probes": max_probes, "min_duration_s": 1,
    })
    slo = slos_of({"p90_ttft_ms": slo_ms})
    run: ProbeRun = server
    found = search(run, slo, search_settings, 40, clock=lambda: 0.0)
    # The answer is the bracket's lower end, a load that met, within the range searched.
    assert found.capacity == found.low
    if found.capacity is None:
        assert found.recheck is None and found.changed() is None
        event("no capacity")
        return
    assert 1 <= found.capacity <= 200
    assert found.high is None or found.capacity < found.high
    assert any(p.load == found.capacity and p.decision == "meets" for p in found.probes)
    # The re-check ran last, at the capacity, and says "changed" exactly when it missed.
    recheck = found.recheck
    assert recheck is not None and recheck.probe.load == found.capacity
    load, truth = server.calls[-1]
    assert load == found.capacity
    assert (found.changed() is not None) == (recheck.probe.decision == "misses")
    # Where the server it ended with clearly cannot carry that load, the change is seen; a
    # server that did not change (and whose requests do not fail there) always agrees.
    statistic = server.p90_ms(load, recheck.probe.requests, truth)
    failing = failing_above is not None and load > failing_above
    if statistic > 1.5 * slo_ms or failing:
        assert found.changed() is not None
    if drift == 0.0 and not failing:
        assert found.changed() is None
    line = found.changed()
    assert line is None or ("\n" not in line and line.startswith("the server changed"))
    event(f"re-check {recheck.probe.decision}" + (", drifting" if drift else ", steady"))


def test_the_drift_fault_slows_every_step_with_the_requests_received() -> None:
    faults = parse_faults(["drift=0.002"], [])
    assert faults.drift == 0.002 and faults.names() == ["drift"]
    received = [0]
    cost = DriftingCost(ConstantStepCost(0.010), faults.drift, lambda: received[0])
    work = StepWork(decode_seqs=1)
    assert cost.step_seconds(work) == pytest.approx(0.010)
    received[0] = 500
    assert cost.step_seconds(work) == pytest.approx(0.020)


# Eight sequences, no prefix cache, short requests (a probe of 40 to 60 requests takes a
# second or two): the fresh simulator carries over 150 req/s at a median TPOT of 15 ms. With
# drift=0.01 its steps take about twice as long after 100 requests and three times by the
# search's end (some 230 requests at a coarse 50% precision), where its median TPOT is over
# 20 ms at the loads searched (measured: the re-check reads about 24 ms).
DRIFT_SUITE = """
server:
  model: sim-8b
  max_num_seqs: 8
  enable_prefix_caching: false
benchmark:
  kind: capacity
  num_prompts: 40
  random_input_len: 128
  random_output_len: 24
  slo: {median_tpot_ms: 15}
  search: {low: 4, high: 200, precision: 50%, confirm: 1, min_duration_s: 0.5, max_time_s: 90}
"""


def test_a_drifting_simulator_is_an_invalid_capacity_case(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROFLLM_SIM_FAULTS", "drift=0.01")
    pytester.makefile(".yaml", bench_drift=DRIFT_SUITE)
    result = run_suites(pytester, ports, "-rA", cache=False)
    assert_invalid(result, 1)
    result.stdout.fnmatch_lines(
        ["*invalid measurement: the server changed during the search: the capacity it found, "
         "* req/s, missed when run again after it: median_tpot_ms * over 15, where the search "
         "measured *"])
    (record,) = run_records(pytester)
    assert record["status"] == "invalid" and record["validity"] == "invalid"
    assert record["validity_reasons"][0].startswith("the server changed during the search")
    recheck = record["capacity"]["recheck"]
    assert recheck["agrees"] is False and recheck["decision"] == "misses"
    assert recheck["load"] == record["capacity"]["capacity"]
    assert recheck["readings"][0]["value"] > 15
    assert isinstance(recheck["remeasured"], list)
    # The run page says so beside the search's answer.
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        page = run_page(db, record["run_id"])
    assert page is not None and page.capacity is not None
    assert "it missed: the server changed during the search" in page.capacity
    assert page.probes[-1]["number"] == "re-check" and page.probes[-1]["decision"] == "misses"
