"""Timed trace replay (`dataset_name: timed_trace`): the file is read and checked line by line,
shared hash ids become shared token prefixes, requests go at their recorded times, and the
simulator's prefix cache finds what the trace's sharing implies."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pytest_profllm.limits import MAX_REPLAY_S, MAX_REQUEST_TOKENS
from pytest_profllm.load.bench import load_settings, run_bench, run_load
from pytest_profllm.load.client import request_payload
from pytest_profllm.load.dataset import DatasetError, TokenizerCodec, make_prompts
from pytest_profllm.load.trace import (
    EXAMPLE_TRACE,
    example_trace,
    implied_prefix_hit_rate,
    read_trace,
    send_offsets,
    window,
)
from pytest_profllm.load.vllm_command import unrendered, vllm_bench_serve_argv
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig
from pytest_profllm.sim.model_files import MODEL_DIR


@pytest.fixture(scope="module")
def codec() -> TokenizerCodec:
    return TokenizerCodec.load(str(MODEL_DIR))


def write_trace(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    return path


def trace_config(path: Path, **values: Any) -> BenchmarkConfig:
    return BenchmarkConfig(dataset_name="timed_trace", dataset_path=str(path), **values)


def test_shared_hash_ids_are_shared_token_prefixes(tmp_path: Path, codec: TokenizerCodec) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 1, "input_length": 48, "output_length": 4, "hash_ids": [7, 8, 5]},
        {"timestamp": 2, "input_length": 30, "output_length": 4, "hash_ids": [3, 8]},
        {"timestamp": 3, "input_length": 50, "output_length": 4},
    ])  # fmt: skip
    requests = make_prompts(trace_config(path), codec)
    ids = [list(request.prompt_ids or ()) for request in requests]
    assert [len(prompt) for prompt in ids] == [40, 48, 30, 50]
    assert [request.prompt_len for request in requests] == [40, 48, 30, 50]
    # Two shared blocks of 16: the sent bodies are byte-identical up to their end, not beyond.
    bodies = [
        json.dumps(request_payload(load_settings(trace_config(path), "u", "m"), r)["prompt"])
        for r in requests
    ]
    shared = json.dumps(ids[0][:32])[:-1]  # the list's text up to its 32nd id
    assert bodies[0].startswith(shared) and bodies[1].startswith(shared)
    assert ids[0][32:40] != ids[1][32:40]  # block 9 (8 tokens, cut short) against block 5
    assert ids[2][16:30] != ids[0][16:30]  # block 8 cut to 14 tokens is a block of its own
    assert ids[2][:16] != ids[0][:16]  # block 3 is not block 7
    # A line without hash ids has tokens of its own.
    assert ids[3][:16] not in (ids[0][:16], ids[2][:16])
    special = codec.special_ids
    assert not any(token in special for prompt in ids for token in prompt)
    assert make_prompts(trace_config(path), codec) == requests  # the same every time
    assert make_prompts(trace_config(path, seed=1), codec) != requests


def test_requests_go_at_their_recorded_times_in_the_window(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": ms, "input_length": 16, "output_length": 2} for ms in
        (1000, 1500, 2000, 4000, 9000, 9000)
    ])  # fmt: skip
    config = trace_config(path, timed_trace_sec_multiplier=0.001)
    entries = read_trace(config)
    assert send_offsets(entries, config) == pytest.approx([0.0, 0.5, 1.0, 3.0, 8.0, 8.0])
    fast = trace_config(path, timed_trace_sec_multiplier=0.001, trace_speedup=4)
    assert send_offsets(entries, fast) == pytest.approx([0.0, 0.125, 0.25, 0.75, 2.0, 2.0])
    # A mean rate of 2.5 req/s over 6 requests: 5 gaps in 2 s.
    target = trace_config(path, timed_trace_sec_multiplier=0.001, trace_target_rate=2.5)
    assert send_offsets(entries, target)[-1] == pytest.approx(2.0)
    cut = trace_config(path, timed_trace_sec_multiplier=0.001, trace_start_s=0.5,
                       trace_duration_s=3.0)  # fmt: skip
    chosen = window(entries, cut)
    assert [entry.line for entry in chosen] == [2, 3, 4]  # 1.5 s to 4.5 s into the trace
    assert send_offsets(chosen, cut) == pytest.approx([0.0, 0.5, 2.5])
    capped = trace_config(path, timed_trace_sec_multiplier=0.001, num_prompts=2)
    assert len(window(entries, capped)) == 2


def test_a_csv_trace(tmp_path: Path, codec: TokenizerCodec) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,input_len,output_len\n0,20,3\n0.25,33,5\n\n1.5,17,2\n")
    requests = make_prompts(trace_config(path), codec)
    assert [(r.prompt_len, r.output_len, r.timestamp) for r in requests] == [
        (20, 3, 0.0), (33, 5, 0.25), (17, 2, 1.5),
    ]  # fmt: skip
    headless = tmp_path / "h.csv"
    headless.write_text("0,20,3\n")
    assert len(make_prompts(trace_config(headless), codec)) == 1


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("t.jsonl", '{"timestamp": 1, "input_length": 5, "output_length": 2}\n{"timestamp": 0, '
         '"input_length": 5, "output_length": 2}\n', "t.jsonl:2: timestamps must not go back"),
        ("t.jsonl", '{"timestamp": 0, "input_length": -5, "output_length": 2}\n',
         "t.jsonl:1: the input length -5 is not a whole number >= 1"),
        ("t.jsonl", '\n{"timestamp": 0, "output_length": 2}\n',
         "t.jsonl:2: no field 'input_length'"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2}\nnot json\n',
         "t.jsonl:2: not JSON"),
        ("t.jsonl", "[1, 2]\n", "t.jsonl:1: each line is a JSON object, not list"),
        ("t.jsonl", '{"timestamp": "soon", "input_length": 5, "output_length": 2}\n',
         "t.jsonl:1: the timestamp 'soon' is not a number"),
        ("t.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": '
         '"ab"}\n', "t.jsonl:1: 'hash_ids' must be a list of integers"),
        ("t.jsonl", "", "t.jsonl: the trace has no requests"),
        ("t.csv", "0,5,2\n1,5\n", "t.csv:2: a trace CSV row is timestamp, input_len, "
         "output_len; this one has 2 cells"),
        ("t.csv", "0,5,2\n1,five,2\n", "t.csv:2: input_len 'five' is not a number"),
        ("t.csv", "0,5,2\n1,5.5,2\n", "t.csv:2: the input length 5.5 is not a whole number"),
        ("t.csv", "2,5,2\n1,5,2\n", "t.csv:2: timestamps must not go back"),
        # Beyond limits.py's limits, each one line. Once: 5.4 GB of memory and a MemoryError
        # after 53 s; a case waiting for ever; a RecursionError.
        ("t.jsonl", '{"timestamp": 0, "input_length": 1000000000, "output_length": 2}\n',
         "t.jsonl:1: input length 1,000,000,000 and output length 2 exceed the most tokens a "
         "request may have (10,485,760)"),
        ("t.csv", "0,5,2\n1e300,5,2\n", "t.csv:2: sent 1e+300 s after the replay's start, past "
         "the 24 h a replay may last"),
        ("t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n",
         "t.jsonl:1 nests JSON deeper than 64 levels"),
    ],
)  # fmt: skip
def test_a_bad_trace_is_one_line_naming_the_file_and_line(
    tmp_path: Path, codec: TokenizerCodec, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DatasetError) as caught:
        make_prompts(trace_config(path), codec)
    assert str(caught.value).startswith(f"{tmp_path}/{message}")
    assert "\n" not in str(caught.value)


def test_lengths_over_the_servers_context_are_refused_up_front(
    tmp_path: Path, codec: TokenizerCodec
) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 4000, "output_length": 96},
        {"timestamp": 1, "input_length": 4000, "output_length": 97},
    ])  # fmt: skip
    with pytest.raises(DatasetError) as caught:
        make_prompts(trace_config(path), codec, max_model_len=4096)
    assert str(caught.value) == (
        f"{path}:2: input length 4,000 and output length 97 exceed the server's max_model_len "
        "(4,096)"
    )


def test_a_missing_trace_file_says_so(tmp_path: Path, codec: TokenizerCodec) -> None:
    with pytest.raises(DatasetError, match=r"nowhere.jsonl: cannot read the trace"):
        make_prompts(trace_config(tmp_path / "nowhere.jsonl"), codec)


_CELL = st.one_of(
    st.integers(-5, 3000), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
    st.sampled_from([10**9, 2**64, 1e300, 1e15]),
    st.lists(st.integers(-2, 5), max_size=4), st.booleans(),
)  # fmt: skip
_LINE = st.one_of(
    st.fixed_dictionaries({}, optional={
        "timestamp": _CELL, "input_length": _CELL, "output_length": _CELL, "hash_ids": _CELL,
    }).map(json.dumps),
    st.text(max_size=20).filter(lambda text: "\n" not in text and "\r" not in text),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
)  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(lines=st.lists(_LINE, max_size=6))
def test_any_trace_file_is_either_refused_by_line_or_replayable(
    tmp_path: Path, lines: list[str]
) -> None:
    path = tmp_path / "any.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = trace_config(path, num_prompts=100)
    try:
        entries = read_trace(config)
    except DatasetError as error:
        assert str(error).startswith(str(path))
        assert "\n" not in str(error)
        return
    try:
        offsets = send_offsets(entries, config)
    except DatasetError as error:
        assert str(error).startswith(str(path)) and "\n" not in str(error)
        return
    # What is replayed is bounded: a day at most, and lengths a request may have.
    assert offsets == sorted(offsets) and offsets[0] == 0.0 and offsets[-1] <= MAX_REPLAY_S
    assert all(entry.input_len >= 1 and entry.output_len >= 1 for entry in entries)
    assert all(entry.input_len + entry.output_len <= MAX_REQUEST_TOKENS for entry in entries)


def test_the_shipped_trace_is_what_its_generator_makes() -> None:
    assert EXAMPLE_TRACE.read_text() == example_trace()


def test_trace_settings_are_checked_before_any_server_starts(tmp_path: Path) -> None:
    path = str(tmp_path / "t.jsonl")
    with pytest.raises(ValidationError, match="needs backend 'openai'"):
        trace_config(Path(path), backend="openai-chat")
    with pytest.raises(ValidationError, match="leave request_rate and ramp_up_"):
        trace_config(Path(path), request_rate=4)
    assert not trace_config(Path(path), request_rate=4, self_timed=False).is_self_timed
    with pytest.raises(ValidationError, match="only apply to dataset_name 'timed_trace'"):
        BenchmarkConfig(trace_speedup=2)
    with pytest.raises(ValidationError, match="not both"):
        trace_config(Path(path), trace_speedup=2, trace_target_rate=3)
    with pytest.raises(ValidationError, match="needs dataset_path"):
        BenchmarkConfig(dataset_name="timed_trace")
    with pytest.raises(ValidationError, match="self_timed: false"):
        CapacityConfig(kind="capacity", dataset_name="timed_trace", dataset_path=path,
                       slo={"p99_ttft_ms": 500})  # fmt: skip


def _prefix_counters(base_url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            if line.startswith(f"vllm:{name}"):
                values[name] = float(line.split()[-1])
    return values["prefix_cache_queries_total"], values["prefix_cache_hits_total"]


def test_the_simulators_prefix_cache_finds_what_the_trace_implies(sim_url: str) -> None:
    config = BenchmarkConfig(
        dataset_name="timed_trace", dataset_path=str(EXAMPLE_TRACE), num_prompts=120,
        timed_trace_sec_multiplier=0.001, trace_speedup=8,
    )  # fmt: skip
    implied = implied_prefix_hit_rate(window(read_trace(config), config), 16, 16)
    queries, hits = _prefix_counters(sim_url)
    outcome = run_bench(config, sim_url, "sim", tokenizer=str(MODEL_DIR))
    after_queries, after_hits = _prefix_counters(sim_url)
    assert outcome.result["completed"] == 120
    rate = (after_hits - hits) / (after_queries - queries)
    assert 0.2 < implied < 0.8  # the example shares a good part, not everything
    assert abs(rate - implied) < 0.05, (rate, implied)


def test_a_trace_left_without_num_prompts_is_replayed_whole(sim_url: str, tmp_path: Path) -> None:
    # 240 requests, 1 ms apart: vLLM's default count (1000) replays them all, not the first
    # 100 (the other datasets' default here).
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": ms, "input_length": 8, "output_length": 1} for ms in range(240)
    ])  # fmt: skip
    config = trace_config(path, timed_trace_sec_multiplier=0.001)
    assert config.num_prompts == 1000
    assert len(window(read_trace(config), config)) == 240
    assert BenchmarkConfig().num_prompts == 100  # the other datasets keep theirs
    outcome = run_bench(config, sim_url, "sim", tokenizer=str(MODEL_DIR))
    assert outcome.result["completed"] == 240
    assert outcome.result["num_prompts"] == 1000  # the count asked for, as vLLM's result


def test_requests_are_sent_at_the_traces_times(sim_url: str, tmp_path: Path) -> None:
    times = [0.0, 0.05, 0.3, 0.3, 0.32, 0.6]
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": 16, "output_length": 2} for t in times
    ])  # fmt: skip
    config = trace_config(path)
    codec = TokenizerCodec.load(str(MODEL_DIR))
    requests = make_prompts(config, codec)
    load = asyncio.run(run_load(load_settings(config, sim_url, "sim"), requests))
    sent = [outcome.dispatch_time - load.clock_start for outcome in load.outcomes]
    assert all(outcome.success for outcome in load.outcomes)
    assert load.intended_offsets == times
    assert all(0 <= actual - wanted < 0.05 for actual, wanted in zip(sent, times, strict=True))


def test_the_workload_renders_to_vllm_bench_serve_flags(tmp_path: Path) -> None:
    config = trace_config(
        tmp_path / "t.jsonl", timed_trace_chunk_hash_size=512, timed_trace_sec_multiplier=0.001,
        timed_trace_label_timestamp="ts", self_timed=True, num_prompts=7, trace_speedup=2,
    )  # fmt: skip
    argv = vllm_bench_serve_argv(config, base_url="http://127.0.0.1:1", model="m")
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--dataset-name"] == "timed_trace"
    assert pairs["--timed-trace-chunk-hash-size"] == "512"
    assert pairs["--timed-trace-sec-multiplier"] == "0.001"
    assert pairs["--timed-trace-label-timestamp"] == "ts"
    assert "--self-timed" in argv and "--trace-speedup" not in argv
    assert not [flag for flag in argv if flag.startswith("--conversation")]
    assert unrendered(config) == ["trace_speedup"]


def test_a_conversation_workload_has_no_vllm_bench_serve_form() -> None:
    config = BenchmarkConfig(dataset_name="conversation", backend="openai-chat")
    with pytest.raises(ValueError, match="vllm bench serve"):
        vllm_bench_serve_argv(config, base_url="http://127.0.0.1:1", model="m")


def test_the_trace_keys_leave_other_workloads_fingerprints_as_they_were(tmp_path: Path) -> None:
    """Baselines recorded before the trace keys existed still match a random workload; under
    dataset_name timed_trace they count."""
    from pytest_profllm.results.fingerprint import digest, fingerprint

    now = BenchmarkConfig().model_dump(mode="json")
    before = {
        k: v for k, v in now.items() if not k.startswith(("timed_trace_", "trace_", "self_timed"))
    }
    assert len(before) < len(now)

    def of(benchmark: dict[str, Any]) -> str:
        return digest(fingerprint({"config": {"server": {"model": "m"}, "benchmark": benchmark}}))

    assert of(now) == of(before)
    trace = trace_config(tmp_path / "t.jsonl").model_dump(mode="json")
    assert of(trace) != of({**trace, "trace_speedup": 2.0})
    assert of(trace) != of({**trace, "timed_trace_chunk_hash_size": 512})


@pytest.mark.parametrize(("value", "context"), [
    (4096, 4096), ("32K", 32768), ("25.6k", 25600), ("auto", None), (-1, None), (True, None),
    (None, None),
])  # fmt: skip
def test_a_case_bounds_a_traces_lengths_by_its_servers_max_model_len(
    value: Any, context: int | None
) -> None:
    from pytest_profllm.plan.case import Case
    from pytest_profllm.run.serve import context_of

    server = {"model": "m"} if value is None else {"model": "m", "max_model_len": value}
    case = Case("s", "s.yaml", "srv", "w", server, BenchmarkConfig(), {})
    assert context_of(case) == context


def test_a_two_request_trace_is_not_judged_by_its_timers_jitter(
    sim_url: str, tmp_path: Path
) -> None:
    """Two requests 1 ms apart: the second dispatched a fraction of a millisecond late made
    the achieved rate half the target, and the replay `client fell behind`.
    A client never later than the lag limit (here a wide 100 ms) kept its schedule."""
    from pytest_profllm.load.bench import measure
    from pytest_profllm.load.validity import LoadFacts, Rules, judge

    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": 16, "output_length": 2} for t in (0, 1)
    ])  # fmt: skip
    config = trace_config(path, timed_trace_sec_multiplier=0.001)
    codec = TokenizerCodec.load(str(MODEL_DIR))
    load = asyncio.run(run_load(load_settings(config, sim_url, "sim"), make_prompts(config, codec)))
    _, health = measure(load, config, codec)
    assert all(outcome.success for outcome in load.outcomes)
    assert health["max_schedule_lag_ms"] is not None and health["max_schedule_lag_ms"] < 100
    judged = judge(LoadFacts(load, config, health, {}), (None, None),
                   Rules(max_schedule_lag_ms=100))
    assert judged.reasons == []


# No max_model_len in the suite, so the trace's lengths are not refused up front (a suite's
# max_model_len bounds them before the load): the server, at the model's own 40,960, refuses.
TOO_LONG = """
server:
  model: Qwen/Qwen3-0.6B
