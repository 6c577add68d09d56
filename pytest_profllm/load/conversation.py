"""Multi-turn conversations as a workload (`dataset_name: conversation`): sessions of turns on
the chat endpoint, each turn sending the whole history so far plus a new user message.

A conversation starts on vLLM's arrival schedule (`request_rate` is conversations per second)
and holds one of `max_concurrency` slots until its last turn ends. Its first turn is sent at
the conversation's arrival; each later turn after the previous answer ended plus a think time
drawn from the suite's distribution. The answer that comes back (the text the client
received) is the next turn's assistant message. Every turn is one request with vLLM's metric
definitions; its `intended_start` is when it was due (arrival, or the previous end plus the
think time), so the schedule lag stays the client's own lateness.

A failed turn ends its conversation: the turns after it are not sent, and each counts as a
failed request (`sent` False), so completed + failed is always every turn planned.

Turns come from a ShareGPT-format JSON file (`dataset_path`: human messages are the user
turns, the next gpt message's token length the answer's length unless `sharegpt_output_len`
fixes it), or are synthetic: `conversation_turns` turns of `conversation_input_len` tokens
answered with `conversation_output_len` tokens, both drawn within +-`conversation_range_ratio`,
from the tokenizer's vocabulary as vLLM's random dataset draws (seeded by `seed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_profllm.limits import MAX_REQUEST_TOKENS
from pytest_profllm.load import client_watch, request_observer
from pytest_profllm.load.client import (
    ENDPOINTS,
    _client,
    _encode,
    request_payload,
    run_warmups,
    sleep_until,
    stream_request,
)
from pytest_profllm.load.dataset import (
    Codec,
    DatasetError,
    PromptRequest,
    _decode_to_length,
    make_prompts,
)
from pytest_profllm.load.dataset_files import dataset_json
from pytest_profllm.load.lora_mix import assign_models
from pytest_profllm.load.metrics import RequestOutcome, grouped
from pytest_profllm.load.schedule import (
    LoadResult,
    LoadSettings,
    client_cores,
    load_offsets,
)

if TYPE_CHECKING:
    from pytest_profllm.plan.suite import BenchmarkConfig

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant")
# The conversation file shipped with the package (made by `shipped_conversations`).
SHIPPED_FILE = Path(__file__).parent / "data" / "conversations.json"


@dataclass(frozen=True)
class Turn:
    user: str  # the new user message
    user_len: int  # its tokens
    output_len: int  # the answer's tokens asked for (max_completion_tokens)
    think_s: float = 0.0  # the pause after the previous answer (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    # The model all its turns ask for, where a LoRA mix names one (load/lora_mix.py).
    model: str | None = None


@dataclass(frozen=True)
class Conversations:
    """A conversation workload: `run_load` runs it with `run_conversations`."""

    sessions: list[Conversation]

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def requests(self) -> int:
        return sum(len(session.turns) for session in self.sessions)

    def first(self, count: int) -> Conversations:
        return Conversations(self.sessions[:count])


Workload = list[PromptRequest] | Conversations


def make_workload(
    config: BenchmarkConfig, codec: Codec, max_model_len: int | None = None
) -> Workload:
    """The suite's workload: conversations for `dataset_name: conversation`, else prompts.
    `max_model_len`, the server's context where known, bounds a trace's lengths."""
    if config.dataset_name != "conversation":
        return make_prompts(config, codec, max_model_len)
    if config.dataset_path:
        sessions = file_conversations(config, codec)
    else:
        sessions = synthetic_conversations(config, codec)
    conversations = _with_think_times(sessions, config)
    if config.lora_mix:  # one user talks to one adapter: the model is the conversation's
        models = assign_models(
            len(conversations), config.lora_mix, config.lora_assignment, config.seed
        )
        conversations = [
            dataclasses.replace(conversation, model=model)
            for conversation, model in zip(conversations, models, strict=True)
        ]
    return Conversations(conversations)


def _with_think_times(
    sessions: list[list[tuple[str, int, int]]], config: BenchmarkConfig
) -> list[Conversation]:
    rng = np.random.default_rng(config.seed + 1)  # apart from the lengths' draws
    mean = config.conversation_think_time_s
    result = []
    for turns in sessions:
        built = []
        for index, (text, user_len, output_len) in enumerate(turns):
            think = 0.0 if index == 0 else think_time(rng, mean, config)
            built.append(Turn(text, user_len, output_len, think))
        result.append(Conversation(tuple(built)))
    return result


def think_time(rng: np.random.Generator, mean: float, config: BenchmarkConfig) -> float:
    if mean == 0 or config.conversation_think_time_distribution == "fixed":
        return mean
    if config.conversation_think_time_distribution == "uniform":
        return float(rng.uniform(0.0, 2.0 * mean))
    return float(rng.exponential(mean))


def _lengths(rng: np.random.Generator, mean: int, ratio: float, count: int) -> list[int]:
    low = max(int(np.floor(mean * (1 - ratio))), 1)
    high = max(int(np.ceil(mean * (1 + ratio))), 1)
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def synthetic_conversations(
    config: BenchmarkConfig, codec: Codec
) -> list[list[tuple[str, int, int]]]:
    """`num_prompts` conversations of `conversation_turns` turns: user messages of random
    tokens decoded to text of exactly their length, as vLLM's random dataset makes prompts."""
    rng = np.random.default_rng(config.seed)
    allowed = np.array(sorted(set(range(codec.vocab_size)) - codec.special_ids))
    turns = config.conversation_turns
    sessions = []
    for _ in range(config.num_prompts):
        ratio = config.conversation_range_ratio
        inputs = _lengths(rng, config.conversation_input_len, ratio, turns)
        outputs = _lengths(rng, config.conversation_output_len, ratio, turns)
        session = []
        for length, output_len in zip(inputs, outputs, strict=True):
            tokens = allowed[rng.integers(0, len(allowed), size=length)].tolist()
            text, text_len = _decode_to_length(codec, tokens, length, rng)
            session.append((text, text_len, output_len))
        sessions.append(session)
    return sessions


