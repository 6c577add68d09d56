"""Agentic traces: a trace line may wait for another (its session's previous line, or the line
its parent id names) and goes no earlier than its time and not before that answer ended plus
its delay; bad links are one line naming the file and line; a case keeps the prefix-cache hit
rate its trace implies for the server's block size beside the server's; and the shipped
agentic trace replays on the simulator with the server finding what the trace implies."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.load.agentic_trace import CHUNK, EXAMPLE, MAX_PROMPT, example_text
from pytest_profllm.load.bench import load_settings, run_load
from pytest_profllm.load.dataset import DatasetError, TokenizerCodec, make_prompts
from pytest_profllm.load.processes import deal
from pytest_profllm.load.trace import (
    ideal_prefix_hit_rate,
    implied_prefix_hit_rate,
    prefix_hit_figures,
    read_trace,
    window,
)
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.model_files import MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "docs" / "writing-suites" / "bench_agentic_trace.yaml"
PAGE = REPO / "docs" / "writing-suites" / "agentic-traces.md"


@pytest.fixture(scope="module")
def codec() -> TokenizerCodec:
    return TokenizerCodec.load(str(MODEL_DIR))


def write_trace(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return path


def trace_config(path: Path, **values: Any) -> BenchmarkConfig:
    return BenchmarkConfig(dataset_name="timed_trace", dataset_path=str(path), **values)


def example_config(**values: Any) -> BenchmarkConfig:
    return trace_config(EXAMPLE, timed_trace_chunk_hash_size=CHUNK,
                        timed_trace_sec_multiplier=0.001, **values)


def test_a_line_waits_for_its_sessions_previous_line_or_its_named_parent(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "session_id": "a", "input_length": 8, "output_length": 2},
        {"timestamp": 5, "session_id": "b", "chat_id": 7, "input_length": 8, "output_length": 2},
        # AIPerf's multi-turn line: no time of its own, a delay after the previous turn.
        {"session_id": "a", "delay": 300, "input_length": 16, "output_length": 2},
        # Bailian's: a parent named by its chat_id (-1: none).
        {"timestamp": 9, "chat_id": 8, "parent_chat_id": 7, "delay": 20, "input_length": 8,
         "output_length": 2},
        {"timestamp": 9, "chat_id": 9, "parent_chat_id": -1, "input_length": 8,
         "output_length": 2},
        # A parent id wins over the session: a subagent's first turn in a session of its own.
        {"timestamp": 10, "session_id": "a", "parent_chat_id": 8, "input_length": 8,
         "output_length": 2},
        {"timestamp": 11, "session_id": "a", "input_length": 8, "output_length": 2},
    ])  # fmt: skip
    entries = read_trace(trace_config(path, timed_trace_sec_multiplier=0.001))
    assert [(e.line, e.parent) for e in entries] == [
        (1, None), (2, None), (3, 1), (4, 2), (5, None), (6, 4), (7, 6),
    ]  # fmt: skip
    assert [e.delay_s for e in entries] == pytest.approx([0, 0, 0.3, 0.02, 0, 0, 0])
    assert entries[2].timestamp_s == 0.0  # a line without a time carries its parent's


def test_the_send_order_keeps_parents_in_the_window_and_compresses_delays(
    tmp_path: Path, codec: TokenizerCodec
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "session_id": "a", "input_length": 8, "output_length": 2},
        {"timestamp": 1000, "session_id": "a", "delay": 400, "input_length": 8,
         "output_length": 2},
        {"timestamp": 2000, "session_id": "a", "delay": 400, "input_length": 8,
         "output_length": 2},
    ])  # fmt: skip
    whole = make_prompts(trace_config(path, timed_trace_sec_multiplier=0.001, trace_speedup=4),
                         codec)
    assert [(r.after, r.after_delay_s) for r in whole] == [(None, 0.0), (0, 0.1), (1, 0.1)]
    # Cut after the first line: its child has no parent in the replay and waits for none.
    cut = make_prompts(trace_config(path, timed_trace_sec_multiplier=0.001, trace_start_s=0.5),
                       codec)
    assert [(r.after, r.after_delay_s) for r in cut] == [(None, 0.0), (0, 0.4)]


@pytest.mark.parametrize(("lines", "message"), [
    ([{"session_id": "a", "input_length": 8, "output_length": 2}],
     "t.jsonl:1: no field 'timestamp'"),
    ([{"timestamp": 0, "parent_chat_id": 3, "input_length": 8, "output_length": 2}],
     "t.jsonl:1: parent_chat_id 3 is no earlier line's chat_id"),
    ([{"timestamp": 0, "chat_id": 1, "input_length": 8, "output_length": 2},
      {"timestamp": 1, "chat_id": 1, "input_length": 8, "output_length": 2}],
     "t.jsonl:2: chat_id 1 is line 1's too"),
    ([{"timestamp": 0, "session_id": "a", "input_length": 8, "output_length": 2},
      {"timestamp": 1, "session_id": "a", "delay": -5, "input_length": 8, "output_length": 2}],
     "t.jsonl:2: the delay -5 is not a finite time >= 0"),
    ([{"timestamp": 0, "session_id": ["a"], "input_length": 8, "output_length": 2}],
     "t.jsonl:1: 'session_id' must be a string or an integer, not ['a']"),
    ([{"timestamp": 0, "session_id": "a", "input_length": 8, "output_length": 2},
      {"timestamp": 1, "session_id": "a", "delay": True, "input_length": 8,
       "output_length": 2}],
     "t.jsonl:2: the delay True is not a finite time >= 0"),
])  # fmt: skip
def test_a_bad_link_is_one_line_naming_the_file_and_line(
    tmp_path: Path, lines: list[dict[str, Any]], message: str
) -> None:
    path = write_trace(tmp_path / "t.jsonl", lines)
    with pytest.raises(DatasetError) as error:
        read_trace(trace_config(path))
    assert str(error.value).startswith(str(tmp_path / message.split(":")[0]))
    assert message in str(error.value) and "\n" not in str(error.value)


_ID = st.one_of(st.none(), st.integers(-2, 4), st.sampled_from(["a", "b"]), st.booleans(),
                st.floats(allow_nan=True), st.lists(st.integers(), max_size=1))
_TIME = st.one_of(st.integers(0, 5000), st.floats(allow_nan=True), st.none(), st.text(max_size=2))
_LINE = st.fixed_dictionaries(
    {"input_length": st.integers(1, 64), "output_length": st.integers(1, 8)},
    optional={"timestamp": _TIME, "session_id": _ID, "chat_id": _ID, "parent_chat_id": _ID,
              "delay": _TIME, "hash_ids": st.lists(st.integers(0, 3), max_size=4)},
)  # fmt: skip


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(_LINE, min_size=1, max_size=8))
def test_any_linked_trace_is_refused_by_line_or_replays_parents_first(
    tmp_path: Path, lines: list[dict[str, Any]], codec: TokenizerCodec
) -> None:
    path = tmp_path / "any.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = trace_config(path, timed_trace_sec_multiplier=0.001)
    try:
        requests = make_prompts(config, codec)
    except DatasetError as error:
        assert re.match(rf"{re.escape(str(path))}(:\d+)?: ", str(error)), str(error)
        assert "\n" not in str(error)
        return
    # Each request waits for an earlier one, never itself or a later one, and a chain goes
    # to one client process.
    assert all(r.after is None or 0 <= r.after < at for at, r in enumerate(requests))
    assert all(r.after_delay_s >= 0 for r in requests)
    ranks = deal(requests, 2)
    assert all(r.after is None or ranks[r.after] == ranks[at] for at, r in enumerate(requests))


def test_the_ideal_of_the_sent_tokens_is_the_traces_implied_rate(codec: TokenizerCodec) -> None:
    config = example_config()
    entries = window(read_trace(config), config)
    prompts = make_prompts(config, codec)
    for block in (16, 32, 128):
        implied = implied_prefix_hit_rate(entries, CHUNK, block)
        assert ideal_prefix_hit_rate((p.prompt_ids or () for p in prompts), block) == implied
    # The figures a case keeps: the ideal with the server's block size, the server's over it.
    figures = prefix_hit_figures(prompts, 128, 0.41)
    ideal = implied_prefix_hit_rate(entries, CHUNK, 128)
    assert figures == {"implied_prefix_cache_hit_rate": ideal,
                       "prefix_cache_hit_rate_vs_implied": pytest.approx(0.41 / ideal)}
    for size, rate in ((None, 0.4), (0, 0.4), (True, 0.4), ("16", 0.4)):
        assert prefix_hit_figures(prompts, size, rate)["implied_prefix_cache_hit_rate"] is None
    assert prefix_hit_figures(prompts, 16, None)["prefix_cache_hit_rate_vs_implied"] is None


def test_the_shipped_agentic_trace_is_what_its_generator_makes() -> None:
    assert EXAMPLE.read_text() == example_text()
    lines = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    entries = read_trace(example_config())
    assert 100 <= len(entries) <= 300
    # Agents share the system prompt and the tool schema; subagents begin with their
    # spawner's context; every prompt and answer fits the tiny real-vLLM model's 1024 tokens.
    assert all(line["hash_ids"][:4] == [1, 2, 3, 4] for line in lines)
    spawned = [line for line in lines if line["parent_chat_id"] != -1]
    by_id = {line["chat_id"]: line for line in lines}
    assert len(spawned) >= 8
    for line in spawned:
        parent = by_id[line["parent_chat_id"]]
        assert line["hash_ids"][: len(parent["hash_ids"])] == parent["hash_ids"]
    assert len({line["session_id"] for line in lines}) >= 10
    assert all(e.input_len <= MAX_PROMPT and e.input_len + e.output_len <= 1024
               for e in entries)
    assert sum(e.parent is not None for e in entries) > len(entries) // 2


def test_a_child_goes_after_its_parents_answer_plus_its_delay(
    sim_url: str, tmp_path: Path, codec: TokenizerCodec
) -> None:
    """The child's recorded time is the parent's; it waits for the parent's 64-token answer
    and then its delay (50 ms). Dealt to two client processes, it goes with its parent."""
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "session_id": "a", "input_length": 16, "output_length": 64},
        {"timestamp": 0, "session_id": "b", "input_length": 16, "output_length": 4},
        {"timestamp": 0, "session_id": "a", "delay": 50, "input_length": 32,
         "output_length": 4},
    ])  # fmt: skip
    config = trace_config(path, timed_trace_sec_multiplier=0.001, ignore_eos=True)
    requests = make_prompts(config, codec)
    for processes in (1, 2):
        settings_ = dataclasses.replace(load_settings(config, sim_url, "sim"),
                                        client_processes=processes)
        load = asyncio.run(run_load(settings_, requests))
        parent, _, child = load.outcomes
        assert all(outcome.success for outcome in load.outcomes)
        assert child.dispatch_time >= parent.end_time + 0.05
        # It was due then: the wait is not the client's lag.
        assert child.intended_start == pytest.approx(parent.end_time + 0.05)
        assert load.intended_offsets[2] == pytest.approx(child.intended_start - load.clock_start)


def test_the_docs_page_shows_the_suite_it_ships() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    assert yaml.safe_load(SUITE.read_text()) in [yaml.safe_load(block) for block in blocks]


def test_the_agentic_suite_on_the_simulator_finds_what_its_trace_implies(
    pytester: pytest.Pytester, ports: str
) -> None:
    """The shipped suite, run as a user runs it: the case starts from an emptied prefix
    cache, and the simulator (a cache that never evicts, blocks of 16) finds what the trace
    implies for blocks of 16, to within 2 % of it; the run page says both."""
    from helpers import run_records, run_suites

    from pytest_profllm.browse.run_page import run_page

    (pytester.path / SUITE.name).write_text(SUITE.read_text())
    result = run_suites(pytester, ports, "--profllm-engine=sim", timeout=300)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    system = record["system"]
    assert record["runtime"]["prefix_cache"] == "emptied before the load"
    assert record["results"]["completed"] == 165
    assert system["server_kv_block_size"] == 16
    ideal = implied_prefix_hit_rate(window(read_trace(example_config()), example_config()),
                                    CHUNK, 16)
    assert system["implied_prefix_cache_hit_rate"] == pytest.approx(ideal)
    assert 0.8 < ideal < 0.95
    assert system["prefix_cache_hit_rate_vs_implied"] == pytest.approx(1.0, abs=0.02)
    assert system["prefix_cache_hit_rate_vs_implied"] == pytest.approx(
        system["server_prefix_cache_hit_rate"] / ideal
    )
    with sqlite3.connect(pytester.path / "results" / "results.db") as connection:
        page = run_page(connection, record["run_id"])
    assert page is not None and page.prefix_cache is not None
    assert f"finds {ideal:.1%} of its prompt tokens" in page.prefix_cache
    assert "16-token blocks" in page.prefix_cache and "of the ideal" in page.prefix_cache


def test_a_case_of_another_workload_keeps_no_implied_rate() -> None:
    from pytest_profllm.browse.run_page import prefix_cache_line

    assert prefix_cache_line({"system_server_prefix_cache_hit_rate": 0.3}) is None
    assert prefix_cache_line({"system_implied_prefix_cache_hit_rate": 0.5,
                              "system_server_kv_block_size": 16}) == (
        "The trace implies that a prefix cache of 16-token blocks that never evicts finds "
        "50.0% of its prompt tokens. The server reported no prefix-cache hit rate."
    )



def test_vllm_bench_serve_is_given_no_link_flags_it_lacks(tmp_path: Path) -> None:
    """vLLM's timed_trace reads no sessions or parents: the labels are ours, never flags."""
    from pytest_profllm.load.vllm_command import unrendered, vllm_bench_serve_argv

    config = trace_config(tmp_path / "t.jsonl", timed_trace_label_session_id="conversation",
                          timed_trace_label_delay="think_ms")
    argv = vllm_bench_serve_argv(config, base_url="http://127.0.0.1:1", model="m")
    assert not [flag for flag in argv if flag.startswith("--timed-trace-label-") and flag not in (
        "--timed-trace-label-timestamp", "--timed-trace-label-input-length",
        "--timed-trace-label-output-length", "--timed-trace-label-hash-ids")]
    assert unrendered(config) == ["timed_trace_label_session_id", "timed_trace_label_delay"]
