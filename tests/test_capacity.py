"""The SLO capacity search (load/capacity/) on probes whose truth is known, its settings in a
suite, and the gate's interval from its brackets. The search through real pytest runs on the
simulated engine is in test_capacity_cases.py."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import suite_error, write_suite
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.gates.regression import GateSettings, judge_regression
from pytest_profllm.gates.samples import RunSamples
from pytest_profllm.load.bench import measure
from pytest_profllm.load.capacity import (
    CapacityResult,
    Probe,
    ProbeSamples,
    ServerProbes,
    Slo,
    decide,
    requests_per_probe,
    search,
    slos_of,
)
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult
from pytest_profllm.load.validity import Judgement
from pytest_profllm.plan.regression import gated_metric
from pytest_profllm.plan.suite import CapacityConfig, CapacitySearch
from pytest_profllm.run.capacity import keep_probe_at_capacity


def queue_probe(capacity: float, base_ms: float = 50.0, noise: float = 0.1):  # type: ignore[no-untyped-def]
    """A server whose latency grows as 1 / (1 - load / capacity): samples of TTFT (ms)."""

    def run(load: float, count: int, seed: int) -> ProbeSamples:
        rng = np.random.default_rng(seed)
        utilisation = min(load / capacity, 0.999)
        scale = base_ms / (1 - utilisation)
        ttft = scale * rng.lognormal(0.0, noise, count)
        return ProbeSamples(
            latencies={"ttft": ttft, "tpot": np.full(count, 10.0), "itl": np.empty(0),
                       "e2el": ttft + 100},
            completed=count,
            achieved_rate=load,
            duration_s=count / load,
        )

    return run


def true_load(capacity: float, slo_ms: float, base_ms: float = 50.0, noise: float = 0.1,
              percentile: float = 99.0) -> float:
    """Where the server of `queue_probe` puts the percentile of TTFT at `slo_ms`."""
    from scipy import stats

    tail = math.exp(noise * stats.norm.ppf(percentile / 100))
    return capacity * (1 - base_ms * tail / slo_ms)


@pytest.mark.parametrize("capacity", [7.0, 40.0, 150.0])
def test_the_search_lands_within_its_precision_below_the_truth(capacity: float) -> None:
    slos = slos_of({"p99_ttft_ms": 500.0})
    truth = true_load(capacity, 500.0)
    found = search(queue_probe(capacity), slos, CapacitySearch(low=1, high=200), 100,
                   clock=lambda: 0.0)
    assert found.capacity is not None and found.high is not None
    assert found.capacity <= truth <= found.high * 1.001
    assert found.high / found.capacity <= 1.05
    assert truth * 0.95 <= found.capacity
    assert len(found.probes) <= 12
    assert found.limit == "p99_ttft_ms"
    # No probe above the truth said "meets"; the reported capacity is a load that met.
    assert all(p.load <= truth for p in found.probes if p.decision == "meets")
    assert any(p.load == found.capacity and p.decision == "meets" for p in found.probes)


def test_requests_per_probe_see_the_tail() -> None:
    assert requests_per_probe(slos_of({"p99_ttft_ms": 1}), 100) == 2000
    assert requests_per_probe(slos_of({"p90_ttft_ms": 1}), 100) == 200
    assert requests_per_probe(slos_of({"median_tpot_ms": 1}), 100) == 100
    assert requests_per_probe(slos_of({"median_tpot_ms": 1}), 10) == 40


def test_the_range_ends_are_reported_as_such() -> None:
    slos = slos_of({"median_ttft_ms": 100.0})
    below = search(queue_probe(0.5), slos, CapacitySearch(low=1, high=64), 40, clock=lambda: 0)
    assert below.capacity is None and below.stopped == "below the search range"
    assert below.high == 1 and "capacity: none" in below.describe()
    above = search(queue_probe(1e4), slos, CapacitySearch(low=1, high=64), 40, clock=lambda: 0)
    assert above.capacity == 64 and above.high is None
    assert above.stopped == "above the search range"


def test_a_concurrency_search_probes_whole_numbers() -> None:
    slos = slos_of({"median_ttft_ms": 200.0})
    found = search(queue_probe(37.0), slos,
                   CapacitySearch(over="max_concurrency", low=1, high=256, precision="1%"),
                   40, clock=lambda: 0)
    assert all(p.load == int(p.load) for p in found.probes)
    assert found.capacity is not None and found.high is not None
    assert found.high - found.capacity == 1  # neighbours: the search cannot narrow further


def test_failed_requests_and_a_late_client_never_meet() -> None:
    slos = [Slo("p90_ttft_ms", 1000.0)]
    fast = ProbeSamples(latencies={"ttft": np.full(200, 10.0)}, completed=200)
    assert decide(fast, slos, 0.99)[0] == "meets"
    failing = ProbeSamples(latencies={"ttft": np.full(199, 10.0)}, completed=199, failed=1)
    decision, reason, _ = decide(failing, slos, 0.99)
    assert decision == "misses" and reason == "1 of 200 requests failed"
    late = ProbeSamples(latencies={"ttft": np.full(200, 10.0)}, completed=200,
                        fell_behind="client fell behind: p99 schedule lag 40 ms is over 10 ms")
    decision, reason, _ = decide(late, slos, 0.99)
    assert decision != "meets" and reason is not None and "client fell behind" in reason


def busy_host(run, above: float):  # type: ignore[no-untyped-def]
    """`run` on a host that holds the client back at loads above `above`: those runs fall
    behind, and their TTFTs carry the client's own delay."""

    def probe(load: float, count: int, seed: int) -> ProbeSamples:
        samples: ProbeSamples = run(load, count, seed)
        if load > above:
            samples.fell_behind = "client fell behind: p99 schedule lag 22.3 ms is over 10 ms"
            samples.latencies["ttft"] = samples.latencies["ttft"] + 500.0
        return samples

    return probe


