"""The saturation stop of a rate sweep: above a rate whose load saturated the server, the
sweep's higher rates are skipped, each with a `skipped` record that says why."""

from __future__ import annotations

import argparse
import math
import re
import sqlite3
from typing import Any

import pytest
from helpers import run_records, run_suites
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.options import parse_saturation_margin
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.session.saturation import (
    SaturationStop,
    order_rates,
    queue_grew,
    record_saturated,
    saturated,
    served_rate,
)

# One request at a time on the server and from the client: the server serves about 6 req/s,
# whatever rate the client is asked for.
SWEEP = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: 1
benchmark:
  num_prompts: 8
  random_input_len: 32
  random_output_len: 16
  max_concurrency: 1
  request_rate: [4, 200, 400, inf, 800]
  # Eight arrivals at 4 req/s: a drawn schedule can fall short of the rate by itself (3.5/s);
  # seed 0's does not, so only the server's limit saturates the sweep.
  seed: 0
"""
REASON = re.compile(r"saturated at 200 req/s \(achieved [0-9.]+ req/s\)")


def test_a_sweep_stops_above_its_saturated_rate(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_sweep=SWEEP)
    result = run_suites(pytester, ports, "-rs", cache=False, timeout=120)
    # The measured two may read `invalid` on a busy host (the client fell behind): still run.
    assert result.parseoutcomes()["skipped"] == 3
    result.stdout.re_match_lines([r"SKIPPED \[3\] .*" + REASON.pattern])
    by_rate = {r["config"]["benchmark"]["request_rate"]: r for r in run_records(pytester)}
    assert {rate for rate, r in by_rate.items() if r["status"] == "skipped"} == {
        400.0, 800.0, "inf"
    }
    assert by_rate[4.0]["results"]["completed"] == by_rate[200.0]["results"]["completed"] == 8
    for rate in (400.0, 800.0, "inf"):
        record = by_rate[rate]
        assert REASON.fullmatch(record["message"]), record["message"]
        assert record["validity"] == "invalid" and record["results"] == {}
        assert record["runtime"]["server_started_at"] is None  # nothing ran for it
    # Lowest rate first, in the order the suite's own places allow (inf listed before 800).
    times = sorted((r["timestamp"], rate) for rate, r in by_rate.items())
    assert [rate for _, rate in times] == [4.0, 200.0, 400.0, 800.0, "inf"]
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = db.execute("select status, count(*) from benchmark_runs group by status")
        assert dict(rows.fetchall())["skipped"] == 3


def test_the_stop_can_be_turned_off(pytester: pytest.Pytester, ports: str) -> None:
    three = SWEEP.replace("[4, 200, 400, inf, 800]", "[4, 200, 400]")
    pytester.makefile(".yaml", bench_sweep=three)
    result = run_suites(pytester, ports, "--profllm-no-saturation-stop", cache=False, timeout=120)
    assert "skipped" not in result.parseoutcomes()
    assert [r["results"]["completed"] for r in run_records(pytester)] == [8, 8, 8]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.1", 0.1), ("10%", 0.1), ("0.25", 0.25), ("off", 0.0), ("0", 0.0), ("0%", 0.0)],
)
def test_parse_saturation_margin(text: str, expected: float) -> None:
    assert parse_saturation_margin(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["1", "150%", "-0.1", "nan", "fast"])
def test_parse_saturation_margin_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected|margin"):
        parse_saturation_margin(text)


def test_margin_from_options_and_ini(pytester: pytest.Pytester) -> None:
    from pytest_profllm.options import Settings

    pytester.makeini("[pytest]\nprofllm_saturation_margin = 20%\n")
    assert Settings.from_config(pytester.parseconfig()).saturation_margin == pytest.approx(0.2)
    config = pytester.parseconfig("--profllm-saturation-margin=off")
    assert Settings.from_config(config).saturation_margin is None
    config = pytester.parseconfig("--profllm-no-saturation-stop")
    assert Settings.from_config(config).saturation_margin is None
    pytester.makeini("[pytest]\n")
    assert Settings.from_config(pytester.parseconfig()).saturation_margin == 0.1


def _results(target: float | None, achieved: float | None, **more: Any) -> dict[str, Any]:
    return {"target_request_rate": target, "achieved_request_rate": achieved, **more}


def test_a_load_saturates_when_its_achieved_rate_falls_short() -> None:
    assert saturated(_results(24, 17.3), [], 0.1) == pytest.approx(17.3)
    assert saturated(_results(24, 22.0), [], 0.1) is None  # within the margin
    assert saturated(_results(None, None), [], 0.1) is None  # rate inf: no target


def test_served_rate_leaves_the_last_latency_out() -> None:
    # 8 requests over 2 s of arrivals, each 0.17 s: the server kept up (4 req/s).
    kept_up = {"completed": 8, "duration": 2.17, "median_e2el_ms": 170.0}
    assert served_rate(kept_up) == pytest.approx(4.0)
    assert saturated(_results(4.0, 3.99, **kept_up), [], 0.1) is None
    # The same 8 requests asked for in 0.04 s took 1.35 s: about 6 req/s were served.
    held_back = {"completed": 8, "duration": 1.35, "median_e2el_ms": 166.0}
    # It is the served rate that shows it (8 / (1.35 - 0.166) = 6.8 req/s, under 200); the
    # figure given is the run's request throughput, the summary's req/s.
    assert saturated(_results(200.0, 195.0, **held_back), [], 0.1) == pytest.approx(8 / 1.35)


def test_a_growing_waiting_queue_saturates() -> None:
    # Arrivals outrun the server: the queue climbs until they end, then drains.
    climbing = [0, 2, 5, 8, 11, 14, 8, 2, 0]
    assert queue_grew(climbing, 0.1)
    series = [{"waiting": float(w)} for w in climbing]
    assert saturated(_results(None, None, completed=40, duration=4.0), series, 0.1) == 10.0
    # The client sent on time (24 req/s) while the queue took what the server could not
    # serve: the figure is the throughput it served over the run, not the send rate.
    sent_on_time = _results(
        24.0, 24.1, completed=240, duration=18.6, median_e2el_ms=8000.0, request_throughput=12.9
    )
    assert saturated(sent_on_time, series, 0.1) == pytest.approx(240 / 18.6)
    stop = SaturationStop(0.1)
    stop.note(_case(24), sent_on_time, series)
    assert stop.skip_reason(_case(48)) == "saturated at 24 req/s (achieved 12.9 req/s)"
    # Bursts at a load the server keeps up with queue a request or two for a moment.
    for noise in ([0, 0, 1, 0, 3, 0, 0], [0, 0, 0, 5, 0], [1, 0, 1, 2, 1, 0, 1], [0, 0]):
        assert not queue_grew(noise, 0.1), noise


def _case(rate: float, output_len: int = 8, max_num_seqs: int = 1, repeat: int = 0) -> Case:
    return Case(
        suite="s",
        source="bench_s.yaml",
        server_label="srv",
        workload_label=f"rate{rate}-out{output_len}-r{repeat}",
        server={"model": "m", "max_num_seqs": max_num_seqs},
        benchmark=BenchmarkConfig(request_rate=rate, random_output_len=output_len),
        thresholds={},
        repeat_index=repeat,
    )


def test_the_stop_skips_higher_rates_of_the_same_sweep_only() -> None:
    stop = SaturationStop(0.1)
    stop.note(_case(24), _results(24, 17.3), [])
    assert stop.skip_reason(_case(48)) == "saturated at 24 req/s (achieved 17.3 req/s)"
    assert stop.skip_reason(_case(math.inf)) == "saturated at 24 req/s (achieved 17.3 req/s)"
    assert stop.skip_reason(_case(24, repeat=1)) is None  # not a higher load
    assert stop.skip_reason(_case(12)) is None
    assert stop.skip_reason(_case(48, output_len=16)) is None  # another workload
    assert stop.skip_reason(_case(48, max_num_seqs=2)) is None  # another server
    assert SaturationStop(None).skip_reason(_case(48)) is None


def test_order_rates_puts_each_sweep_lowest_first_in_its_own_places() -> None:
    items = [_case(8), _case(2, output_len=16), _case(math.inf), _case(1), _case(4, 16)]
    order_rates(items, lambda case: case)
    served = [c.benchmark for c in items if isinstance(c.benchmark, BenchmarkConfig)]
    assert [(b.request_rate, b.random_output_len) for b in served] == [
        (1, 8), (2, 16), (8, 8), (math.inf, 8), (4, 16)
    ]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8,
)  # fmt: skip
_RESULT_KEYS = ["target_request_rate", "achieved_request_rate", "completed", "duration",
                "median_e2el_ms", "mean_e2el_ms", "request_throughput"]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    results=st.dictionaries(st.sampled_from(_RESULT_KEYS), _JSON, max_size=7),
    waiting=st.lists(_JSON | st.floats(0, 100), max_size=12),
    status=st.sampled_from(["passed", "failed", "skipped"]),
)
def test_any_earlier_record_gives_a_rate_or_none(
    results: dict[str, Any], waiting: list[Any], status: str
) -> None:
    # An earlier session's record (read again on resume) is outside input: whatever it holds,
    # its saturation is a finite rate or None, never an exception.
    record = {"status": status, "results": results, "series": [{"waiting": w} for w in waiting]}
    found = record_saturated(record, 0.1)
    assert found is None or (isinstance(found, float) and math.isfinite(found))
