"""The one judge of what counts as a measurement (load/validity.py): a suite's case and
`profllm bench` judge the same load alike, and measuring again follows the rules' kinds,
never their wording."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.load import metrics, validity
from pytest_profllm.load.attempts import Attempts
from pytest_profllm.load.bench import BenchFailed, bench_rules, judged_result
from pytest_profllm.load.client_watch import WatchFigures
from pytest_profllm.load.dataset import TokenizerCodec
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult
from pytest_profllm.load.server_state import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    SIM_LATE_BOUNDS_MS,
    SIM_STEPS,
    sim_late_name,
)
from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS
from pytest_profllm.load.validity import (
    Invalid,
    InvalidKind,
    Judgement,
    LoadFacts,
    Rules,
    judge,
    on_this_host,
)
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.run.serve import judge_attempt
from pytest_profllm.sim.model_files import MODEL_DIR

CODEC = TokenizerCodec.load(str(MODEL_DIR))
LOOPBACK = "http://127.0.0.1:8000"
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"


@st.composite
def outcomes(draw: st.DrawFn) -> list[RequestOutcome]:
    count = draw(st.integers(1, 12))
    rate_gap = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1]))
    made = []
    for index in range(count):
        intended = index * rate_gap
        lag = draw(st.floats(0.0, 0.05))
        ttft = draw(st.floats(0.001, 0.5))
        tokens = draw(st.integers(1, 8))
        success = draw(st.booleans()) if index else True  # one answered, at least
        latency = ttft + draw(st.floats(0.0, 0.5))
        made.append(RequestOutcome(
            prompt_len=draw(st.integers(1, 64)),
            success=success,
            output_tokens=draw(st.sampled_from([tokens, tokens + 3, None])) if success else None,
            output_len=tokens,
            ttft=ttft if success else 0.0,
            latency=latency if success else 0.0,
            itl=[(latency - ttft) / tokens] * (tokens - 1) if success else [],
            intended_start=intended,
            dispatch_time=intended + lag,
            start_time=intended + lag,
            end_time=intended + lag + latency,
            status=200 if success else 500,
            error="" if success else "server error",
            generated_text="x" * tokens if success else "",
        ))
    return made


@st.composite
def windows(draw: st.DrawFn, completed: int) -> validity.ServerWindow:
    """A server's /metrics before and after a load: TTFT and E2E histograms, the prefix
    cache's counters and, sometimes, the simulated engine's step counters."""
    if draw(st.booleans()):
        return (None, None)
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    served = draw(st.sampled_from([completed, completed + 1]))
    for name in (TTFT, E2E):
        before[f"{name}_count"], before[f"{name}_sum"] = 0.0, 0.0
        after[f"{name}_count"] = float(served)
        after[f"{name}_sum"] = draw(st.floats(0.0, 0.5)) * served
    queries = float(draw(st.integers(0, 4000)))
    before[PREFIX_QUERIES], before[PREFIX_HITS] = 0.0, 0.0
    after[PREFIX_QUERIES], after[PREFIX_HITS] = queries, float(draw(st.integers(0, int(queries))))
    if draw(st.booleans()):
        steps = float(draw(st.integers(1, 500)))
        before[SIM_STEPS], after[SIM_STEPS] = 0.0, steps
        late = 0.0
        for bound in reversed(SIM_LATE_BOUNDS_MS):
            late = min(steps, late + draw(st.integers(0, 5)))
            after[sim_late_name(bound)] = late
    return before, after


@st.composite
def watches(draw: st.DrawFn) -> list[WatchFigures]:
    """What the client's processes saw of themselves (load/client_watch.py): none (no
    watch ran), or one or two processes' loop lag and shares, on and across the bounds."""
    made = []
    for _ in range(draw(st.integers(0, 2))):
        lag = draw(st.sampled_from([None, 0.4, 9.0, 10.0, 12.0, 300.0]))
        made.append(WatchFigures(
            wall_s=1.0, ticks=0 if lag is None else 100, lag_p50_ms=lag, lag_p99_ms=lag,
            lag_max_ms=lag, cpu_share=draw(st.sampled_from([0.05, 0.5, 0.97])),
            runqueue_wait_share=draw(st.sampled_from([None, 0.0, 0.3, 0.5, 0.8])),
        ))
    return made