def test_a_search_the_host_bounded_is_invalid_naming_the_host() -> None:
    slos = slos_of({"p90_ttft_ms": 400.0})
    settings = CapacitySearch(low=1, high=64)
    quiet = search(queue_probe(40.0), slos, settings, 100, clock=lambda: 0.0)
    assert quiet.capacity is not None and quiet.invalid_reason() is None
    # The host holds the client back well below what the server carries: the search stops
    # where the host did, and says so, whatever it found.
    busy = search(busy_host(queue_probe(40.0), above=9.0), slos, settings, 100,
                  clock=lambda: 0.0)
    assert busy.capacity is not None and busy.capacity < quiet.capacity
    reason = busy.invalid_reason()
    assert reason is not None and reason.startswith("the host limited the capacity search")
    assert "client fell behind" in reason and busy.describe() == reason
    bounding = next(p for p in busy.probes if p.load == busy.high)
    assert bounding.host is not None and bounding.as_record()["host"] == bounding.host


def test_a_search_the_host_kept_from_any_capacity_is_invalid_not_none_found() -> None:
    # Every probe unsure because the client fell behind (the 32-sequence case): no
    # capacity, and the reason is the host's, not the server's.
    busy = search(busy_host(queue_probe(40.0), above=0.0), slos_of({"p90_ttft_ms": 400.0}),
                  CapacitySearch(low=1, high=64), 100, clock=lambda: 0.0)
    assert busy.capacity is None
    reason = busy.invalid_reason()
    assert reason is not None and "no capacity was bounded by the probe at 1 req/s" in reason


def test_a_late_client_below_the_bound_does_not_void_the_search() -> None:
    # The host fell behind only at loads the search did not end on (below the capacity, all
    # re-measured until they met, here: none): the bound is the server's.
    found = search(busy_host(queue_probe(40.0), above=1e9), slos_of({"p90_ttft_ms": 400.0}),
                   CapacitySearch(low=1, high=64), 100, clock=lambda: 0.0)
    assert found.high is not None and found.invalid_reason() is None