benchmark:
  dataset_name: timed_trace
  dataset_path: {path}
  timed_trace_sec_multiplier: 0.001
"""


def test_a_trace_the_server_refuses_fails_for_that_first(
    pytester: pytest.Pytester, ports: str
) -> None:
    """Two of three requests ask for more output than the model's length: the server refuses
    them with a 400, fast. The case fails for that, leading with the server's message; no
    `client fell behind` and no measuring again."""
    from helpers import run_records, run_suites

    trace = write_trace(pytester.path / "t.jsonl", [
        {"timestamp": 0, "input_length": 64, "output_length": 50000},
        {"timestamp": 1, "input_length": 64, "output_length": 50000},
        {"timestamp": 2, "input_length": 64, "output_length": 8},
    ])  # fmt: skip
    (pytester.path / "bench_trace.yaml").write_text(TOO_LONG.format(path=trace))
    result = run_suites(pytester, ports, "--profllm-remeasure=2", timeout=120)
    (record,) = run_records(pytester)
    refused = "2 of 3 requests failed (2 got a non-200 status;"
    assert record["status"] == "failed"
    assert record["message"].startswith(refused)
    assert "maximum context length is 40960 tokens" in record["message"]
    assert record["validity_reasons"][0].startswith("2 of 3 requests failed: HTTP 400")
    assert "client fell behind" not in json.dumps(record)
    assert record["runtime"]["attempts"] == 1
    result.stdout.fnmatch_lines([f"*{refused}*"])


def test_a_case_that_failed_leads_with_its_failure_not_its_validity() -> None:
    """Where requests failed (the case raised) and the measurement was also invalid, the
    record's status and message are the failure's; the validity reasons follow it."""
    import time
    from types import SimpleNamespace

    from pytest_profllm.engine.choice import EngineChoice
    from pytest_profllm.plan.case import expand
    from pytest_profllm.plan.suite import validate_suite
    from pytest_profllm.run.outcome import CaseOutcome
    from pytest_profllm.session.worker import status_of

    (case,) = expand(validate_suite({"server": {"model": "m"}}, "test"), "bench_t.yaml")
    outcome = CaseOutcome(case, "n", "s", EngineChoice("sim", "test", None), "main", time.time())
    outcome.results = {"completed": 1, "failed": 2}
    outcome.invalid_reason = "client fell behind: p99 schedule lag 20 ms is over 10 ms"
    outcome.request_failures = "2 of 3 requests failed: HTTP 400 Bad Request: too long"
    outcome.error = "2 of 3 requests failed (2 got a non-200 status; none allowed)"
    crash = SimpleNamespace(message=outcome.error)
    report = SimpleNamespace(failed=True, skipped=False,
                             longrepr=SimpleNamespace(reprcrash=crash))
    assert status_of({"call": report}, outcome) == ("failed", outcome.error)
    record = outcome.record("failed", outcome.error)
    assert record["validity_reasons"] == [outcome.request_failures, outcome.invalid_reason]
    outcome.error = None  # measured, nothing raised, client fell behind: invalid
    assert status_of({"call": report}, outcome)[0] == "invalid"
