"""`client.run_load` against in-process aiohttp servers that send hand-made SSE streams.

Each server is scripted byte by byte (and pause by pause), so the tests pin down how the client
cuts the stream into SSE messages and when it takes its timestamps, as `vllm bench serve` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from helpers import serve_handler

from pytest_profllm.load import loops, metrics
from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadResult, LoadSettings, arrival_offsets

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Step = bytes | float  # bytes: one write; float: a pause in seconds

DONE = b"data: [DONE]\n\n"
NO_CONTENT = "Never received a valid chunk to calculate TTFT."


def _message(event: object) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _token(text: str | None) -> bytes:
    return _message({"id": "cmpl-1", "choices": [{"index": 0, "text": text}]})


def _usage(completion_tokens: int) -> bytes:
    # vLLM's final chunk with stream_options.include_usage: no choices, only usage.
    usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens}
    return _message({"id": "cmpl-1", "choices": [], "usage": usage})


def _scripted(*steps: Step) -> Handler:
    """A handler that plays `steps` on an event-stream response, each write a separate chunk."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for step in steps:
            if isinstance(step, bytes):
                await response.write(step)
            else:
                await asyncio.sleep(step)
        await response.write_eof()
        return response

    return handler


def _requests(count: int) -> list[PromptRequest]:
    return [PromptRequest(prompt=f"prompt {i}", prompt_len=3, output_len=4) for i in range(count)]


def _load(handler: Handler, count: int = 1, **overrides: Any) -> LoadResult:
    """Run the client against `handler`, bounded in time, and stop the server whatever happens."""

    async def main() -> LoadResult:
        async with serve_handler(handler) as url:
            settings = LoadSettings(base_url=url, model="sim", request_timeout_s=5.0, **overrides)
            return await asyncio.wait_for(run_load(settings, _requests(count)), timeout=10)

    return asyncio.run(main())


# (a) How the byte stream is cut into messages.

FIRST = _token("a")


@pytest.mark.parametrize(
    "split",
    [
        pytest.param(len(b'data: {"id": "cm'), id="inside-json"),
        pytest.param(len(FIRST) - 1, id="between-the-two-newlines"),
        pytest.param(len(b"data:"), id="after-field-name"),
    ],
)
def test_split_message_and_coalesced_messages_each_count_once(split: int) -> None:
    handler = _scripted(
        b": keep-alive\n\n",  # an SSE comment is no content message
        0.02,
        FIRST[:split],
        0.15,  # the first message is complete only now
        FIRST[split:],
        0.05,
        _token("b") + _token("c") + _token("d"),  # three messages in one write
        _usage(4),
        DONE,
    )
    (outcome,) = _load(handler).outcomes
    assert outcome.success, outcome.error
    assert outcome.generated_text == "abcd"
    assert outcome.output_tokens == 4
    assert len(outcome.itl) == 3
    # TTFT is taken when the first message is whole, not at its first bytes (~20 ms).
    assert outcome.ttft >= 0.15
    assert outcome.itl[0] >= 0.04
    # Messages that came in one read are seen together.
    assert outcome.itl[1] < 0.03
    assert outcome.itl[2] < 0.03
    assert outcome.latency == pytest.approx(outcome.ttft + sum(outcome.itl))


# (b) Empty text is still a token message.


def test_empty_and_null_text_messages_count_as_tokens() -> None:
    handler = _scripted(
        _token(""), 0.03, _token("x"), 0.03, _token(None), 0.03, _token(""), _usage(4), DONE
    )
    (outcome,) = _load(handler).outcomes
    assert outcome.success, outcome.error
    assert outcome.generated_text == "x"
    assert len(outcome.itl) == 3
    # TTFT at the first (empty) message, sent right away.
    assert outcome.ttft < 0.025
    assert all(gap >= 0.02 for gap in outcome.itl)


# (c) The usage chunk.


