"""Multi-turn conversations as a workload (`dataset_name: conversation`): each turn sends its
history and the answers before it, a failed turn ends its conversation and its later turns
count as failed, the simulator's prefix cache finds the history (TTFT falls on later turns
with caching on, not with it off), bad conversation files are one line each, and the record,
the per-request rows and `request_samples` say each request's conversation and turn."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import json
import os
import random
import sqlite3
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import requests
from aiohttp import web
from helpers import run_records, run_suites, serve_handler, simulator, suite_error, write_suite
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.load import metrics
from pytest_profllm.load.bench import run_load
from pytest_profllm.load.conversation import (
    SHIPPED_FILE,
    Conversation,
    Conversations,
    Turn,
    by_turn,
    file_conversations,
    make_workload,
    shipped_text,
)
from pytest_profllm.load.dataset import DatasetError, TokenizerCodec, make_prompts
from pytest_profllm.load.schedule import LoadResult, LoadSettings
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results import gate_tables
from pytest_profllm.results.fingerprint import digest, fingerprint
from pytest_profllm.results.record import normalize
from pytest_profllm.sim.model_files import MODEL_DIR

REPO = Path(__file__).resolve().parent.parent


def _conversations(count: int, turns: int, output_len: int = 3) -> Conversations:
    return Conversations(
        [
            Conversation(
                tuple(Turn(f"c{c} t{t}", 2, output_len) for t in range(1, turns + 1))
            )
            for c in range(count)
        ]
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Recorder:
    """A chat server that answers each request with text naming it, after `delay_s`, and
    remembers what it received; `fail` names (conversation, turn) pairs answered with 500."""

    def __init__(self, delay_s: float = 0.0, fail: frozenset[tuple[int, int]] = frozenset()):
        self.delay_s = delay_s
        self.fail = fail
        self.received: dict[tuple[int, int], list[dict[str, str]]] = {}
        self.spans: dict[int, list[float]] = {}  # conversation: [first start, last end]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # The client names each request profllm-<conversation>-<turn>.
        _, conversation, turn = request.headers["x-request-id"].rsplit("-", 2)
        key = (int(conversation), int(turn))
        body = await request.json()
        self.received[key] = body["messages"]
        span = self.spans.setdefault(key[0], [time.perf_counter(), 0.0])
        if key in self.fail:
            return web.Response(status=500, text="no")
        await asyncio.sleep(self.delay_s)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = [f" answer-{key[0]}-{key[1]}", " more", " end"]
        for index, word in enumerate(words):
            finish = "length" if index == len(words) - 1 else None
            delta = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}]}
            await response.write(_sse(delta))
        usage = {"prompt_tokens": 5, "completion_tokens": len(words)}
        await response.write(_sse({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        span[1] = time.perf_counter()
        return response


def _run(recorder: Recorder, workload: Conversations, **options: Any) -> LoadResult:
    async def main() -> LoadResult:
        async with serve_handler(recorder.handle, "/v1/chat/completions") as url:
            load = LoadSettings(
                base_url=url, model="m", backend="openai-chat", request_timeout_s=5.0, **options
            )
            return await asyncio.wait_for(run_load(load, workload), timeout=30)

    return asyncio.run(main())


def test_each_turn_sends_the_history_and_the_answers_before_it() -> None:
    recorder = Recorder()
    result = _run(recorder, _conversations(3, 4))
    assert len(result.outcomes) == 12
    assert all(outcome.success for outcome in result.outcomes)
    for conversation in range(3):
        for turn in range(1, 5):
            messages = recorder.received[(conversation, turn)]
            before = recorder.received.get((conversation, turn - 1), [])
            answer = f" answer-{conversation}-{turn - 1} more end"
            expected = [*before, {"role": "assistant", "content": answer}] if before else []
            assert messages == [*expected, {"role": "user", "content": f"c{conversation} t{turn}"}]
    # Outcomes in conversation order, turns in order, each saying which it is.
    assert [(o.conversation, o.turn) for o in result.outcomes] == [
        (c, t) for c in range(3) for t in range(1, 5)
    ]
    # A later turn was due when the turn before it ended (no think time).
    for earlier, later in itertools.pairwise(result.outcomes):
        if later.conversation == earlier.conversation:
            assert later.intended_start == pytest.approx(earlier.end_time)
            assert later.schedule_lag < 0.5
    summary = by_turn(result.outcomes)
    assert summary is not None
    assert [row["turn"] for row in summary] == [1, 2, 3, 4]
    assert all(row["requests"] == row["completed"] == 3 for row in summary)
    # This server does not say how many prompt tokens it found cached: no rate is made up.
    assert all(row["prefix_cache_hit_rate"] is None for row in summary)
    assert all(o.cached_tokens is None for o in result.outcomes)


def test_max_concurrency_bounds_the_conversations_in_flight() -> None:
    recorder = Recorder(delay_s=0.02)
    _run(recorder, _conversations(6, 3), max_concurrency=2)
    spans = sorted(recorder.spans.values())
    most = max(sum(1 for s in spans if s[0] <= start < s[1]) for start, _ in spans)
    assert most <= 2


def test_think_times_space_the_turns() -> None:
    workload = Conversations(
        [Conversation((Turn("a", 1, 3), Turn("b", 1, 3, think_s=0.2), Turn("c", 1, 3, 0.2)))]
    )
    outcomes = _run(Recorder(), workload).outcomes
    for before, after in itertools.pairwise(outcomes):
        assert after.intended_start == pytest.approx(before.end_time + 0.2)
        assert after.start_time >= before.end_time + 0.2


def test_a_failed_turn_ends_its_conversation_and_every_turn_is_accounted_for() -> None:
    recorder = Recorder(fail=frozenset({(1, 2)}))
    outcomes = _run(recorder, _conversations(3, 4)).outcomes
    assert len(outcomes) == 12  # every turn planned
    assert (1, 3) not in recorder.received and (1, 4) not in recorder.received
    by_key = {(o.conversation, o.turn): o for o in outcomes}
    assert by_key[(1, 2)].status == 500 and not by_key[(1, 2)].success
    for turn in (3, 4):
        unsent = by_key[(1, turn)]
        assert not unsent.sent and not unsent.success
        assert unsent.error == "not sent: turn 2 of conversation 1 failed"
    results = metrics.compute(outcomes, 1.0)
    assert (results["completed"], results["failed"]) == (9, 3)
    problem = metrics.served_problem(outcomes, results)
    assert problem is not None
    assert problem.startswith(
        "3 of 12 requests failed (1 got a non-200 status; 2 were not sent (an earlier turn of "
        "their conversation failed); none allowed"
    )
    summary = by_turn(outcomes)
    assert summary is not None
    assert [(row["requests"], row["completed"]) for row in summary] == [
        (3, 3), (3, 2), (3, 2), (3, 2)
    ]


def _simulator(
    port_range: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[str]:
    """A simulated engine on 127.0.0.1 with `args` (and `env`, where given); stopped and reaped
    whatever happens."""
    first = int(port_range.split("-")[0]) + 60 + 10 * len(args)
    return simulator(first, tmp_path / f"sim{len(args)}.log", "sim", *args, env=env)


def _long_history(codec: TokenizerCodec, count: int, seed: int) -> Conversations:
    """Conversations whose first message is long and later ones short: prefill of the
    history dominates a later turn's TTFT unless the prefix cache holds it."""
    rng = random.Random(seed)

    def text(length: int) -> str:
        return codec.decode([rng.randrange(3, codec.vocab_size) for _ in range(length)])

    return Conversations(
        [
            Conversation(tuple(Turn(text(3000 if t == 0 else 10), 0, 2) for t in range(4)))
            for _ in range(count)
        ]
    )


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_ttft_falls_on_later_turns_only_with_prefix_caching(
    caching: bool, port_range: str, tmp_path: Path
) -> None:
    codec = TokenizerCodec.load(str(MODEL_DIR))
    details = "--enable-prompt-tokens-details"  # so usage says what the cache found
    flags = (details,) if caching else (details, "--no-enable-prefix-caching")
    # Slower steps, so that what a busy host adds to every TTFT cannot hide the fall, or fake
    # one: with a core kept busy it added up to 200 ms (at -n 4: 259 ms against 420 once,
    # three times slower). Ten times slower, the first turn's 3000-token prefill takes about
    # 1.3 s. Without the cache every turn prefills the history again, and three times slower
    # (0.4 s) holds its bound: the host adds about as much to each turn.
    slow = {**os.environ, "PROFLLM_SIM_SLOWDOWN": "10" if caching else "3"}
    with _simulator(port_range, tmp_path, *flags, env=slow) as url:
        load = LoadSettings(base_url=url, model="sim", backend="openai-chat", max_concurrency=1)
        result = asyncio.run(run_load(load, _long_history(codec, 3, seed=int(caching))))
    assert all(outcome.success for outcome in result.outcomes)
    summary = by_turn(result.outcomes)
    assert summary is not None
    first, last = summary[0], summary[-1]
    # The history grows by each answer and message: the server counted it.
    assert last["mean_prompt_tokens"] > first["mean_prompt_tokens"] > 3000
    if caching:
        assert first["prefix_cache_hit_rate"] == 0.0
        assert last["prefix_cache_hit_rate"] > 0.95
        assert last["median_ttft_ms"] < 0.5 * first["median_ttft_ms"]
    else:
        assert [row["prefix_cache_hit_rate"] for row in summary] == [0.0] * 4
        # Not the fall the cache gives (under half): the whole history is prefilled again.
        # The margin is the host's: real-time TTFTs of one conversation's turns on a busy
        # 2-core host differed by a fifth (144 against 181 ms).
        assert last["median_ttft_ms"] > 0.6 * first["median_ttft_ms"]