def _load(made: list[RequestOutcome], watch: list[WatchFigures] | None = None) -> LoadResult:
    duration = max(outcome.end_time for outcome in made) or 1.0
    return LoadResult(
        made, duration, 0.0, 0.0, cpu_seconds=0.1 * duration,
        intended_offsets=[outcome.intended_start for outcome in made], watch=watch or [],
    )


def _kinds_and_texts(judgement: Judgement) -> list[tuple[InvalidKind, str]]:
    return [(reason.kind, reason.text) for reason in judgement.reasons]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_case_and_profllm_bench_judge_the_same_load_alike(data: st.DataObject) -> None:
    made = data.draw(outcomes())
    load = _load(made, data.draw(watches()))
    window = data.draw(windows(sum(outcome.success for outcome in made)))
    lag = data.draw(st.sampled_from([None, 0.5, 10.0, 1000.0]))
    ignore_eos = data.draw(st.booleans())
    config = BenchmarkConfig(num_prompts=len(made), ignore_eos=ignore_eos)
    own_hits = data.draw(st.integers(0, 100))
    try:
        result, bench = judged_result(load, config, CODEC, window, own_hits,
                                      bench_rules(LOOPBACK, lag), max_failed=len(made),
                                      model="sim")
    except BenchFailed:
        return  # a benchmark of nothing: no figures to judge (a case fails on it too)
    # The case's rules where the session sets only the lag bound, its load cores not watched
    # (as bench's, which leases none).
    attempt = judge_attempt(load, config, CODEC, window, own_hits, None,
                            Rules(max_schedule_lag_ms=lag))
    case, case_results = attempt.judgement, attempt.results
    assert _kinds_and_texts(bench) == _kinds_and_texts(case)
    assert result["validity"] == case.validity
    assert result["invalid_reason"] == case.line()
    assert bench.not_applied == case.not_applied
    # The client's watch reaches both as the same health figures, under the record's keys.
    assert set(metric_names.CLIENT_HEALTH_KEYS) <= set(result)
    assert {key: result[key] for key in metric_names.CLIENT_HEALTH_KEYS} == {
        key: case_results[key] for key in metric_names.CLIENT_HEALTH_KEYS}


def _reworded(function: Any) -> Any:
    """A rule's message function whose every line reads otherwise."""
    def reworded(*args: Any, **kwargs: Any) -> str | None:
        text = function(*args, **kwargs)
        return None if text is None else f"REWORDED {text[::-1]}"
    return reworded


RULE_MESSAGES = ("client_out_of_descriptors", "inconsistent_counts", "client_fell_behind",
                 "client_saturated")
VALIDITY_MESSAGES = ("sim_fell_behind", "cache_problem", "overhead_problem", "tail_problem",
                     "foreign_problem")