def test_the_goodput_ratio_is_judged_on_its_binomial_interval() -> None:
    slos = [Slo("goodput_ratio", 0.9)]
    good = np.ones(500, dtype=bool)
    good[:10] = False  # 98 % good
    probe = ProbeSamples(latencies={}, good=good, completed=500)
    assert decide(probe, slos, 0.99)[0] == "meets"
    good[:200] = False  # 60 % good
    assert decide(probe, slos, 0.99)[0] == "misses"


def test_the_time_budget_stops_the_search() -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 10
        return now[0]

    found = search(queue_probe(40.0), slos_of({"p99_ttft_ms": 500.0}),
                   CapacitySearch(low=1, high=200, max_time_s=45), 100, clock=clock)
    assert found.stopped == "max_time_s"
    assert len(found.probes) < 12


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.floats(2.0, 190.0),
    slo_ms=st.floats(120.0, 2000.0),
    noise=st.floats(0.02, 0.4),
    seed=st.integers(0, 10_000),
)
def test_no_load_above_the_truth_meets(
    capacity: float, slo_ms: float, noise: float, seed: int
) -> None:
    truth = true_load(capacity, slo_ms, noise=noise, percentile=90)
    found = search(queue_probe(capacity, noise=noise), slos_of({"p90_ttft_ms": slo_ms}),
                   CapacitySearch(low=1, high=200, max_extension=2), 100, seed=seed,
                   clock=lambda: 0.0)
    assert all(p.load <= truth * 1.001 for p in found.probes if p.decision == "meets")
    if found.capacity is not None:
        assert found.capacity <= truth * 1.001


def test_a_capacity_10_percent_lower_regresses_with_the_brackets_interval() -> None:
    metric = gated_metric("capacity", 0.05)

    def run(capacity: float, high: float, session: str) -> RunSamples:
        return RunSamples(session, session, "", {"capacity": capacity, "capacity_low": capacity,
                                                  "capacity_high": high})

    base = [run(40.0, 41.9, "base")]
    verdict = judge_regression(metric, [run(36.0, 37.7, "new")], base, GateSettings())
    assert verdict.decision == "regressed"
    assert verdict.ci_low == pytest.approx(36.0 / 41.9 - 1)
    assert verdict.ci_high == pytest.approx(37.7 / 40.0 - 1)
    same = judge_regression(metric, [run(39.0, 40.9, "new")], base, GateSettings())
    assert same.decision == "unchanged"
    # A search that met at its highest load has no upper end: no interval to judge by.
    open_ended = judge_regression(metric, [run(30.0, math.nan, "new")], base, GateSettings())
    assert open_ended.decision == "not-judged" and open_ended.reason


SUITE = """
server:
  model: sim-8b
benchmark:
  kind: capacity
  slo: {slo}
  search: {search}
"""


@pytest.mark.parametrize(
    ("slo", "search", "expected"),
    [
        ("{p99_ttft_ms: 500}", "{low: 50, high: 10}",
         "search.low (50) must lie below search.high (10)"),
        ("{p99_ttfx_ms: 500}", "{}", "slo.p99_ttfx_ms: unknown SLO metric"),
        ("{p99_ttft_ms: .inf}", "{}", "slo.p99_ttft_ms"),
        ("{p99_ttft_ms: 500}", "{precision: 150%}", "a precision lies between 0% and 100%"),
        ("{}", "{}", "a capacity case needs at least one SLO"),
        ("{goodput_ratio: 0.9}", "{}", "slo.goodput_ratio counts the requests within `goodput`"),
        ("{p99_ttft_ms: 500}", "{over: max_concurrency, low: 1.5}",
         "a max_concurrency search takes whole numbers"),
    ],
)
def test_bad_search_settings_are_one_line_naming_the_file(
    tmp_path: Path, slo: str, search: str, expected: str
) -> None:
    path = write_suite(tmp_path, SUITE.format(slo=slo, search=search), "bench_cap.yaml")
    message = suite_error(path)
    assert message.startswith(str(path)) or "bench_cap.yaml" in message
    assert expected in message