def test_the_simulator_renders_a_conversation_so_its_history_is_a_prefix(
    sim_url: str,
) -> None:
    """Turn k+1's prompt starts with turn k's (with its answer): cached tokens say so."""
    workload = Conversations([Conversation(tuple(Turn("ba " * 40, 40, 4) for _ in range(3)))])
    load = LoadSettings(base_url=sim_url, model="sim", backend="openai-chat")
    outcomes = asyncio.run(run_load(load, workload)).outcomes
    assert [o.success for o in outcomes] == [True] * 3
    assert outcomes[0].cached_tokens == 0
    # The turn before's whole 16-token blocks are found (its last, partial block never was
    # cached): all of its prompt that the cache can hold.
    for before, after in itertools.pairwise(outcomes):
        assert after.cached_tokens == before.prompt_len // 16 * 16


def test_the_simulator_says_what_it_cached_only_when_asked_as_vllm_does(
    port_range: str, tmp_path: Path
) -> None:
    """Without --enable-prompt-tokens-details vLLM's usage has no prompt_tokens_details:
    the simulator's neither, so no hit rate is reported that vLLM would not report."""
    workload = Conversations([Conversation(tuple(Turn("ba " * 40, 40, 4) for _ in range(2)))])
    with _simulator(port_range, tmp_path) as url:
        load = LoadSettings(base_url=url, model="sim", backend="openai-chat")
        outcomes = asyncio.run(run_load(load, workload)).outcomes
        whole = requests.post(
            url + "/v1/completions", json={"model": "sim", "prompt": "ba ba", "max_tokens": 2},
            timeout=30,
        ).json()
    assert [o.success for o in outcomes] == [True, True]
    assert [o.cached_tokens for o in outcomes] == [None, None]
    summary = by_turn(outcomes)
    assert summary is not None
    assert [row["prefix_cache_hit_rate"] for row in summary] == [None, None]
    assert whole["usage"]["prompt_tokens_details"] is None