def read_conversation_file(path: Path) -> list[list[tuple[str, str, int | None]]]:
    """A ShareGPT JSON file's conversations as (role, text, output_tokens) messages, roles
    folded to `user` and `assistant` (others, such as `system`, are left out). Raises
    DatasetError with one line naming the file, and the conversation and message, when the
    file is not a JSON list of {"conversations": [{"from": str, "value": str}, ...]}."""
    try:
        content = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"{path}: cannot read: {error.strerror or error}") from None
    data = dataset_json(content, str(path))
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of conversations")
    conversations = []
    for number, entry in enumerate(data):
        where = f"{path}: conversation {number}"
        messages = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(messages, list):
            raise DatasetError(f"{where}: needs a 'conversations' list of messages")
        found: list[tuple[str, str, int | None]] = []
        for place, message in enumerate(messages):
            role = message.get("from") if isinstance(message, dict) else None
            text = message.get("value") if isinstance(message, dict) else None
            if not isinstance(role, str) or not isinstance(text, str):
                raise DatasetError(f"{where}, message {place}: needs string 'from' and 'value'")
            assert isinstance(message, dict)
            tokens = message.get("output_tokens")
            if tokens is not None and (
                not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1
            ):
                raise DatasetError(
                    f"{where}, message {place}: output_tokens must be a positive integer, "
                    f"not {tokens!r}"
                )
            if tokens is not None and tokens > MAX_REQUEST_TOKENS:
                raise DatasetError(
                    f"{where}, message {place}: output_tokens {tokens:,} is more than the "
                    f"{MAX_REQUEST_TOKENS:,} tokens a request may have"
                )
            if role in USER_ROLES:
                found.append(("user", text, None))
            elif role in ASSISTANT_ROLES:
                found.append(("assistant", text, tokens))
        conversations.append(found)
    return conversations


