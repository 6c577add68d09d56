"""A serve workload's `until:`: sent in rounds until a latency statistic's bootstrap interval
(the regression gate's, load/bootstrap.py) is as narrow as asked, or a cap is reached. The
rule on its own (load/until.py), the key's one-line errors (with hypothesis), and real pytest
runs on the simulated engine: a stable server stops by its interval before the cap, an
impossible width stops at the cap and says so, and every round's request is counted once."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers import cases_of, run_records, run_suites, suite_error, write_suite
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.browse.run_page import run_page, until_line
from pytest_profllm.load.until import (
    Reading,
    narrow_enough,
    next_round,
    read,
    samples_needed,
)
from pytest_profllm.plan.suite import BenchmarkConfig, SuiteError, Until

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "benchmarks" / "until" / "bench_until.yaml"
PAGE = REPO / "docs" / "writing-suites" / "stop-when-sure.md"


def until(**keys: Any) -> Until:
    return Until.model_validate({"metric": "p99_ttft_ms", "half_width": 0.05,
                                 "max_prompts": 5000, **keys})


# --- the rule -----------------------------------------------------------------------------


def test_a_percentile_has_no_interval_until_20_samples_lie_beyond_it() -> None:
    assert samples_needed(until()) == 2000
    assert samples_needed(until(metric="p90_ttft_ms")) == 200
    assert samples_needed(until(metric="median_e2el_ms")) == 40
    samples = np.random.default_rng(1).gamma(4.0, 10.0, 1999)
    reading = read(until(), samples)
    assert reading.value is not None and reading.low is None
    assert not narrow_enough(until(half_width=0.99), reading)


def test_more_samples_narrow_the_interval_around_the_statistic() -> None:
    rng = np.random.default_rng(7)
    rule = until(metric="p90_ttft_ms")
    few = read(rule, rng.gamma(4.0, 10.0, 300))
    many = read(rule, rng.gamma(4.0, 10.0, 30_000))
    for reading in (few, many):
        assert reading.low is not None and reading.high is not None
        assert reading.low <= (reading.value or 0) <= reading.high
    assert (many.relative_half_width or 1) < (few.relative_half_width or 0)
    # The narrow interval holds the true p90 of gamma(4, 10).
    from scipy import stats  # deferred: about 0.9 s to import

    truth = float(stats.gamma.ppf(0.9, 4.0, scale=10.0))
    assert many.low is not None and many.high is not None
    assert many.low < truth < many.high


def test_the_same_samples_give_the_same_interval() -> None:
    samples = np.random.default_rng(3).gamma(2.0, 5.0, 400)
    rule = until(metric="median_ttft_ms")
    assert read(rule, samples, seed=5) == read(rule, samples, seed=5)


def test_alike_samples_have_a_zero_width_interval() -> None:
    reading = read(until(metric="mean_itl_ms"), np.full(100, 4.0))
    assert reading == Reading(4.0, 4.0, 4.0, 100)
    assert reading.relative_half_width == 0
    assert narrow_enough(until(), reading)


def test_rounds_fill_up_to_the_cap_and_no_further() -> None:
    rule = until(max_prompts=250, round_prompts=75)
    assert [next_round(rule, 100, sent) for sent in (100, 175, 250)] == [75, 75, 0]
    assert next_round(until(max_prompts=250), 100, 200) == 50  # the last round is cut
    assert next_round(until(max_prompts=100), 100, 100) == 0


# --- the key ------------------------------------------------------------------------------


SUITE = """
server: {{model: sim-8b}}
benchmark:
  num_prompts: 100
  {extra}
  until: {until}