def _config(**values: Any) -> BenchmarkConfig:
    return BenchmarkConfig.model_validate(
        {"backend": "openai-chat", "dataset_name": "conversation", **values}
    )


def test_synthetic_conversations_have_their_lengths_and_think_times() -> None:
    codec = TokenizerCodec.load(str(MODEL_DIR))
    config = _config(
        num_prompts=5, conversation_turns=3, conversation_input_len=20,
        conversation_output_len=7, conversation_think_time_s=0.5,
        conversation_think_time_distribution="fixed",
    )
    workload = make_workload(config, codec)
    assert isinstance(workload, Conversations)
    assert len(workload) == 5 and workload.requests == 15
    for session in workload.sessions:
        assert [turn.think_s for turn in session.turns] == [0.0, 0.5, 0.5]
        for turn in session.turns:
            assert turn.user_len == len(codec.encode(turn.user)) == 20
            assert turn.output_len == 7
    # Seeded: the same workload again; another seed, another.
    assert make_workload(config, codec) == workload
    assert make_workload(config.model_copy(update={"seed": 1}), codec) != workload
    uniform = make_workload(
        config.model_copy(update={"conversation_think_time_distribution": "uniform"}), codec
    )
    assert isinstance(uniform, Conversations)
    thinks = [turn.think_s for s in uniform.sessions for turn in s.turns[1:]]
    assert all(0 <= think <= 1.0 for think in thinks) and len(set(thinks)) == len(thinks)
    with pytest.raises(DatasetError, match="makes conversations, not prompts"):
        make_prompts(config, codec)


