"""Every load loop tells its one request observer of each request exactly once: `sent` then
`done` for a request it sent, `lost` alone for one it never sent, so at a load's end sent ==
done and done + lost is every request planned. Shown for a plain load, a conversation load
with a failed turn, and a load over two client processes (through the Prometheus counters
they write), against in-process servers."""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import serve_handler
from prometheus_client.multiprocess import MultiProcessCollector

from pytest_profllm.load import live_status, prometheus_counters, request_observer
from pytest_profllm.load.bench import run_load
from pytest_profllm.load.conversation import Conversation, Conversations, Turn
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult, LoadSettings

Events = list[tuple[str, RequestOutcome]]


def _sse(event: object) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _server(failing: set[str], chat: bool = False) -> Any:
    """A handler that streams two tokens, or answers HTTP 500 to the request ids in
    `failing`."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.headers.get("x-request-id") in failing:
            return web.Response(status=500, text="made to fail")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text, end in (("a", None), ("b", "stop")):
            choice: dict[str, Any] = {"index": 0, "finish_reason": end}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            await response.write(_sse({"choices": [choice]}))
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        await response.write(_sse({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    return handler


def _run(
    handler: Any, workload: list[PromptRequest] | Conversations, chat: bool = False,
    **overrides: Any,
) -> LoadResult:
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def main() -> LoadResult:
        async with serve_handler(handler, path) as url:
            settings = LoadSettings(
                base_url=url, model="sim", request_timeout_s=5.0,
                backend="openai-chat" if chat else "openai", **overrides,
            )
            return await asyncio.wait_for(run_load(settings, workload), timeout=60)

    return asyncio.run(main())


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[Events]:
    """What a listener beside the others hears, in order; the session's own listeners off."""
    monkeypatch.delenv(prometheus_counters.DIR_ENV, raising=False)
    monkeypatch.delenv(live_status.DIR_ENV, raising=False)
    heard: Events = []

    class Tally:
        def sent(self, outcome: RequestOutcome) -> None:
            heard.append(("sent", outcome))

        def done(self, outcome: RequestOutcome) -> None:
            heard.append(("done", outcome))

        def lost(self, outcome: RequestOutcome) -> None:
            heard.append(("lost", outcome))

    monkeypatch.setattr(
        request_observer, "LISTENERS",
        (*request_observer.LISTENERS, lambda total, rate: Tally()),
    )
    yield heard


def _each_told_once(heard: Events, outcomes: list[RequestOutcome]) -> Counter[str]:
    told: dict[int, list[str]] = {id(outcome): [] for outcome in outcomes}
    for event, outcome in heard:
        told[id(outcome)].append(event)  # a KeyError: told of a request the load never had
    for outcome in outcomes:
        assert told[id(outcome)] == (["sent", "done"] if outcome.sent else ["lost"]), outcome
    counts = Counter(event for event, _ in heard)
    assert counts["sent"] == counts["done"]
    assert counts["done"] + counts["lost"] == len(outcomes)
    return counts


def test_nothing_listening_is_the_no_op_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(prometheus_counters.DIR_ENV, raising=False)
    monkeypatch.delenv(live_status.DIR_ENV, raising=False)
    assert request_observer.for_load(10, 1.0) is request_observer.NO_OBSERVER
    request_observer.NO_OBSERVER.sent(RequestOutcome(1))  # and it takes calls
    assert request_observer.NO_OBSERVER.listeners == ()


def test_a_plain_load_tells_each_request_once(events: Events) -> None:
    requests = [PromptRequest(prompt=f"p {i}", prompt_len=3, output_len=2) for i in range(6)]
    result = _run(_server({"profllm-2"}), requests, max_concurrency=2)
    assert [o.success for o in result.outcomes] == [True, True, False, True, True, True]
    assert _each_told_once(events, result.outcomes) == {"sent": 6, "done": 6}


def test_a_conversation_load_tells_sent_turns_once_and_never_sent_turns_as_lost(
    events: Events,
) -> None:
    turns = tuple(Turn(f"turn {t}", 3, 2) for t in range(3))
    workload = Conversations([Conversation(turns), Conversation(turns)])
    # Conversation 0's second turn fails: its third is never sent.
    result = _run(_server({"profllm-0-2"}, chat=True), workload, chat=True)
    assert [(o.conversation, o.turn, o.success, o.sent) for o in result.outcomes] == [
        (0, 1, True, True), (0, 2, False, True), (0, 3, False, False),
        (1, 1, True, True), (1, 2, True, True), (1, 3, True, True),
    ]
    assert _each_told_once(events, result.outcomes) == {"sent": 5, "done": 5, "lost": 1}


def test_a_load_over_client_processes_counts_each_request_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client processes' own observers, heard through the Prometheus counters they
    write (a listener in this process cannot hear another's)."""
    monkeypatch.delenv(live_status.DIR_ENV, raising=False)
    monkeypatch.setenv(prometheus_counters.DIR_ENV, str(tmp_path))
    labels = {"case": "c", "suite": "s", "server": "v"}
    monkeypatch.setenv(prometheus_counters.LABELS_ENV, json.dumps(labels))
    requests = [PromptRequest(prompt=f"p {i}", prompt_len=3, output_len=2) for i in range(6)]
    result = _run(_server({"profllm-3"}), requests, client_processes=2, max_concurrency=2)
    assert result.processes == 2
    assert sum(not o.success for o in result.outcomes) == 1
    found: defaultdict[str, float] = defaultdict(float)
    collector = MultiProcessCollector(None, path=str(tmp_path))  # type: ignore[no-untyped-call]
    for family in collector.collect():  # type: ignore[no-untyped-call]
        for sample in family.samples:
            assert {k: v for k, v in sample.labels.items() if k in labels} == labels
            name = sample.name
            if name == "profllm_client_requests_failed_total":
                name += ":" + sample.labels["reason"]
            found[name] += sample.value
    assert found["profllm_client_requests_sent_total"] == 6
    assert found["profllm_client_requests_completed_total"] == 5
    assert found["profllm_client_requests_failed_total:http_500"] == 1
    assert found["profllm_client_requests_failed_total:not_sent"] == 0
    assert found["profllm_client_requests_in_flight"] == 0