"""


@pytest.mark.parametrize(
    ("until_text", "extra", "expected"),
    [
        ("{metric: p99_ttfx_ms, half_width: 0.05, max_prompts: 5000}", "",
         "benchmark.until.metric: unknown metric; allowed: mean_/median_/pNN_ of ttft, tpot, "
         "itl, e2el in ms (e.g. p99_ttft_ms) (got 'p99_ttfx_ms')"),
        ("{metric: std_ttft_ms, half_width: 0.05, max_prompts: 5000}", "",
         "unknown metric; allowed: mean_/median_/pNN_ of ttft, tpot, itl, e2el in ms (e.g. "
         "p99_ttft_ms) (got 'std_ttft_ms')"),
        ("{metric: p100_ttft_ms, half_width: 0.05, max_prompts: 5000}", "",
         "a percentile lies strictly between 0 and 100"),
        ("{metric: p99_ttft_ms, half_width: 0, max_prompts: 5000}", "",
         "benchmark.until.half_width: a relative half width above 0 and below 1"),
        ("{metric: p99_ttft_ms, half_width: -5%, max_prompts: 5000}", "",
         "a relative half width above 0 and below 1"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 50}", "",
         "until.max_prompts (50) is below one round: the first round sends num_prompts (100)"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000, confidence: 1.5}", "",
         "benchmark.until.confidence: a confidence above 0.5 and below 1"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000, round_prompts: 0}", "",
         "benchmark.until.round_prompts: a whole number of requests"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000, rounds: 3}", "",
         "unknown key 'benchmark.until.rounds'"),
        ("{metric: p99_ttft_ms, half_width: 0.05}", "", "benchmark.until.max_prompts: Field"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000}",
         "percentile_metrics: e2el", "until.metric p99_ttft_ms: ttft is not among the workload"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000}",
         "ramp_up_strategy: linear\n  ramp_up_start_rps: 1\n  ramp_up_end_rps: 5",
         "until: a ramp-up's rate changes over the load"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000}",
         "dataset_name: conversation\n  backend: openai-chat",
         "until: dataset_name 'conversation' is a whole workload"),
        ("{metric: p99_ttft_ms, half_width: 0.05, max_prompts: 5000}",
         "kind: capacity\n  slo: {p99_ttft_ms: 500}",
         "until: a capacity probe stops by its own rule"),
    ],
)
def test_a_bad_until_is_one_line_naming_the_key(
    tmp_path: Path, until_text: str, extra: str, expected: str
) -> None:
    path = write_suite(tmp_path, SUITE.format(until=until_text, extra=extra))
    message = suite_error(path)
    assert "bench_x.yaml" in message
    assert expected in message


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10_000_000),
    st.text(max_size=8), st.booleans(), st.none(),
)


@settings(max_examples=150, deadline=None)
@given(
    metric=st.one_of(st.sampled_from(["p99_ttft_ms", "median_tpot_ms", "mean_e2el_ms",
                                      "p99.9_itl_ms", "p0_ttft_ms", "ttft"]), st.text(max_size=12)),
    half_width=_VALUES,
    max_prompts=_VALUES,
    confidence=_VALUES,
)
def test_any_until_is_taken_whole_or_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, metric: str, half_width: Any, max_prompts: Any,
    confidence: Any,
) -> None:
    block = {"metric": metric, "half_width": half_width, "max_prompts": max_prompts,
             "confidence": confidence}
    suite = {"server": {"model": "sim-8b"}, "benchmark": {"num_prompts": 100, "until": block}}
    path = tmp_path_factory.mktemp("until") / "bench_x.yaml"
    try:
        text = yaml.safe_dump(suite)
    except yaml.YAMLError:
        return
    path.write_text(text)
    try:
        config = BenchmarkConfig.model_validate(suite["benchmark"])
    except ValueError:
        with pytest.raises(SuiteError) as error:
            cases_of(path)
        # One line per problem, each naming the file, its line and the key.
        assert error.value.problems
        for problem in error.value.problems:
            assert "\n" not in problem
            assert problem.startswith(f"{path}:") and "until" in problem
        return
    rule = config.until
    assert rule is not None
    assert 0 < rule.half_width < 1 and math.isfinite(rule.half_width)
    assert 0.5 < rule.confidence < 1
    assert rule.max_prompts >= config.num_prompts
    assert rule.latency in ("ttft", "tpot", "itl", "e2el")


# --- on the simulated engine ----------------------------------------------------------------

# A stable server (a simulator well below its batch limit) and a statistic that needs two
# rounds before its interval counts (p90: 200 samples); the impossible width runs to its cap.
IMPOSSIBLE = """
server: {model: sim-8b, max_num_seqs: 16}
benchmark:
  num_prompts: 100
  random_input_len: 128
  random_output_len: 16
  request_rate: 20
  until: {metric: p90_ttft_ms, half_width: 0.0001, max_prompts: 250, round_prompts: 75}