def test_the_shipped_file_is_what_its_generator_makes_and_is_installed() -> None:
    assert SHIPPED_FILE.read_text(encoding="utf-8") == shipped_text()
    data = json.loads(SHIPPED_FILE.read_text())
    assert len(data) == 20
    assert all(3 <= len(entry["conversations"]) // 2 <= 6 for entry in data)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "load/data/*.json" in project["tool"]["setuptools"]["package-data"]["pytest_profllm"]
    codec = TokenizerCodec.load(str(MODEL_DIR))
    config = _config(num_prompts=20, dataset_path=str(SHIPPED_FILE))
    workload = make_workload(config, codec)
    assert isinstance(workload, Conversations)
    turns = sorted(len(session.turns) for session in workload.sessions)
    assert turns[0] >= 3 and turns[-1] <= 6
    # Every word is one the simulator's tokenizer knows (none is <unk>, id 0).
    assert all(0 not in codec.encode(turn.user) for s in workload.sessions for turn in s.turns)
    # A fixed output length replaces the answers' lengths.
    fixed = make_workload(config.model_copy(update={"sharegpt_output_len": 5}), codec)
    assert isinstance(fixed, Conversations)
    assert {turn.output_len for s in fixed.sessions for turn in s.turns} == {5}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not JSON"),
        ('{"conversations": []}', "a ShareGPT file is a JSON list of conversations"),
        ('[{"id": 1}]', "conversation 0: needs a 'conversations' list of messages"),
        (
            '[{"conversations": [{"from": "human", "value": "a"}]}, {"conversations": 3}]',
            "conversation 1: needs a 'conversations' list of messages",
        ),
        (
            '[{"conversations": [{"from": "human", "value": 7}]}]',
            "conversation 0, message 0: needs string 'from' and 'value'",
        ),
        (
            '[{"conversations": [{"from": "human", "value": "a"}, "hello"]}]',
            "conversation 0, message 1: needs string 'from' and 'value'",
        ),
        (
            '[{"conversations": [{"from": "human", "value": "a"}, '
            '{"from": "gpt", "value": "b", "output_tokens": -4}]}]',
            "conversation 0, message 1: output_tokens must be a positive integer, not -4",
        ),
        (
            '[{"conversations": [{"from": "human", "value": "a"}, '
            '{"from": "gpt", "value": "b", "output_tokens": 1000000000000}]}]',
            "conversation 0, message 1: output_tokens 1,000,000,000,000 is more than the "
            "10,485,760 tokens a request may have",
        ),
        # Deeper than limits.py allows: one line, once a RecursionError.
        ("[" * 100_000 + "]" * 100_000, "nests JSON deeper than 64 levels"),
        ('[{"conversations": [{"from": "gpt", "value": "b"}]}]', "no conversation with a user"),
        (
            '[{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}]',
            "1 usable conversations, fewer than num_prompts (2)",
        ),
    ],
)
def test_a_bad_conversation_file_is_one_line_naming_it(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "talks.json"
    path.write_text(content)
    with pytest.raises(DatasetError) as error:
        file_conversations(_config(num_prompts=2, dataset_path=str(path)), _WordCodec())
    message = str(error.value)
    assert message.startswith(f"{path}") and "\n" not in message
    assert problem in message


class _WordCodec:
    """A codec of whitespace-separated words: one token per word."""

    def __init__(self) -> None:
        self.special_ids: set[int] = set()
        self.vocab_size = 1000
        self.num_special_tokens_to_add = 0

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("w" * max(i, 1) for i in ids)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.text(max_size=6), st.floats(allow_nan=False),
    st.sampled_from([10**12, 2**64]),
)
_MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"from": st.sampled_from(["human", "gpt", "user", "assistant", "system"]),
         "value": st.text(max_size=20)},
        optional={"output_tokens": _SCALARS},
    ),
    st.dictionaries(st.sampled_from(["from", "value"]), _SCALARS, max_size=2),
    _SCALARS,
)
_ENTRY = st.one_of(
    st.fixed_dictionaries({"conversations": st.lists(_MESSAGE, max_size=8)}),
    st.dictionaries(st.sampled_from(["conversations", "id"]), _SCALARS, max_size=2),
    _SCALARS,
)


@settings(max_examples=150, deadline=None)
@given(data=st.one_of(st.lists(_ENTRY, max_size=6), _SCALARS), num=st.integers(1, 4),
       nest=st.one_of(st.none(), st.integers(1, 3000)))
def test_any_conversation_file_gives_turns_or_one_clean_error(
    tmp_path_factory: pytest.TempPathFactory, data: object, num: int, nest: int | None
) -> None:
    path = tmp_path_factory.mktemp("files") / "talks.json"
    text = json.dumps(data)
    # Wrapped in lists so many levels deep (past orjson's own limit of 1,024).
    path.write_text(text if nest is None else "[" * nest + text + "]" * nest)
    config = _config(num_prompts=num, dataset_path=str(path))
    try:
        sessions = file_conversations(config, _WordCodec())
    except DatasetError as error:
        assert str(error).startswith(f"{path}") and "\n" not in str(error)
        return
    assert len(sessions) == num
    for turns in sessions:
        assert turns
        for text, user_len, output_len in turns:
            assert isinstance(text, str) and user_len >= 0 and 1 <= output_len <= 10 << 20