def test_a_capacity_case_takes_thresholds_and_a_gate_on_capacity(tmp_path: Path) -> None:
    path = write_suite(tmp_path, SUITE.format(slo="{p99_ttft_ms: 500}", search="{}")
                       + "thresholds: {capacity: {min: 20}}\nregression: {capacity: 10%}\n",
                       "bench_cap.yaml")
    from helpers import cases_of

    (case,) = cases_of(path)
    assert isinstance(case.benchmark, CapacityConfig)
    assert case.name.endswith("::capacity-random")
    assert case.regression == {"capacity": 0.10}
    assert case.benchmark.search.precision == 0.05


def test_the_plan_lists_a_capacity_case_under_its_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_profllm.cli.main import main

    monkeypatch.chdir(tmp_path)  # the plan names a suite from here: wherever the clone sits
    path = write_suite(tmp_path, SUITE.format(slo="{p99_ttft_ms: 500}", search="{}"),
                       "bench_cap.yaml")
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "case bench_cap.yaml::sim-8b::capacity-random" in out
    assert "1 server(s), 1 case(s)" in out


class _WordCodec:
    """One token per word."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def _run(clock: float, ttft_s: float, count: int = 10, duration: float = 2.0) -> LoadResult:
    """A run of `count` requests spread over `duration`, each with the same TTFT."""
    outcomes = []
    for index in range(count):
        sent = clock + index * duration / count
        outcomes.append(RequestOutcome(
            prompt_len=16, success=True, output_tokens=4, ttft=ttft_s,
            itl=[0.01, 0.01, 0.01], latency=ttft_s + 0.03, start_time=sent,
            intended_start=sent, dispatch_time=sent, end_time=sent + ttft_s + 0.03,
            message_times=[sent + ttft_s + 0.01 * k for k in range(4)], status=200))
    return LoadResult(outcomes, duration, 1.7e9, clock, 0.1, 1,
                      [index * duration / count for index in range(count)])


def test_a_capacity_records_figures_of_all_the_probes_runs() -> None:
    # Once, a probe confirmed on two runs (706 requests, median TTFT 130.6 ms) was
    # recorded with its last run's figures alone (353 requests, 221 ms).
    config = CapacityConfig(kind="capacity", num_prompts=10, random_input_len=16,
                            random_output_len=4, slo={"median_ttft_ms": 200},
                            search=CapacitySearch(low=1, high=10, confirm=2))
    probes = ServerProbes(config, "http://127.0.0.1:9", _WordCodec(),  # type: ignore[arg-type]
                          [], "m", None)
    earlier, first, last = _run(100.0, 0.5), _run(200.0, 0.2), _run(300.0, 0.05)
    for run in (earlier, first, last):  # an earlier probe at the same load, then this one's
        summary, health = measure(run, config, probes.codec)  # as ServerProbes keeps them
        measured = (config, run, summary | health, (None, None), Judgement())
        probes.runs.setdefault(5.0, []).append(measured)
        probes.measured[5.0] = measured
    probe = Probe(load=5.0, requests=20, completed=20, failed=0, achieved_rate=5.0,
                  duration_s=4.0, decision="meets", reason=None)
    found = CapacityResult("request_rate", 5.0, 5.0, None, None, "precision", [probe],
                           {"median_ttft_ms": 200.0}, 1.0)
    outcome = SimpleNamespace(results={}, requests=[], invalid_reason=None,
                              request_failures=None)
    keep_probe_at_capacity(outcome, found, probes)  # type: ignore[arg-type]
    assert outcome.results["completed"] == probe.requests == 20
    assert outcome.results["median_ttft_ms"] == pytest.approx(125.0)  # of 200s and 50s
    assert outcome.results["request_throughput"] == pytest.approx(20 / 4.0)
    # The request file holds both runs, the second after the first on one time axis.
    starts = [row["start_s"] for row in outcome.requests]
    assert len(starts) == 20 and starts == sorted(starts) and starts[10] == pytest.approx(2.0)
    assert outcome.invalid_reason is None