def test_usage_chunk_sets_tokens_but_not_latency() -> None:
    handler = _scripted(_token("a"), 0.02, _token("b"), 0.2, _usage(2), DONE)
    result = _load(handler)
    (outcome,) = result.outcomes
    assert outcome.success, outcome.error
    assert outcome.output_tokens == 2
    assert len(outcome.itl) == 1
    # Latency ends at the last content message (~20 ms), not the usage chunk (~220 ms).
    assert outcome.latency < 0.15
    assert outcome.latency == pytest.approx(outcome.ttft + outcome.itl[0])
    # The benchmark's duration still runs to the end of the stream.
    assert result.duration >= 0.2


def test_missing_usage_leaves_output_tokens_unset() -> None:
    (outcome,) = _load(_scripted(_token("a"), _token("b"), DONE)).outcomes
    assert outcome.success
    assert outcome.output_tokens is None  # metrics.compute then counts the text's tokens


# (d), (e) Failures the server reports.


def test_http_error_is_a_failed_outcome_with_status() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="engine exploded")

    result = _load(handler, count=2)
    assert len(result.outcomes) == 2
    for outcome in result.outcomes:
        assert not outcome.success
        assert outcome.error.startswith("HTTP 500 Internal Server Error")
        assert "engine exploded" in outcome.error
        assert outcome.itl == []


def test_stream_with_only_usage_is_a_failure() -> None:
    (outcome,) = _load(_scripted(_usage(5), DONE)).outcomes
    assert not outcome.success
    assert outcome.error == NO_CONTENT
    assert outcome.ttft == 0.0
    assert outcome.itl == []
    assert outcome.latency == 0.0
    # Documented behaviour: the usage count is still kept on the failed outcome.
    assert outcome.output_tokens == 5


def test_invalid_json_is_a_failed_outcome() -> None:
    (outcome,) = _load(_scripted(_token("a"), b"data: {not json\n\n", DONE)).outcomes
    assert not outcome.success
    assert outcome.error == "StreamError: a message in the stream is not a JSON object: '{not json'"


@pytest.mark.parametrize(
    "bad", [b"data: [1, 2]\n\n", b'data: {"choices": [{"text": "\xff"}]}\n\n'], ids=["list", "utf8"]
)
def test_malformed_event_is_a_failed_outcome(bad: bytes) -> None:
    (outcome,) = _load(_scripted(_token("a"), bad, DONE)).outcomes
    assert not outcome.success


def test_request_timeout_is_a_failed_outcome() -> None:
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_token("a"))
        # Hold the stream open until the client gave up (bounded in case it never does).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), timeout=3)
        return response

    async def main() -> LoadResult:
        async with serve_handler(stall) as url:
            settings = LoadSettings(base_url=url, model="sim", request_timeout_s=0.3)
            try:
                return await asyncio.wait_for(run_load(settings, _requests(1)), timeout=5)
            finally:
                release.set()

    result = asyncio.run(main())
    (outcome,) = result.outcomes
    assert not outcome.success
    assert outcome.error.startswith("TimeoutError")
    assert 0.25 <= result.duration < 2


# (f) The server hangs up mid-stream.


def test_connection_closed_mid_stream() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_token("a"))
        await asyncio.sleep(0.02)
        await response.write(_token("b"))
        if body["prompt"] == "prompt 0":
            await asyncio.sleep(0.02)
            assert request.transport is not None
            request.transport.close()  # no terminating chunk: the body is cut short
            return response
        await response.write(_usage(2) + DONE)
        await response.write_eof()
        return response

    result = _load(handler, count=2)
    cut, whole = result.outcomes
    # A failure that keeps what arrived before the cut (both tokens, TTFT, the gap, latency to
    # the last token), and the status the response had.
    assert not cut.success
    assert cut.error == "ResponseError: connection closed in the middle of the body: EOF"
    assert cut.status == 200
    assert cut.generated_text == "ab"
    assert cut.ttft > 0
    assert len(cut.itl) == 1
    assert cut.latency == pytest.approx(cut.ttft + cut.itl[0])
    # The other request is unaffected.
    assert whole.success, whole.error
    assert whole.output_tokens == 2


