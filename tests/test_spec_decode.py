"""Speculative decoding in the record: vLLM's vllm:spec_decode_* counters read over a case's
window (acceptance rate, mean acceptance length, rate per draft position, null with a reason
where the server did not speculate), and the simulated engine's draft model (k draft tokens
per step, accepted by position, vLLM's counters, TPOT that follows the acceptance)."""

from __future__ import annotations

import fnmatch
import json
import math
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers import run_records, run_suites
from hypothesis import given
from hypothesis import strategies as st
from test_datasette import make_record

from pytest_profllm.browse.run_page import run_page
from pytest_profllm.load.scrape import parse_metrics
from pytest_profllm.load.spec_decode import (
    NOT_SPECULATING,
    NOT_SPECULATING_SIM,
    spec_decode_figures,
)
from pytest_profllm.results.ingest import ingest
from pytest_profllm.results.record import BenchmarkRecord
from pytest_profllm.sim.batching import ConstantStepCost, Scheduler
from pytest_profllm.sim.cli import main as sim_main
from pytest_profllm.sim.instruments import render_metrics
from pytest_profllm.sim.speculation import (
    ACCEPTANCE_ENV,
    DEFAULT_ACCEPTANCE,
    Speculation,
    SpeculationError,
    speculation_from,
)


def vllm_metrics(drafts: int, drafted: int, accepted: int, per_position: list[int]) -> str:
    """/metrics as vLLM 0.32's prometheus_client writes its speculative decoding counters
    (the names of vllm/v1/spec_decode/metrics.py, each with `_total` and `_created`, labels
    model_name and engine, and position for the per-position counter), with a histogram
    beside them."""
    labels = 'engine="0",model_name="/models/tiny"'
    lines = []
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", drafted),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted),
    ):
        lines += [
            f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
            f"{name}_total{{{labels}}} {float(value)}",
            f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge",
            f"{name}_created{{{labels}}} 1.7965894290998213e+09",
        ]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {name}_total Accepted tokens per draft position.",
              f"# TYPE {name}_total counter"]
    lines += [f'{name}_total{{{labels},position="{i}"}} {float(v)}'
              for i, v in enumerate(per_position)]
    lines += [f"# HELP {name}_created Accepted tokens per draft position.",
              f"# TYPE {name}_created gauge"]
    lines += [f'{name}_created{{{labels},position="{i}"}} 1.7965894290999637e+09'
              for i in range(len(per_position))]
    lines += [
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{labels}}} 0.0",
    ]
    return "\n".join(lines) + "\n"


def test_vllms_counters_are_read_over_the_window() -> None:
    before = parse_metrics(vllm_metrics(10, 30, 20, [8, 7, 5]))
    # Over the load: 64 drafts of 184 draft tokens (ngram drafts fewer than k near the end),
    # 160 accepted: 56, 56 and 48 at positions 0, 1 and 2.
    after = parse_metrics(vllm_metrics(74, 214, 180, [64, 63, 53]))
    figures = spec_decode_figures(before, after)
    assert figures["server_spec_decode_num_drafts"] == 64
    assert figures["server_spec_decode_num_draft_tokens"] == 184
    assert figures["server_spec_decode_num_accepted_tokens"] == 160
    assert figures["server_spec_decode_acceptance_rate"] == pytest.approx(160 / 184)
    assert figures["server_spec_decode_mean_acceptance_length"] == pytest.approx(1 + 160 / 64)
    assert figures["server_spec_decode_acceptance_rate_per_position"] == pytest.approx(
        [56 / 64, 56 / 64, 48 / 64]
    )
    assert figures["server_spec_decode_problem"] is None
    # The engines' samples add up: two engines' halves are one engine's whole.
    two = vllm_metrics(37, 107, 90, [32, 31, 26]).replace('engine="0"', 'engine="1"')
    doubled = parse_metrics(vllm_metrics(37, 107, 90, [32, 31, 27]) + two)
    assert spec_decode_figures(before, doubled)["server_spec_decode_num_drafts"] == 64