"""


def _rows(folder: Path, run_id: str) -> list[dict[str, Any]]:
    with gzip.open(folder / f"{run_id}.requests.jsonl.gz", "rt") as file:
        return [json.loads(line) for line in file]


def test_a_stable_server_stops_by_its_interval_and_an_impossible_width_at_its_cap(
    pytester: pytest.Pytester, ports: str
) -> None:
    shutil.copy(SHIPPED, pytester.path / "bench_until.yaml")
    pytester.makefile(".yaml", bench_cap=IMPOSSIBLE)
    result = run_suites(pytester, ports, "-n", "0", "-rA", cache=False)
    result.assert_outcomes(passed=2)
    records = {r["suite"]: r for r in run_records(pytester)}
    sure, capped = records["until"], records["cap"]

    stop = sure["until"]
    assert stop["stopped_by"] == "interval"
    assert stop["requests"] < stop["max_prompts"]
    assert stop["rounds"] >= 2  # 100 requests hold too few beyond a p90 for an interval
    assert stop["relative_half_width"] <= 0.10
    assert stop["ci_low"] <= stop["value"] <= stop["ci_high"]
    assert stop["value"] == pytest.approx(sure["results"]["p90_ttft_ms"])

    stop = capped["until"]
    assert stop["stopped_by"] == "cap"
    assert (stop["rounds"], stop["requests"]) == (3, 250)  # 100, then 75 and 75
    assert stop["relative_half_width"] > 0.0001

    folder = pytester.path / "results"
    for record in (sure, capped):
        stop = record["until"]
        # Each round's request once: in the figures, the rows, the server's own count.
        rows = _rows(folder, record["run_id"])
        assert record["results"]["completed"] == stop["requests"] == stop["samples"]
        assert len(rows) == stop["requests"]
        assert sorted(row["index"] for row in rows) == list(range(stop["requests"]))
        assert len({row["trace_id"] for row in rows}) == stop["requests"]
        assert record["system"]["server_ttft_count"] == stop["requests"]
        # Each round's prompts are its own (the next seed's): none resent to a warm cache.
        assert record["system"]["server_prefix_cache_hit_rate"] < 0.2
        assert record["validity"] == "valid"
    with sqlite3.connect(folder / "results.db") as db:
        stored = dict(db.execute("SELECT suite, until_stopped_by FROM benchmark_runs"))
    assert stored == {"until": "interval", "cap": "cap"}
    # The run page says what ended each, in one line.
    db = sqlite3.connect(folder / "results.db")
    try:
        page = run_page(db, capped["run_id"])
        assert page is not None and page.until is not None
        assert "stopped by the cap of 250 requests, after 3 round(s), 250 requests" in page.until
        page = run_page(db, sure["run_id"])
        assert page is not None and page.until is not None
        assert "stopped as the interval was narrow enough" in page.until
    finally:
        db.close()
    assert until_line(None) is None


def test_the_page_shows_the_suite_it_ships() -> None:
    shown = [yaml.safe_load(block) for block in PAGE.read_text().split("```yaml\n")[1:]
             for block in [block.split("```", 1)[0]]]
    shipped = yaml.safe_load(SHIPPED.read_text())
    assert shipped in shown