# (g) Concurrency.


@pytest.mark.parametrize(("max_concurrency", "peak"), [(None, 6), (2, 2)])
def test_max_concurrency_bounds_in_flight_requests(max_concurrency: int | None, peak: int) -> None:
    in_flight = 0
    seen: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight
        in_flight += 1
        seen.append(in_flight)
        try:
            return await _scripted(_token("a"), 0.05, _token("b"), 0.05, _token("c"), DONE)(request)
        finally:
            in_flight -= 1

    result = _load(handler, count=6, max_concurrency=max_concurrency)
    assert all(outcome.success for outcome in result.outcomes)
    assert len(seen) == 6
    assert max(seen) == peak
    # The first token is sent at once: TTFT never holds the wait for a slot.
    assert max(outcome.ttft for outcome in result.outcomes) < 0.08
    # Infinite rate: all were due at the start, whenever they could be sent.
    assert all(outcome.intended_start == result.clock_start for outcome in result.outcomes)
    last_start = max(outcome.start_time - result.clock_start for outcome in result.outcomes)
    if max_concurrency == 2:
        assert last_start >= 0.15  # the third pair waited for two ~100 ms streams
    else:
        assert last_start < 0.08


# Request payload, headers, warmups and the arrival schedule end to end.


def test_payload_headers_and_warmups() -> None:
    seen: list[tuple[dict[str, Any], str | None]] = []
    stream = _scripted(_token("a"), DONE)

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((await request.json(), request.headers.get("Authorization")))
        return await stream(request)

    result = _load(handler, count=2, num_warmups=2, api_key="secret", temperature=0.5)
    assert len(result.outcomes) == 2
    assert len(seen) == 4  # two warmups (of the first prompt) are not outcomes
    assert [payload["prompt"] for payload, _ in seen[:2]] == ["prompt 0", "prompt 0"]
    payload, auth = seen[-1]
    assert auth == "Bearer secret"
    assert payload["model"] == "sim"
    assert payload["max_tokens"] == 4
    assert payload["temperature"] == 0.5
    assert payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    assert payload["ignore_eos"] is True


def test_ignore_eos_off_leaves_field_out() -> None:
    seen: list[dict[str, Any]] = []
    stream = _scripted(_token("a"), DONE)

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        return await stream(request)

    _load(handler, ignore_eos=False)
    assert "ignore_eos" not in seen[0]


def test_finite_rate_sends_on_schedule() -> None:
    result = _load(_scripted(_token("a"), DONE), count=4, request_rate=20.0, burstiness=math.inf)
    offsets = [o.intended_start - result.clock_start for o in result.outcomes]
    assert offsets == pytest.approx([0.05, 0.10, 0.15, 0.20])
    for outcome, offset in zip(result.outcomes, offsets, strict=True):
        assert outcome.start_time - result.clock_start >= offset - 1e-3
    assert result.duration >= 0.2


# (h) The arrival schedule.


def test_infinite_rate_sends_all_at_once() -> None:
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_offsets(0, math.inf, 1.0, seed=0) == []


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_finite_rate_offsets_increase_to_count_over_rate(burstiness: float) -> None:
    offsets = arrival_offsets(50, 10.0, burstiness, seed=3)
    assert len(offsets) == 50
    assert offsets[0] > 0
    assert all(b > a for a, b in itertools.pairwise(offsets))
    assert offsets[-1] == pytest.approx(50 / 10.0)