def test_a_server_that_did_not_speculate_has_null_figures_and_says_why() -> None:
    plain = parse_metrics("# TYPE vllm:num_preemptions_total counter\n"
                          'vllm:num_preemptions_total{engine="0"} 3.0\n')
    figures = spec_decode_figures(plain, plain)
    assert figures["server_spec_decode_problem"] == NOT_SPECULATING
    others = {key: value for key, value in figures.items()
              if key != "server_spec_decode_problem"}
    assert set(others.values()) == {None}


@pytest.mark.parametrize(
    ("before", "after", "problem"),
    [
        (vllm_metrics(50, 150, 90, [40, 30, 20]), vllm_metrics(10, 30, 20, [8, 7, 5]),
         "vllm:spec_decode_num_drafts_total went back during the load (a restart?)"),
        (None, vllm_metrics(10, 30, 20, [8, 7, 5]),
         "no /metrics scrape before the load (none was taken): the window has no start"),
        (vllm_metrics(10, 30, 20, [8, 7, 5]), vllm_metrics(10, 30, 20, [8, 7, 5]),
         "the server speculates, but drafted nothing during the load"),
        (vllm_metrics(0, 0, 0, [0, 0]), vllm_metrics(10, 30, 40, [8, 7]),
         "vllm:spec_decode_num_accepted_tokens_total grew by 40, more than the 30 draft tokens"),
    ],
)
def test_a_window_that_cannot_be_read_says_why(
    before: str | None, after: str, problem: str
) -> None:
    figures = spec_decode_figures(
        parse_metrics(before) if before is not None else None, parse_metrics(after)
    )
    assert figures["server_spec_decode_problem"] == problem
    assert figures["server_spec_decode_acceptance_rate"] is None


counts = st.integers(min_value=0, max_value=10**9)


@given(st.tuples(counts, counts, counts), st.tuples(counts, counts, counts),
       st.lists(counts, max_size=5), st.lists(counts, max_size=5))
def test_any_counters_give_figures_in_range_or_a_reason(
    then: tuple[int, int, int], now: tuple[int, int, int], positions_then: list[int],
    positions_now: list[int],
) -> None:
    figures = spec_decode_figures(parse_metrics(vllm_metrics(*then, positions_then)),
                                  parse_metrics(vllm_metrics(*now, positions_now)))
    rate = figures["server_spec_decode_acceptance_rate"]
    if rate is None:
        assert figures["server_spec_decode_problem"]
        return
    assert 0 <= rate <= 1
    assert figures["server_spec_decode_mean_acceptance_length"] >= 1
    for value in figures["server_spec_decode_acceptance_rate_per_position"] or []:
        assert 0 <= value <= 1


def test_the_simulators_acceptance_follows_its_probabilities() -> None:
    probabilities = (0.8, 0.5, 0.3)
    spec = Speculation("ngram", 3, probabilities, random.Random(7))
    drafts = 20_000
    for _ in range(drafts):
        spec.draft()
    # Position i is accepted when it and every position before it are.
    expected = [0.8, 0.8 * 0.5, 0.8 * 0.5 * 0.3]
    for count, p in zip(spec.accepted_per_position, expected, strict=True):
        sigma = math.sqrt(p * (1 - p) / drafts)
        assert abs(count / drafts - p) < 5 * sigma
    length = 1 + spec.num_accepted_tokens / spec.num_drafts
    assert abs(length - spec.expected_length()) < 0.05
    assert spec.num_draft_tokens == 3 * drafts


