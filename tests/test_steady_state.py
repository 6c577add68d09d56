"""The steady state of a closed-loop load (load/steady_state.py): the window where the
requests in flight stay at or above 95 % of max_concurrency, and its figures."""

from __future__ import annotations

import sqlite3

import pytest
from helpers import run_records, run_suites
from hypothesis import given
from hypothesis import strategies as st

from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.steady_state import steady_figures, steady_window
from pytest_profllm.plan.metric_names import STEADY_RESULTS


def outcome(start: float, end: float, tokens: int = 11, ttft: float = 0.1) -> RequestOutcome:
    return RequestOutcome(prompt_len=8, success=True, output_tokens=tokens, ttft=ttft,
                          latency=end - start, start_time=start, end_time=end)


def closed_loop(concurrency: int, rounds: int, length: float = 1.0) -> list[RequestOutcome]:
    """`concurrency` streams, each sending `rounds` requests back to back, the streams
    staggered by a tenth of a request at the start (ramp-up) and so at the end (drain)."""
    return [outcome(s * length / 10 + r * length, s * length / 10 + (r + 1) * length)
            for s in range(concurrency) for r in range(rounds)]


def test_the_window_leaves_out_ramp_up_and_drain() -> None:
    # 4 streams staggered by 0.1 s: all 4 in flight from 0.3 s (the last stream's start)
    # until 5.0 s (the first stream's end).
    load = closed_loop(4, 5)
    assert steady_window(load, 4) == (0.3, 5.0)
    figures = steady_figures(load, 4)
    # Inside [0.3, 5.0]: the requests that started at or after 0.3 and ended by 5.0.
    inside = [o for o in load if o.start_time >= 0.3 and o.end_time <= 5.0]
    assert figures["steady_completed"] == len(inside) == 14
    assert figures["steady_duration_s"] == 4.7
    assert figures["steady_request_throughput"] == len(inside) / 4.7
    assert figures["steady_output_throughput"] == 11 * len(inside) / 4.7
    assert figures["steady_median_ttft_ms"] == 100.0
    # TPOT of each: (1.0 - 0.1) / (11 - 1) s.
    assert abs(figures["steady_median_tpot_ms"] - 90.0) < 1e-9  # type: ignore[operator]


def test_a_handover_at_one_instant_is_no_dip() -> None:
    # One stream, each request sent as the last one ends: in flight never drops to 0.
    load = [outcome(r, r + 1.0) for r in range(3)]
    assert steady_window(load, 1) == (0.0, 3.0)


def test_an_open_loop_or_a_load_that_never_fills_has_no_steady_state() -> None:
    load = closed_loop(2, 3)
    assert steady_figures(load, None) == dict.fromkeys(STEADY_RESULTS)
    # max_concurrency 8, but only 2 streams ever in flight: never 95 % of it.
    assert steady_window(load, 8) is None
    assert steady_figures(load, 8) == dict.fromkeys(STEADY_RESULTS)


def test_a_failed_request_in_the_window_is_not_counted() -> None:
    load = closed_loop(2, 4)
    load[3].success = False
    figures = steady_figures(load, 2)
    assert figures["steady_completed"] == sum(
        1 for o in load if o.success and o.start_time >= 0.1 and o.end_time <= 4.0)


def test_the_handovers_of_a_closed_loop_do_not_end_its_steady_state() -> None:
    # Each stream sends its next request 1 ms after one ends, as a real client does: 16 in
    # flight dips to 15 at every handover, and the steady state still runs from the ramp-up's
    # end to the drain's start.
    load = [outcome(s * 0.01 + r * 1.001, s * 0.01 + r * 1.001 + 1.0)
            for s in range(16) for r in range(4)]
    start, end = steady_window(load, 16) or (0.0, 0.0)
    # From the 16th stream's first send to the first stream's last end.
    assert start == 0.15 and abs(end - 4.003) < 1e-9
    # The middle rounds whole, and one request of each edge round.
    assert steady_figures(load, 16)["steady_completed"] == 1 + 32 + 1


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.001, 10)), min_size=1, max_size=60),
       st.integers(1, 16))
def test_the_window_runs_from_the_first_fill_to_the_last_fall_and_counts_whats_inside(
    spans: list[tuple[float, float]], concurrency: int
) -> None:
    load = [outcome(start, start + length) for start, length in spans]
    window = steady_window(load, concurrency)
    figures = steady_figures(load, concurrency)
    if window is None:
        assert figures == dict.fromkeys(STEADY_RESULTS)
        return
    start, end = window
    floor = -(-95 * concurrency // 100)

    def in_flight(at: float) -> int:
        return sum(o.start_time <= at < o.end_time for o in load)

    # Never at the floor before the window, nor after it; at it as the window opens.
    instants = sorted({*(o.start_time for o in load), *(o.end_time for o in load)})
    assert all(in_flight(at) < floor for at in instants if at < start or at >= end)
    assert in_flight(start) >= floor
    inside = [o for o in load if start <= o.start_time and o.end_time <= end]
    assert figures["steady_completed"] == len(inside)
    assert figures["steady_duration_s"] == end - start


CLOSED_LOOP_SUITE = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 64
  max_concurrency: 8
  random_input_len: 64
  random_output_len: 32
  random_range_ratio: 0.5  # requests of other lengths: the loop drains unevenly
thresholds:
  steady_completed: {min: 1}
regression: [steady_output_throughput, steady_p99_ttft_ms]
repeat: 2
"""


def test_a_closed_loop_records_its_steady_state_and_the_gate_may_name_it(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_closed=CLOSED_LOOP_SUITE)
    result = run_suites(pytester, ports, "--profllm-sim-clock=virtual")
    result.assert_outcomes(passed=2)
    record = max(run_records(pytester), key=lambda r: r["repeat_index"])
    results = record["results"]
    # No baseline: the gate had nothing to compare, but it took the names.
    assert {v["metric"] for v in record["regression"]} == {
        "steady_output_throughput", "steady_p99_ttft_ms"}
    assert 0 < results["steady_completed"] < results["completed"]
    assert 0 < results["steady_duration_s"] < results["duration"]
    assert results["steady_output_throughput"] > 0
    assert results["steady_median_ttft_ms"] <= results["steady_p99_ttft_ms"]
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        (completed,) = db.execute("SELECT steady_completed FROM benchmark_runs WHERE run_id = ?",
                                  (record["run_id"],)).fetchone()
    assert completed == results["steady_completed"]