def test_infinite_burstiness_is_evenly_spaced() -> None:
    assert arrival_offsets(4, 4.0, math.inf, seed=0) == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_seed_fixes_offsets() -> None:
    assert arrival_offsets(20, 5.0, 1.0, seed=7) == arrival_offsets(20, 5.0, 1.0, seed=7)
    assert arrival_offsets(20, 5.0, 1.0, seed=7) != arrival_offsets(20, 5.0, 1.0, seed=8)


def test_lower_burstiness_gives_burstier_gaps() -> None:
    # Gamma gaps: coefficient of variation 1/sqrt(burstiness).
    def variation(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_offsets(400, 10.0, burstiness, seed=1)])
        return float(np.std(gaps) / np.mean(gaps))

    assert variation(0.25) > 1.5 > variation(1.0) > 0.5 > variation(16.0)


# (i) Every content message's time, the schedule the client kept, and request ids.


def test_every_content_message_is_timed_and_one_read_shares_one_time() -> None:
    handler = _scripted(_token("a"), 0.05, _token("b") + _token("c"), 0.05, _token("d"), DONE)
    (outcome,) = _load(handler).outcomes
    times = outcome.message_times
    assert len(times) == 4
    assert times[1] == times[2]  # two messages, one read: they arrived together
    assert outcome.ttft == pytest.approx(times[0] - outcome.start_time)
    assert outcome.itl == pytest.approx([b - a for a, b in itertools.pairwise(times)])
    assert outcome.latency == pytest.approx(times[-1] - outcome.start_time)
    assert outcome.start_time <= times[0] <= times[-1] <= outcome.end_time
    assert outcome.status == 200


def test_usage_prompt_tokens_replace_the_prompt_length() -> None:
    # As vLLM's client: the server's count of the prompt is the one reported (the request
    # said 3).
    handler = _scripted(
        _token("a"),
        _message({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 1}}),
        DONE,
    )
    (outcome,) = _load(handler).outcomes
    assert outcome.prompt_len == 11
    assert outcome.output_tokens == 1


def test_error_event_mid_stream_fails_the_request_and_keeps_what_came() -> None:
    error = _message({"error": {"message": "engine died", "type": "InternalServerError"}})
    (outcome,) = _load(_scripted(_token("a"), 0.02, _token("b"), error, DONE)).outcomes
    assert not outcome.success
    assert outcome.error == "StreamError: error event in the stream: engine died"
    assert len(outcome.message_times) == 2
    assert len(outcome.itl) == 1


def test_request_ids_and_dispatch_times() -> None:
    ids: list[str | None] = []
    stream = _scripted(_token("a"), DONE)

    async def handler(request: web.Request) -> web.StreamResponse:
        ids.append(request.headers.get("x-request-id"))
        return await stream(request)

    result = _load(handler, count=3, request_rate=50.0, burstiness=math.inf)
    assert sorted(ids, key=str) == ["profllm-0", "profllm-1", "profllm-2"]
    assert result.intended_offsets == pytest.approx([0.02, 0.04, 0.06])
    for outcome in result.outcomes:
        assert outcome.intended_start <= outcome.dispatch_time <= outcome.start_time
        assert outcome.schedule_lag == outcome.dispatch_time - outcome.intended_start
    assert result.cpu_seconds > 0