def file_conversations(
    config: BenchmarkConfig, codec: Codec
) -> list[list[tuple[str, int, int]]]:
    """`num_prompts` conversations of the file, shuffled with `seed`. A user message is a turn;
    the assistant message after it gives its answer's length (its `output_tokens`, else its
    text's tokens), unless `sharegpt_output_len` fixes it. A conversation ends at a user
    message with no answer after it (unless the length is fixed)."""
    path = Path(str(config.dataset_path))
    fixed = config.sharegpt_output_len
    sessions = []
    for messages in read_conversation_file(path):
        turns = []
        for index, (role, text, _) in enumerate(messages):
            if role != "user":
                continue
            answer = messages[index + 1] if index + 1 < len(messages) else None
            if fixed is not None:
                output_len = fixed
            elif answer is not None and answer[0] == "assistant":
                output_len = answer[2] or max(len(codec.encode(answer[1])), 1)
            else:
                break
            turns.append((text, len(codec.encode(text)), output_len))
        if turns:
            sessions.append(turns)
    if not sessions:
        raise DatasetError(f"{path}: no conversation with a user turn and its answer")
    if len(sessions) < config.num_prompts:
        # Not drawn again: a repeated conversation would find itself in the prefix cache.
        raise DatasetError(
            f"{path}: {len(sessions)} usable conversations, fewer than num_prompts "
            f"({config.num_prompts})"
        )
    random.Random(config.seed).shuffle(sessions)
    return sessions[: config.num_prompts]


async def run_conversations(settings: LoadSettings, workload: Conversations) -> LoadResult:
    """Run every conversation, starting them on vLLM's arrival schedule, at most
    `max_concurrency` at once; the outcomes are in conversation order, turns in order."""
    sessions = workload.sessions
    offsets = load_offsets(settings, len(sessions))
    if settings.num_warmups and sessions:
        first = sessions[0].turns[0]
        await run_warmups(settings, PromptRequest(first.user, first.user_len, first.output_len))
    limit = settings.max_concurrency
    slots: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    )
    client = _client(settings, limit)
    path = settings.endpoint or ENDPOINTS[settings.backend]
    # Every turn a request; no target rate (the schedule is of conversations).
    observer = request_observer.for_load(sum(len(s.turns) for s in sessions), math.inf)
    started_at = time.time()
    cpu_start = time.thread_time()
    start = time.perf_counter()

    async def converse(number: int, session: Conversation, due: float) -> list[RequestOutcome]:
        await sleep_until(due)
        dispatched = time.perf_counter()
        outcomes: list[RequestOutcome] = []
        async with slots:
            messages: list[dict[str, str]] = []
            history_len = 0
            for index, turn in enumerate(session.turns):
                if index:
                    due = outcomes[-1].end_time + turn.think_s
                    await sleep_until(due)
                    dispatched = time.perf_counter()
                messages.append({"role": "user", "content": turn.user})
                history_len += turn.user_len
                outcome = RequestOutcome(
                    prompt_len=history_len,
                    intended_start=due,
                    dispatch_time=dispatched,
                    output_len=turn.output_len,
                    conversation=number,
                    turn=index + 1,
                )
                outcome.model = session.model
                payload = request_payload(
                    settings,
                    PromptRequest(
                        turn.user, turn.user_len, turn.output_len, model=session.model
                    ),
                )
                payload["messages"] = messages
                request_id = f"{settings.request_id_prefix}{number}-{index + 1}"
                observer.sent(outcome)
                try:
                    await stream_request(
                        client, path, _encode(payload), outcome, settings, request_id
                    )
                finally:
                    observer.done(outcome)
                outcomes.append(outcome)
                if not outcome.success:
                    lost = _not_sent(session, number, index + 1, outcome.end_time)
                    for never in lost:
                        never.model = session.model
                    for never in lost:  # the turns it never sent fail with it
                        observer.lost(never)
                    outcomes += lost
                    break
                messages.append({"role": "assistant", "content": outcome.generated_text})
                history_len += outcome.output_tokens or turn.output_len
        return outcomes

    try:
        async with client_watch.watching() as watch:
            tasks = [
                asyncio.create_task(converse(number, session, start + offset))
                for number, (session, offset) in enumerate(zip(sessions, offsets, strict=True))
            ]
            outcomes = [outcome for done in await asyncio.gather(*tasks) for outcome in done]
    finally:
        client.close()
    duration = time.perf_counter() - start
    cpu_seconds = time.thread_time() - cpu_start
    intended = [outcome.intended_start - start for outcome in outcomes]
    return LoadResult(
        outcomes, duration, started_at, start, cpu_seconds=cpu_seconds, intended_offsets=intended,
        watch=watch, cores=client_cores(),
    )