def test_the_simulator_reads_its_speculative_config_and_knob(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert speculation_from(None) is None
    spec = speculation_from('{"method": "ngram", "num_speculative_tokens": 5}')
    assert spec is not None
    # The method's default, its last value repeated for the positions past it.
    assert spec.acceptance == (*DEFAULT_ACCEPTANCE["ngram"], DEFAULT_ACCEPTANCE["ngram"][-1],
                               DEFAULT_ACCEPTANCE["ngram"][-1])
    monkeypatch.setenv(ACCEPTANCE_ENV, "0.9,0.1")
    spec = speculation_from('{"method": "eagle", "num_speculative_tokens": 2}')
    assert spec is not None and spec.acceptance == (0.9, 0.1)
    with pytest.raises(SpeculationError, match="num_speculative_tokens must be an integer"):
        speculation_from('{"method": "ngram"}')
    with pytest.raises(SpeculationError, match=r"must lie in \[0, 1\], got '1.5'"):
        speculation_from('{"num_speculative_tokens": 2}', "0.5,1.5")


def test_the_simulator_serves_vllms_counters_and_emits_accepted_tokens() -> None:
    clock = [0.0]
    spec = Speculation("ngram", 3, (1.0, 1.0, 0.0), random.Random(0))
    scheduler = Scheduler(cost=ConstantStepCost(0.01), max_num_seqs=4,
                          max_num_batched_tokens=2048, clock=lambda: clock[0],
                          stream_tokens=False, speculation=spec)
    for _ in range(4):
        scheduler.submit(64, 61)
    while (step := scheduler.plan_step()) is not None:
        clock[0] += scheduler.step_duration(step)
        scheduler.finish_step(step, clock[0])
    # The prefill step's token, then 3 tokens a step (2 accepted and the bonus): 1 + 20 x 3.
    assert scheduler.steps == 21
    assert scheduler.generation_tokens == 4 * 61
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (80, 240, 160)
    scraped = parse_metrics(render_metrics(scheduler, "m").decode())
    figures = spec_decode_figures(parse_metrics(""), scraped)
    assert figures["server_spec_decode_mean_acceptance_length"] == 3.0
    assert figures["server_spec_decode_acceptance_rate_per_position"] == [1.0, 1.0, 0.0]


SPEC_SUITE = """
server:
  model: Qwen/Qwen3-8B
  speculative_config: [null, {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}]
benchmark:
  num_prompts: 12
  random_input_len: 128
  random_output_len: 64
  max_concurrency: 4
"""


def _by_speculation(pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch,
                    acceptance: str, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The suite's records without and with speculation, the draft tokens accepted with
    `acceptance` (the simulator's knob), in a folder of their own."""
    out = f"results-{acceptance.replace(',', '-')}"
    monkeypatch.setenv(ACCEPTANCE_ENV, acceptance)  # pytester's subprocess inherits it
    result = run_suites(pytester, ports, "-n", "0", *args, out=out)
    # A busy host may make a real-time load invalid (its figures measure the host): its
    # record still counts the drafts, which the host does not change.
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) + outcomes.get("invalid", 0) == 2, outcomes
    plain, speculating = sorted(
        run_records(pytester, out),
        key=lambda r: r["config"]["server"].get("speculative_config") is not None,
    )
    for record in (plain, speculating):
        BenchmarkRecord.model_validate(record)
    return plain, speculating


def test_a_speculating_case_records_its_acceptance(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The simulator served over HTTP, its /metrics scraped before and after the load.
    pytester.makefile(".yaml", bench_spec=SPEC_SUITE)
    plain, high = _by_speculation(pytester, ports, monkeypatch, "0.9")
    assert plain["system"]["server_spec_decode_problem"] == NOT_SPECULATING
    assert plain["system"]["server_spec_decode_acceptance_rate"] is None
    system = high["system"]
    drafts = system["server_spec_decode_num_drafts"]
    assert drafts > 0
    assert system["server_spec_decode_num_draft_tokens"] == 3 * drafts
    # 0.9 at each position: position i is accepted with 0.9^(i+1); within 5 sigma.
    expected = [0.9, 0.81, 0.729]
    for rate, p in zip(system["server_spec_decode_acceptance_rate_per_position"], expected,
                       strict=True):
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / drafts)
    assert system["server_spec_decode_acceptance_rate"] == pytest.approx(sum(expected) / 3,
                                                                        abs=0.06)
    assert system["server_spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + sum(expected), abs=0.2)
    assert system["server_spec_decode_problem"] is None


def test_tpot_follows_the_acceptance(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the virtual clock (no host in the figures): the same suite, accepted often and rarely.
    pytester.makefile(".yaml", bench_spec=SPEC_SUITE)
    virtual = "--profllm-sim-clock=virtual"
    plain, high = _by_speculation(pytester, ports, monkeypatch, "0.9", virtual)
    _, low = _by_speculation(pytester, ports, monkeypatch, "0.1", virtual)
    assert plain["system"]["server_spec_decode_problem"] == NOT_SPECULATING_SIM
    lengths = [r["system"]["server_spec_decode_mean_acceptance_length"] for r in (high, low)]
    assert lengths[0] == pytest.approx(1 + 0.9 + 0.81 + 0.729, abs=0.2)
    assert lengths[1] == pytest.approx(1 + 0.1 + 0.01 + 0.001, abs=0.1)
    tpot = {name: r["results"]["median_tpot_ms"]
            for name, r in (("plain", plain), ("high", high), ("low", low))}
    # 3.4 tokens a step for about one step's time: a third of the TPOT or so.
    assert tpot["high"] < 0.5 * tpot["plain"], tpot
    # About one token a step, and the drafts' verification on top.
    assert tpot["high"] < 0.5 * tpot["low"], tpot
    assert tpot["low"] > 0.8 * tpot["plain"], tpot


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-config", '{"method": "ngram"}'],
         "argument --speculative-config: num_speculative_tokens must be an integer from 1 to "
         "64, got None"),
        (["--speculative-config", "{method: ngram"],
         "argument --speculative-config: not JSON: *"),
        (["--speculative-config", '{"num_speculative_tokens": 2}', "--sim-spec-acceptance",
          "0.5,x"],
         "argument --speculative-config: expected probabilities like 0.8,0.6,0.4, got '0.5,x'"),
    ],
)
def test_the_simulator_refuses_a_speculation_it_cannot_read_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        sim_main(["Qwen/Qwen3-8B", *argv])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert fnmatch.fnmatch(last, f"profllm sim: error: {message}"), last


def test_the_run_page_shows_the_acceptance_beside_tpot(tmp_path: Path) -> None:
    speculating = make_record("r1", "s1", "bench_spec.yaml::qwen3-8b-sc-1::random",
                              "2026-01-01T10:00:00+00:00")
    speculating["system"].update(
        server_spec_decode_num_drafts=299.0, server_spec_decode_num_draft_tokens=897.0,
        server_spec_decode_num_accepted_tokens=731.0, server_spec_decode_acceptance_rate=0.815,
        server_spec_decode_mean_acceptance_length=3.445,
        server_spec_decode_acceptance_rate_per_position=[0.906, 0.819, 0.719],
    )
    plain = make_record("r2", "s1", "bench_spec.yaml::qwen3-8b-sc-none::random",
                        "2026-01-01T10:01:00+00:00")
    plain["system"]["server_spec_decode_problem"] = NOT_SPECULATING
    for record in (speculating, plain):
        (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    db = tmp_path / "results.db"
    ingest(db, sorted(tmp_path.glob("*.json")))
    with sqlite3.connect(db) as connection:
        shown = run_page(connection, "r1")
        other = run_page(connection, "r2")
    assert shown is not None and other is not None
    labels = [label for label, _, _ in shown.headlines]
    at = labels.index("p99 TPOT")
    assert shown.headlines[at + 1:at + 4] == [
        ("mean acceptance length", "3.445", "tok/draft"),
        ("draft acceptance rate", "81.5", "%"),
        ("acceptance rate by draft position (1st · 2nd · ...)", "91 · 82 · 72", "%"),
    ]
    assert not any("acceptance" in label for label, _, _ in other.headlines)