@settings(max_examples=100, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rewording_any_reason_changes_no_remeasure_decision(
    data: st.DataObject, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = data.draw(outcomes())
    load = _load(made, data.draw(watches()))
    window = data.draw(windows(sum(outcome.success for outcome in made)))
    config = BenchmarkConfig(num_prompts=len(made))
    share = data.draw(st.sampled_from([None, 0.0, 0.5, 0.9]))
    rules = Rules(max_schedule_lag_ms=data.draw(st.sampled_from([0.5, 10.0])),
                  max_client_overhead_ms=data.draw(st.sampled_from([0.001, 50.0])))
    tail = data.draw(st.sampled_from([None, 5.0, 500.0]))
    facts = LoadFacts(load, config, {**_health(load)}, {
        "mean_ttft_ms": 30.0, "completed": sum(o.success for o in made),
        "client_overhead_ttft_p99_ms": tail}, 0, share, None if tail is None else 1.0)
    first = judge(facts, window, rules)
    with monkeypatch.context() as patched:
        for name in RULE_MESSAGES:
            patched.setattr(metrics, name, _reworded(getattr(metrics, name)))
        for name in VALIDITY_MESSAGES:
            patched.setattr(validity, name, _reworded(getattr(validity, name)))
        second = judge(facts, window, rules)
    assert [r.kind for r in first.reasons] == [r.kind for r in second.reasons]
    assert all(r.text.startswith("REWORDED") for r in second.reasons)
    for remeasure in (0, 1, 3):
        assert Attempts(remeasure).again(first.reasons) == Attempts(remeasure).again(
            second.reasons)


def _health(load: LoadResult) -> dict[str, Any]:
    return metrics.client_health(load.outcomes, load.intended_offsets, load.clock_start,
                                 load.duration, load.cpu_seconds, watch=load.watch)


@given(kinds=st.lists(st.sampled_from(list(InvalidKind)), min_size=1, max_size=5),
       words=st.lists(st.text(max_size=40), min_size=5, max_size=5))
def test_measuring_again_follows_the_kinds_alone(
    kinds: list[InvalidKind], words: list[str]
) -> None:
    reasons = [Invalid(kind, words[index]) for index, kind in enumerate(kinds)]
    expected = all(kind.host_caused for kind in kinds)
    assert Attempts(remeasure=2).again(reasons) == expected
    attempts = Attempts(remeasure=2)
    assert attempts.host_reasons(reasons) == [r for r in reasons if r.kind.host_caused]


def test_the_host_caused_kinds_are_the_hosts() -> None:
    host = {kind for kind in InvalidKind if kind.host_caused}
    assert host == {InvalidKind.CLIENT_FELL_BEHIND, InvalidKind.CLIENT_SATURATED,
                    InvalidKind.SIMULATOR_LATENESS, InvalidKind.CLIENT_OVERHEAD,
                    InvalidKind.CLIENT_OVERHEAD_TAIL, InvalidKind.FOREIGN_CPU}


def test_rules_that_cannot_apply_say_why() -> None:
    made = [RequestOutcome(prompt_len=4, success=True, output_tokens=2, output_len=2, ttft=0.01,
                           latency=0.02, itl=[0.01], end_time=0.02, status=200)]
    load = _load(made)
    facts = LoadFacts(load, BenchmarkConfig(num_prompts=1), _health(load), {})
    elsewhere = judge(facts, ({}, {}), Rules(server_on_this_host=False))
    assert elsewhere.valid
    assert "network" in elsewhere.not_applied[InvalidKind.CLIENT_OVERHEAD]
    assert "leased" in elsewhere.not_applied[InvalidKind.FOREIGN_CPU]
    virtual = judge(facts, (None, None), Rules(virtual_clock=True))
    assert set(virtual.not_applied) == {
        InvalidKind.CLIENT_FELL_BEHIND, InvalidKind.CLIENT_SATURATED,
        InvalidKind.SIMULATOR_LATENESS, InvalidKind.CACHE, InvalidKind.CLIENT_OVERHEAD,
        InvalidKind.CLIENT_OVERHEAD_TAIL, InvalidKind.FOREIGN_CPU}


@pytest.mark.parametrize(("url", "here"), [
    ("http://127.0.0.1:8000", True), ("http://localhost:1", True), ("http://[::1]:80", True),
    ("http://10.0.0.5:8000", False), ("https://api.example.com", False),
])
def test_a_server_on_this_host_is_a_loopback_one(url: str, here: bool) -> None:
    assert on_this_host(url) is here


def test_an_overhead_over_the_bound_is_judged_only_on_this_host() -> None:
    made = [RequestOutcome(prompt_len=4, success=True, output_tokens=2, output_len=2, ttft=0.2,
                           latency=0.3, itl=[0.1], end_time=0.3, status=200)]
    load = _load(made)
    window = ({f"{TTFT}_count": 0.0, f"{TTFT}_sum": 0.0, f"{E2E}_count": 0.0, f"{E2E}_sum": 0.0},
              {f"{TTFT}_count": 1.0, f"{TTFT}_sum": 0.01, f"{E2E}_count": 1.0,
               f"{E2E}_sum": 0.1})
    facts = LoadFacts(load, BenchmarkConfig(num_prompts=1), _health(load),
                      {"mean_ttft_ms": 200.0, "mean_e2el_ms": 300.0, "completed": 1})
    here = judge(facts, window, Rules())
    assert [r.kind for r in here.reasons] == [InvalidKind.CLIENT_OVERHEAD]
    assert math.isclose(190.0, float(here.reasons[0].text.split()[3]))
    assert judge(facts, window, Rules(server_on_this_host=False)).valid


def _traced(p99_ms: float, joined: float | None) -> LoadFacts:
    """A load of 200 requests whose per-request overheads on TTFT (a few ms, and a tail up
    to `p99_ms`) give the judge their p99, with `joined` of their spans joined."""
    made = [RequestOutcome(prompt_len=4, success=True, output_tokens=2, output_len=2,
                           ttft=0.01, latency=0.02, itl=[0.01], end_time=0.02, status=200)
            for _ in range(200)]
    load = _load(made)
    added = np.concatenate([np.full(196, 3.0), np.full(4, p99_ms)])
    results = {"completed": 200, "client_overhead_ttft_p99_ms": float(np.percentile(added, 99))}
    return LoadFacts(load, BenchmarkConfig(num_prompts=200), _health(load), results,
                     spans_joined_share=joined)


@pytest.mark.parametrize("p99", [1.0, 50.0, DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS])
def test_a_tail_within_the_bound_is_valid(p99: float) -> None:
    judged = judge(_traced(p99, 1.0), (None, None), Rules())
    assert judged.valid
    assert InvalidKind.CLIENT_OVERHEAD_TAIL not in judged.not_applied


@pytest.mark.parametrize("p99", [101.0, 127.0, 2000.0])
def test_a_tail_over_the_bound_is_invalid_and_measured_again(p99: float) -> None:
    judged = judge(_traced(p99, 1.0), (None, None), Rules())
    (reason,) = judged.reasons
    assert reason.kind is InvalidKind.CLIENT_OVERHEAD_TAIL and reason.host_caused
    assert f"{p99:.1f} ms to a request's TTFT at p99" in reason.text
    assert Attempts(remeasure=1).again(judged.reasons)
    # A bound the user set holds as set; none turns the rule off.
    assert judge(_traced(p99, 1.0), (None, None), Rules(max_client_overhead_p99_ms=p99)).valid
    assert judge(_traced(p99, 1.0), (None, None), Rules(max_client_overhead_p99_ms=None)).valid


@pytest.mark.parametrize(("joined", "why"), [
    (None, "not traced"), (0.5, "50.0%"), (0.989, "98.9%"),
])
def test_the_tail_is_not_judged_where_spans_were_not_joined(
    joined: float | None, why: str
) -> None:
    judged = judge(_traced(500.0, joined), (None, None), Rules())
    assert judged.valid
    assert why in judged.not_applied[InvalidKind.CLIENT_OVERHEAD_TAIL]
    assert judge(_traced(500.0, 0.99), (None, None), Rules()).reasons


def test_the_default_tail_bound_grows_with_the_servers_p99() -> None:
    """The server's own p99 TTFT of 1 s (its /metrics window) allows 150 ms at p99."""
    buckets = {0.5: 0.0, 1.0: 200.0, math.inf: 200.0}
    after = {f"{TTFT}_count": 200.0, f"{TTFT}_sum": 190.0,
             **{f"{TTFT}_bucket@{bound!r}": count for bound, count in buckets.items()}}
    before = {key: 0.0 for key in after}
    facts = _traced(140.0, 1.0)
    assert judge(facts, (before, after), Rules()).valid
    assert not judge(facts, (before, after), Rules(max_client_overhead_p99_ms=120.0)).valid
    (reason,) = judge(_traced(160.0, 1.0), (before, after), Rules()).reasons
    assert "15% of the server's p99" in reason.text


def test_the_tail_bound_takes_the_joined_spans_exact_p99_over_the_histograms() -> None:
    """Every TTFT in the (0.5 s, 1 s] bucket: the histogram interpolates a p99 of 995 ms (a
    149 ms bound). The joined spans' own p99 is exact, and it is the one the bound grows with:
    600 ms (a 100 ms bound, the floor) makes 140 ms at p99 invalid; 1.2 s (180 ms) passes
    160 ms."""
    buckets = {0.5: 0.0, 1.0: 200.0, math.inf: 200.0}
    after = {f"{TTFT}_count": 200.0, f"{TTFT}_sum": 190.0,
             **{f"{TTFT}_bucket@{bound!r}": count for bound, count in buckets.items()}}
    window = ({key: 0.0 for key in after}, after)
    low = dataclasses.replace(_traced(140.0, 1.0), spans_server_ttft_p99_ms=600.0)
    (reason,) = judge(low, window, Rules()).reasons
    assert reason.kind is InvalidKind.CLIENT_OVERHEAD_TAIL and "bound 100 ms" in reason.text
    high = dataclasses.replace(_traced(160.0, 1.0), spans_server_ttft_p99_ms=1200.0)
    assert judge(high, window, Rules()).valid
    (reason,) = judge(dataclasses.replace(_traced(190.0, 1.0), spans_server_ttft_p99_ms=1200.0),
                      (None, None), Rules()).reasons
    assert "bound 180.0 ms, 15% of the server's p99 1200.0 ms" in reason.text


def _watched(facts: LoadFacts, lag_max_ms: float) -> LoadFacts:
    """`facts` whose client watched its own loop and found it at most `lag_max_ms` late
    (and under the saturation rule's bound at p99: one late moment)."""
    watch = [WatchFigures(wall_s=1.0, ticks=100, lag_p50_ms=min(lag_max_ms, 1.0),
                          lag_p99_ms=min(lag_max_ms, 5.0), lag_max_ms=lag_max_ms, cpu_share=0.3,
                          runqueue_wait_share=0.0)]
    load = dataclasses.replace(facts.load, watch=watch)
    return dataclasses.replace(facts, load=load, health=_health(load))


@pytest.mark.parametrize("lag_max", [0.5, 12.0, 98.9])
def test_a_tail_the_clients_loop_cannot_have_made_is_the_servers(lag_max: float) -> None:
    """vLLM's CPU build at 256 streams: 185-312 ms at p99 between the client's TTFT and its
    span's, the client's loop never more than 12 ms late. The gap is vLLM's front end, outside
    its span: the load is valid, and says why."""
    judged = judge(_watched(_traced(240.0, 1.0), lag_max), (None, None), Rules())
    assert judged.valid
    assert judged.outside_client is not None
    assert "240.0 ms" in judged.outside_client and f"{lag_max:.1f} ms late" in judged.outside_client


@pytest.mark.parametrize("lag_max", [99.0, 150.0, 2000.0])
def test_a_tail_with_a_loop_that_late_is_the_clients(lag_max: float) -> None:
    """A client starved of its core (a hog at nice -20 on it): its loop up to 155 ms late and
    106 ms at p99 on TTFT. The client may have made it: invalid, measured again."""
    judged = judge(_watched(_traced(240.0, 1.0), lag_max), (None, None), Rules())
    (reason,) = [r for r in judged.reasons if r.kind is InvalidKind.CLIENT_OVERHEAD_TAIL]
    assert reason.host_caused and judged.outside_client is None


def test_the_means_gap_is_cleared_by_the_same_watch() -> None:
    made = [RequestOutcome(prompt_len=4, success=True, output_tokens=2, output_len=2, ttft=0.2,
                           latency=0.3, itl=[0.1], end_time=0.3, status=200)]
    window = ({f"{TTFT}_count": 0.0, f"{TTFT}_sum": 0.0, f"{E2E}_count": 0.0, f"{E2E}_sum": 0.0},
              {f"{TTFT}_count": 1.0, f"{TTFT}_sum": 0.01, f"{E2E}_count": 1.0,
               f"{E2E}_sum": 0.1})
    load = _load(made)
    facts = LoadFacts(load, BenchmarkConfig(num_prompts=1), _health(load),
                      {"mean_ttft_ms": 200.0, "mean_e2el_ms": 300.0, "completed": 1})
    assert judge(_watched(facts, 60.0), window, Rules()).reasons  # 60 ms late: over 50 ms
    cleared = judge(_watched(facts, 5.0), window, Rules())
    assert cleared.valid and cleared.outside_client is not None
    assert "mean TTFT" in cleared.outside_client