def _not_sent(
    session: Conversation, number: int, failed_turn: int, when: float
) -> list[RequestOutcome]:
    """The turns after a failed one: never sent, each a failed request that says why."""
    return [
        RequestOutcome(
            prompt_len=0,
            intended_start=when,
            dispatch_time=when,
            start_time=when,
            output_len=turn.output_len,
            error=f"not sent: turn {failed_turn} of conversation {number} failed",
            conversation=number,
            turn=number_ + 1,
            sent=False,
        )
        for number_, turn in enumerate(session.turns)
        if number_ + 1 > failed_turn
    ]


def by_turn(outcomes: list[RequestOutcome]) -> list[dict[str, Any]] | None:
    """Per turn of a conversation workload (None for single requests): its requests, how many
    completed, their median and p99 TTFT in ms, and the prefix-cache hit rate (prompt tokens
    the server found cached over all prompt tokens, of the completed requests; None where the
    server did not say how many it found)."""
    turns = grouped(outcomes, lambda outcome: outcome.turn)
    if not turns:
        return None
    summary = []
    for turn, group in sorted(turns.items()):
        done = [outcome for outcome in group if outcome.success]
        ttfts = [outcome.ttft * 1000 for outcome in done]
        cached = [outcome.cached_tokens for outcome in done]
        prompt = sum(outcome.prompt_len for outcome in done)
        rate = None
        if done and None not in cached and prompt > 0:
            rate = sum(c or 0 for c in cached) / prompt
        summary.append(
            {
                "turn": turn,
                "requests": len(group),
                "completed": len(done),
                "median_ttft_ms": float(np.median(ttfts)) if ttfts else None,
                "p99_ttft_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
                "mean_prompt_tokens": prompt / len(done) if done else None,
                "prefix_cache_hit_rate": rate,
            }
        )
    return summary


# The shipped file: made here, never copied from anyone's conversations. Its made-up words
# (one or two consonant-vowel syllables, lower case, no punctuation) are all words of the
# simulator's tokenizer (sim/model_files.py), so every conversation is its own token sequence
# to the simulator's prefix cache, not a run of unknown tokens.
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstv" for v in "aeiou")


def shipped_conversations(count: int = 20, seed: int = 7) -> list[dict[str, Any]]:
    """A small ShareGPT-format file of `count` conversations of 3 to 6 turns, words from a
    fixed vocabulary of made-up words, seeded: the same list on every machine."""
    picker = random.Random(seed)
    vocabulary = sorted({_word(picker) for _ in range(400)})

    def sentence(low: int, high: int) -> str:
        return " ".join(picker.choice(vocabulary) for _ in range(picker.randint(low, high)))

    data = []
    for number in range(count):
        messages = []
        for _ in range(picker.randint(3, 6)):
            messages.append({"from": "human", "value": sentence(8, 40)})
            messages.append({"from": "gpt", "value": sentence(10, 60)})
        data.append({"id": f"profllm-conversation-{number:03d}", "conversations": messages})
    return data


def _word(picker: random.Random) -> str:
    return "".join(picker.choice(_SYLLABLES) for _ in range(picker.randint(1, 2)))


def shipped_text() -> str:
    """The shipped file's exact content (a test checks the file is this)."""
    return json.dumps(shipped_conversations(), indent=1) + "\n"


def write_shipped_file(path: Path = SHIPPED_FILE) -> None:
    """Regenerate the shipped file: python -c 'from pytest_profllm.load.conversation import
    write_shipped_file; write_shipped_file()'."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(shipped_text(), encoding="utf-8")