def test_a_suite_refuses_conversation_on_the_completions_backend(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """
        server: {model: Qwen/Qwen3-0.6B}
        benchmark:
          dataset_name: conversation
          num_prompts: 4
        """,
    )
    message = suite_error(path)
    assert str(path) in message
    assert "dataset_name 'conversation' sends each turn's history as chat messages" in message
    assert "it needs backend: openai-chat" in message


def test_a_capacity_case_refuses_conversation(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """
        server: {model: Qwen/Qwen3-0.6B}
        benchmark:
          kind: capacity
          backend: openai-chat
          dataset_name: conversation
          slo: {median_ttft_ms: 200}
        """,
    )
    assert "a capacity case cannot run dataset_name 'conversation' yet" in suite_error(path)


def test_an_older_request_samples_table_gains_the_conversation_columns(tmp_path: Path) -> None:
    path = tmp_path / "results.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE request_samples (run_id TEXT, request_index INTEGER, success INTEGER, "
            "output_tokens INTEGER, ttft_ms REAL, tpot_ms REAL, e2el_ms REAL, itl_ms TEXT, "
            "PRIMARY KEY (run_id, request_index))"
        )
        db.execute("INSERT INTO request_samples VALUES ('old', 0, 1, 3, 1.0, 1.0, 2.0, '[]')")
    requests = [
        {"index": 0, "success": True, "output_tokens": 3, "ttft_s": 0.1, "latency_s": 0.2,
         "itl_s": [0.05], "conversation": 2, "turn": 3, "cached_tokens": 48},
    ]
    rows = gate_tables.GateRows(
        "new", ("new", *[None] * 12), gate_tables.sample_rows("new", requests), [], ("f", "{}")
    )
    with gate_tables.writing(path) as db:
        gate_tables.write(db, [rows])
    with sqlite3.connect(path) as db:
        found = db.execute(
            "SELECT run_id, conversation, turn, cached_tokens FROM request_samples ORDER BY run_id"
        ).fetchall()
    assert found == [("new", 2, 3, 48), ("old", None, None, None)]


def test_a_conversation_suite_records_its_turns(pytester: pytest.Pytester, ports: str) -> None:
    (pytester.path / "bench_conversation.yaml").write_text(
        (REPO / "benchmarks" / "bench_conversation.yaml").read_text()
    )
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    normalize(record)  # the record validates against its model
    assert record["results"]["completed"] == 32 and record["results"]["failed"] == 0
    turns = record["by_turn"]
    assert [row["turn"] for row in turns] == [1, 2, 3, 4]
    assert all(row["requests"] == row["completed"] == 8 for row in turns)
    assert turns[0]["prefix_cache_hit_rate"] == 0.0
    # Each later turn finds its history: more of its prompt, turn after turn.
    rates = [row["prefix_cache_hit_rate"] for row in turns]
    assert rates[1] > 0.3 and rates == sorted(rates)
    folder = pytester.path / "results"
    with gzip.open(next(folder.glob("*.requests.jsonl.gz")), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert sorted((row["conversation"], row["turn"]) for row in rows) == [
        (c, t) for c in range(8) for t in range(1, 5)
    ]
    assert all(row["cached_tokens"] is not None for row in rows)
    with sqlite3.connect(folder / "results.db") as db:
        by_turn_sql = db.execute(
            "SELECT turn, count(*), sum(cached_tokens) > 0 FROM request_samples "
            "GROUP BY turn ORDER BY turn"
        ).fetchall()
    assert by_turn_sql == [(1, 8, 0), (2, 8, 1), (3, 8, 1), (4, 8, 1)]


def test_the_conversation_keys_leave_other_workloads_fingerprints_as_they_were() -> None:
    """Baselines recorded before the conversation keys existed still match a random workload;
    under dataset_name conversation the keys count."""
    now = BenchmarkConfig().model_dump(mode="json")
    before = {k: v for k, v in now.items() if not k.startswith("conversation_")}

    def of(benchmark: dict[str, Any]) -> str:
        return digest(fingerprint({"config": {"server": {"model": "m"}, "benchmark": benchmark}}))

    assert of(now) == of(before)
    talk = _config().model_dump(mode="json")
    assert of(talk) != of({**talk, "conversation_turns": 9})