def test_a_burst_goes_out_in_slices_with_the_loop_free_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At an infinite rate the requests leave BURST_SLICE at a time, and between two slices
    the loop runs what else is due (the reads of answers already come): a callback asked
    for at the first send runs once the first slice is out, not after the whole burst."""
    monkeypatch.setattr("pytest_profllm.load.client.BURST_SLICE", 2)
    sent: list[int] = []
    seen_at_first: list[int] = []

    class Listener:
        def sent(self, outcome: metrics.RequestOutcome) -> None:
            if not sent:
                asyncio.get_running_loop().call_soon(lambda: seen_at_first.append(len(sent)))
            sent.append(1)

        def done(self, outcome: metrics.RequestOutcome) -> None:
            pass

        def lost(self, outcome: metrics.RequestOutcome) -> None:
            pass

    monkeypatch.setattr(
        "pytest_profllm.load.request_observer.LISTENERS", (lambda total, rate: Listener(),)
    )
    result = _load(_scripted(_token("a"), DONE), count=7)
    assert all(outcome.success for outcome in result.outcomes)
    assert len(sent) == 7
    assert seen_at_first == [2]  # the first slice: two requests, then the loop's turn


# (j) The chat backend.


def _delta(delta: dict[str, Any]) -> bytes:
    return _message({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta}]})


def test_chat_counts_content_deltas_not_the_role_chunk() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    stream = _scripted(
        _delta({"role": "assistant", "content": ""}),  # the opening chunk: no token
        0.05,
        _delta({"content": "a"}),
        0.02,
        _delta({"content": ""}),  # a token that decodes to nothing still is one
        _delta({"reasoning": "r"}),
        _delta({}),  # nothing: not a token
        _message({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
        DONE,
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, await request.json()))
        return await stream(request)

    async def main() -> LoadResult:
        async with serve_handler(handler, "/v1/chat/completions") as url:
            settings = LoadSettings(
                base_url=url, model="sim", backend="openai-chat",
                temperature=None, request_timeout_s=5.0,
            )
            return await asyncio.wait_for(run_load(settings, _requests(1)), timeout=10)

    (outcome,) = asyncio.run(main()).outcomes
    assert outcome.success, outcome.error
    assert len(outcome.message_times) == 3
    assert outcome.ttft >= 0.05  # the role chunk at once did not count as the first token
    assert outcome.generated_text == "a"
    path, payload = seen[0]
    assert path == "/v1/chat/completions"
    assert payload["messages"] == [{"role": "user", "content": "prompt 0"}]
    assert payload["max_completion_tokens"] == 4
    assert "prompt" not in payload and "max_tokens" not in payload
    assert "temperature" not in payload  # None: the server's default, as vLLM's client


# (k) Ramp-up schedules.


def test_linear_ramp_up_gaps_follow_the_rate() -> None:
    offsets = arrival_offsets(3, math.inf, math.inf, 0, "linear", 1.0, 3.0)
    # Rates 1, 2, 3 requests/s: gaps 1, 1/2, 1/3, not rescaled (as vLLM).
    assert offsets == pytest.approx([1.0, 1.5, 1.5 + 1 / 3])


def test_exponential_ramp_up_rates() -> None:
    offsets = arrival_offsets(3, math.inf, math.inf, 0, "exponential", 1.0, 4.0)
    assert offsets == pytest.approx([1.0, 1.5, 1.75])  # rates 1, 2, 4


def test_ramp_up_with_gamma_gaps_is_seeded() -> None:
    first = arrival_offsets(50, math.inf, 1.0, 5, "linear", 1.0, 10.0)
    assert first == arrival_offsets(50, math.inf, 1.0, 5, "linear", 1.0, 10.0)
    assert all(b > a for a, b in itertools.pairwise(first))
    # The ramp speeds up: the last ten gaps are shorter than the first ten.
    assert first[9] - 0 > first[-1] - first[-11]


def test_ramp_up_needs_both_rates() -> None:
    with pytest.raises(ValueError, match="ramp_up_start_rps and ramp_up_end_rps"):
        arrival_offsets(3, math.inf, 1.0, 0, "linear", None, 3.0)



def test_the_client_runs_on_uvloop_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def running() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    installed = importlib.util.find_spec("uvloop") is not None
    monkeypatch.delenv(loops.CHOICE_ENV, raising=False)
    assert loops.name() == ("uvloop" if installed else "asyncio")
    assert loops.run(running()) == loops.name()  # the loop the record names is the one used
    monkeypatch.setenv(loops.CHOICE_ENV, "asyncio")
    assert (loops.name(), loops.run(running())) == ("asyncio", "asyncio")

# (l) The load spread over processes.


def test_a_sharded_load_is_the_unsharded_one_sent_by_two_processes() -> None:
    # Two client processes keep one arrival schedule and one trace-id space, and their
    # results merge into one record, as if one client had sent every request.
    key = "0123456789abcdef"
    seen: dict[int, list[tuple[str | None, str]]] = {1: [], 2: []}
    loads = {}
    for processes in (1, 2):

        async def handler(request: web.Request, into: list[Any] = seen[processes]) -> Any:
            into.append((request.headers.get("x-request-id"),
                         request.headers["traceparent"].split("-")[1]))
            return await _scripted(_token("a"), 0.01, _token("b"), _usage(2), DONE)(request)

        loads[processes] = _load(handler, count=40, request_rate=400.0, seed=7,
                                 client_processes=processes, trace_key=key)
    one, two = loads[1], loads[2]
    assert (one.processes, two.processes) == (1, 2)
    for load, arrivals in ((one, seen[1]), (two, seen[2])):
        assert [o.success for o in load.outcomes] == [True] * 40
        # Every request sent once, under its own id.
        assert sorted(str(request_id) for request_id, _ in arrivals) == sorted(
            f"profllm-{i}" for i in range(40))
        # One trace-id space: the load's key, and no trace id twice over the processes.
        traces = [str(o.trace_id) for o in load.outcomes]
        assert len(set(traces)) == 40 and all(t.startswith(key) for t in traces)
        assert sorted(traces) == sorted(trace for _, trace in arrivals)
    # The same schedule: the same offsets, each request due at its own on the one clock.
    assert two.intended_offsets == one.intended_offsets
    for load in (one, two):
        due = [o.intended_start - load.clock_start for o in load.outcomes]
        assert due == pytest.approx(load.intended_offsets, abs=1e-9)
    # The merged record's percentiles are those of the two processes' samples pooled.
    shares = [two.outcomes[rank::2] for rank in (0, 1)]
    pooled = [o.ttft for share in shares for o in share]
    merged = metrics.compute(two.outcomes, two.duration)
    assert merged["completed"] == 40
    assert merged["median_ttft_ms"] == pytest.approx(float(np.median(pooled)) * 1000)
    assert merged["p99_ttft_ms"] == pytest.approx(float(np.percentile(pooled, 99)) * 1000)
    health = metrics.client_health(two.outcomes, two.intended_offsets, two.clock_start,
                                   two.duration, two.cpu_seconds, two.processes, two.watch,
                                   two.cores)
    assert health["client_processes"] == 2 and (health["client_cores"] or 0) >= 1

def test_two_client_processes_share_the_schedule_and_the_concurrency() -> None:
    in_flight = 0
    seen: list[int] = []
    ids: list[str | None] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight
        in_flight += 1
        seen.append(in_flight)
        ids.append(request.headers.get("x-request-id"))
        try:
            return await _scripted(_token("a"), 0.05, _token("b"), _usage(2), DONE)(request)
        finally:
            in_flight -= 1

    result = _load(handler, count=6, max_concurrency=2, client_processes=2)
    assert result.processes == 2
    assert [o.success for o in result.outcomes] == [True] * 6
    assert sorted(ids, key=str) == [f"profllm-{i}" for i in range(6)]
    assert max(seen) == 2  # one slot per process
    # One clock: every outcome's times lie after the shared start, in order.
    for outcome in result.outcomes:
        assert result.clock_start <= outcome.dispatch_time <= outcome.start_time
        assert outcome.start_time < outcome.message_times[0] < outcome.end_time
    assert result.cpu_seconds > 0
    # Each process watched itself (load/client_watch.py) and sent what it saw.
    assert len(result.watch) == 2 and all(f.wall_s > 0 for f in result.watch)
    import psutil

    # Every worker was reaped, and nothing else (no multiprocessing helper) was left running.
    assert [c for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE] == []
