"""The load generator: streams completions from an OpenAI-compatible server, timing each message.

Timing follows `vllm bench serve`: a request's clock starts just before it is sent (after any
`max_concurrency` wait), TTFT is the first content message, ITL the gaps between content
messages, latency the last content message. Arrival times come from the schedule
(schedule.py); this module sends each request at its time and reads its stream.

Where it differs, it is on the side of honesty and speed: every time is taken on the monotonic
`perf_counter` clock when the bytes of a read arrive (not after parsing them), so messages that
came in one read share one time; each request also keeps its intended send time and the time
its task actually ran, so the client's own lateness (schedule lag) is measured rather than
hidden; one pooled session serves every request, and each message is parsed once with orjson.
Where vLLM's client opens a connection on a request's clock, the connections of the requests
due at the load's start are opened before it starts (`open_pool`): at 1,000 streams at once the
handshakes took half the client's CPU, and every request waited for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import orjson

from pytest_profllm.engine.secrets import bearer
from pytest_profllm.hosts.descriptors import OUT_OF_DESCRIPTORS
from pytest_profllm.load import live_status, request_observer
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.http import StreamingClient
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.pooling import vector_check
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.trace_context import request_headers

_NO_CONTENT = "Never received a valid chunk to calculate TTFT."
ENDPOINTS: dict[str, str] = {
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
    "openai-embeddings": "/v1/embeddings",
    "vllm-rerank": "/v1/rerank",
}
POOLING_BACKENDS = ("openai-embeddings", "vllm-rerank")
# Requests started in one turn of the event loop, at most: a burst due at once (an infinite
# rate) goes out in slices of this many, and between two slices the loop reads what came,
# so an early request's first token is not left unread behind the rest of the burst.
BURST_SLICE = 64


def request_payload(settings: LoadSettings, request: PromptRequest) -> dict[str, Any]:
    """The JSON body vLLM's client sends for this backend."""
    payload: dict[str, Any] = {"model": request.model or settings.model}
    if settings.backend in POOLING_BACKENDS:
        return _pooling_payload(settings, request, payload)
    if settings.backend == "openai-chat":
        content: str | list[dict[str, Any]] = request.prompt
        if request.chat_content is not None:
            content = list(request.chat_content)
        elif request.mm_content:  # the text first, then the media, as vLLM's client
            content = [{"type": "text", "text": request.prompt}, *request.mm_content]
        payload["messages"] = [{"role": "user", "content": content}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = list(request.prompt_ids) if request.prompt_ids else request.prompt
        payload["max_tokens"] = request.output_len
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    if settings.temperature is not None:
        payload["temperature"] = settings.temperature
    if settings.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _pooling_payload(
    settings: LoadSettings, request: PromptRequest, payload: dict[str, Any]
) -> dict[str, Any]:
    texts = list(request.inputs or (request.prompt,))
    if settings.backend == "vllm-rerank":
        payload.update(query=texts[0], documents=texts[1:])
    else:
        payload["input"] = texts if len(texts) > 1 else texts[0]
    # As vLLM's client: a long input is cut to the model's length rather than refused.
    payload["truncate_prompt_tokens"] = -1
    return payload


def _client(settings: LoadSettings, limit: int | None) -> StreamingClient:
    headers = {"Content-Type": "application/json", **bearer(settings.api_key)}
    # One pool of keep-alive connections serves every request, never a connection per request.
    return StreamingClient(settings.base_url, headers, limit)


async def run_warmups(settings: LoadSettings, request: PromptRequest) -> None:
    """vLLM's warmups: the first prompt, `num_warmups` times, within `max_concurrency`."""
    client = _client(settings, settings.max_concurrency)
    path = settings.endpoint or ENDPOINTS[settings.backend]
    body = _encode(request_payload(settings, request))
    warmup = asyncio.Semaphore(settings.max_concurrency or settings.num_warmups)

    async def warm() -> None:
        async with warmup:
            await stream_request(client, path, body, RequestOutcome(prompt_len=0), settings)

    live_status.warming_up(True)
    try:
        await asyncio.gather(*(warm() for _ in range(settings.num_warmups)))
    finally:
        live_status.warming_up(False)
        client.close()


async def sleep_until(due: float) -> None:
    """Until `due` on the perf_counter clock, never before: uvloop's timers (load/loops.py)
    count whole milliseconds and may wake one early, so a wake before `due` sleeps again."""
    while (delay := due - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


async def open_pool(
    settings: LoadSettings, offsets: Sequence[float], max_concurrency: int | None = None
) -> StreamingClient:
    """A load's pool, with a connection already open for each request due at its start (every
    request at an infinite rate), up to `max_concurrency`: opened before the load's clock
    starts, so the burst's TCP handshakes (on loopback, the kernel's work on the client's own
    core, as much CPU as sending the request) are in no request's TTFT. Later requests open
    theirs as they go, as before."""
    limit = max_concurrency or settings.max_concurrency
    client = _client(settings, limit)
    at_start = sum(1 for offset in offsets if offset <= 0.0)
    await client.open(at_start)
    return client


async def run_share(
    settings: LoadSettings,
    requests: Sequence[PromptRequest],
    offsets: Sequence[float],
    indices: Sequence[int],
    start: float,
    max_concurrency: int | None = None,
    client: StreamingClient | None = None,
) -> list[RequestOutcome]:
    """Send `requests` (numbered `indices` in the whole workload) at `start + offsets`, on
    `client` (a pool from `open_pool`, closed here) or on a new pool; one that waits for
    another (`PromptRequest.after`, a number in the whole workload, whose request is in this
    share) not before that one's response ended plus its delay."""
    limit = max_concurrency or settings.max_concurrency
    semaphore: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    )
    path = settings.endpoint or ENDPOINTS[settings.backend]
    bodies = [_encode(request_payload(settings, request)) for request in requests]
    client = client or _client(settings, limit)
    send = pooling_request if settings.backend in POOLING_BACKENDS else stream_request

    observer = request_observer.for_load(len(requests), settings.request_rate)

    # The requests others wait for (a trace line's parent), by their place in the workload:
    # set when their response has ended, however it ended.
    ended = {request.after: asyncio.Event() for request in requests if request.after is not None}
    outcomes: dict[int, RequestOutcome] = {}

    async def one(
        outcome: RequestOutcome, body: bytes, index: int, request: PromptRequest
    ) -> RequestOutcome:
        try:
            if request.after is not None:
                await ended[request.after].wait()
                # Due at its own time or at its parent's end plus the delay, the later: a
                # lag after that is the client's own.
                parent_end = outcomes[request.after].end_time
                outcome.intended_start = max(
                    outcome.intended_start, parent_end + request.after_delay_s
                )
                await sleep_until(outcome.intended_start)
            outcome.dispatch_time = time.perf_counter()
            async with semaphore:
                request_id = f"{settings.request_id_prefix}{index}"
                observer.sent(outcome)
                try:
                    return await send(client, path, body, outcome, settings, request_id)
                finally:
                    observer.done(outcome)
        finally:
            if index in ended:
                ended[index].set()

    try:
        tasks = []
        schedule = zip(requests, offsets, bodies, indices, strict=True)
        for request, offset, body, index in schedule:
            await sleep_until(start + offset)
            outcome = RequestOutcome(
                prompt_len=request.prompt_len,
                intended_start=start + offset,
                output_len=request.output_len,
                text_prompt_len=request.prompt_len,
                mm_items=len(request.mm_items) + len(request.mm_audio_s),
                mm_bytes=request.mm_bytes,
                mm_audio_clips=len(request.mm_audio_s),
                mm_audio_s=sum(request.mm_audio_s),
                mm_pixels=sum(h * w * t for h, w, t in request.mm_items),
                model=request.model,
            )
            outcomes[index] = outcome
            tasks.append(asyncio.create_task(one(outcome, body, index, request)))
            if len(tasks) % BURST_SLICE == 0:
                await asyncio.sleep(0)  # this slice goes out, and the loop reads, first
        return list(await asyncio.gather(*tasks))
    finally:
        client.close()


def _encode(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload)


async def stream_request(
    client: StreamingClient,
    path: str,
    body: bytes,
    outcome: RequestOutcome,
    settings: LoadSettings,
    request_id: str | None = None,
) -> RequestOutcome:
    """Send one streaming request and time its content messages into `outcome`."""
    parser = SseTimer(outcome, chat=path.endswith("/chat/completions"))
    start = time.perf_counter()
    outcome.start_time = start
    if not outcome.dispatch_time:
        outcome.dispatch_time = start
    headers = request_headers(outcome, request_id, settings.trace_key)
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            response = await client.post(path, body, parser.feed, headers)
        outcome.status = response.status
        if response.status != 200:
            text = response.body.decode(errors="replace")[:300]
            outcome.error = f"HTTP {response.status} {response.reason}: {text}"
        else:
            parser.finish()
    except TimeoutError:
        outcome.error = f"TimeoutError: no end within {settings.request_timeout_s:g} s"
    except Exception as error:  # as in vLLM's client: any error fails this request only
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.out_of_descriptors = out_of_descriptors(error)
    outcome.end_time = time.perf_counter()
    parser.close()
    return outcome


async def pooling_request(
    client: StreamingClient,
    path: str,
    body: bytes,
    outcome: RequestOutcome,
    settings: LoadSettings,
    request_id: str | None = None,
) -> RequestOutcome:
    """Send one pooling request (embeddings, rerank) and time its whole response: its E2EL,
    and its TTFT, as vLLM's client sets it, is the same. It completes with a JSON body that
    holds what was asked (a finite vector per input; a score per document)."""
    chunks: list[bytes] = []
    outcome.pooled = True
    start = time.perf_counter()
    outcome.start_time = start
    if not outcome.dispatch_time:
        outcome.dispatch_time = start
    headers = request_headers(outcome, request_id, settings.trace_key)
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            response = await client.post(path, body, lambda data, _: chunks.append(data), headers)
        outcome.status = response.status
        if response.status != 200:
            text = response.body.decode(errors="replace")[:300]
            outcome.error = f"HTTP {response.status} {response.reason}: {text}"
        else:
            outcome.error = _pooled(orjson.loads(b"".join(chunks)), outcome) or ""
    except TimeoutError:
        outcome.error = f"TimeoutError: no end within {settings.request_timeout_s:g} s"
    except orjson.JSONDecodeError:
        outcome.error = "the response is not JSON"
    except Exception as error:  # as in vLLM's client: any error fails this request only
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.out_of_descriptors = out_of_descriptors(error)
    outcome.end_time = time.perf_counter()
    outcome.success = not outcome.error
    if outcome.success:
        outcome.latency = outcome.ttft = outcome.end_time - start
        outcome.output_tokens = 0
    return outcome


def out_of_descriptors(error: BaseException) -> bool:
    """Whether `error` is the client's own want of file descriptors (EMFILE, ENFILE): a
    socket it could not open. asyncio joins the errors of several addresses into one
    OSError without an errno, so its text is read too."""
    if not isinstance(error, OSError):
        return False
    if error.errno in OUT_OF_DESCRIPTORS:
        return True
    return any(os.strerror(code) in str(error) for code in OUT_OF_DESCRIPTORS)


def _pooled(answer: object, outcome: RequestOutcome) -> str | None:
    """Why a pooling response does not hold what was asked, or None; sets the prompt tokens
    from its usage, as vLLM's client does."""
    if not isinstance(answer, dict):
        return "the response is not a JSON object"
    if "results" in answer:  # rerank
        results = answer["results"]
        if not isinstance(results, list) or not results:
            return "the rerank response has no results"
    else:
        problem = vector_check(answer.get("data"))
        if problem:
            return problem
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
        outcome.prompt_len = prompt
    return None


class SseTimer:
    """Cuts an SSE byte stream into messages and times the content ones.

    A message is complete at its blank line; a read may hold several messages or part of one,
    and every message completed by a read takes that read's arrival time. A content message is
    one with a choice (completions: any text, even empty; chat: a delta with content, reasoning
    or tool calls, or an empty content without a role), as vLLM counts them. A usage message
    sets the output token count.

    A request completes only when its stream ends normally (`[DONE]`, or a choice with a
    finish_reason) with content; an `error` event or a message that is not a JSON object
    fails it at once (StreamError), and a stream that stops short fails it at its end.
    """

    def __init__(self, outcome: RequestOutcome, chat: bool = False) -> None:
        self._loads = orjson.loads
        self._outcome = outcome
        self._times = outcome.message_times  # appended to once per content message
        self._chat = chat
        self._buffer = b""
        self._text: list[str] = []
        self._ended = False  # [DONE] or a finish_reason came

    def feed(self, chunk: bytes, now: float) -> None:
        self._outcome.status = 200  # only a 200 response's body is fed here
        buffer = self._buffer + chunk if self._buffer else chunk
        begin = 0
        end = buffer.find(b"\n\n")
        while end >= 0:
            self._message(buffer[begin:end], now)
            begin = end + 2
            end = buffer.find(b"\n\n", begin)
        self._buffer = buffer[begin:] if begin else buffer

    def _message(self, raw: bytes, now: float) -> None:
        if not raw.startswith(b"data:"):
            return  # a comment (": keep-alive"), an empty message, or another field
        # The space after the colon is optional, and strip() takes it with any other.
        data = raw[5:].strip()
        if not data:
            return
        if data == b"[DONE]":
            self._ended = True
            return
        try:
            event = self._loads(data)
        except orjson.JSONDecodeError:
            event = None
        if type(event) is not dict:  # orjson makes exact dicts, lists and strs
            shown = data[:80].decode(errors="replace")
            raise StreamError(f"a message in the stream is not a JSON object: {shown!r}")
        choices = event.get("choices")
        if type(choices) is list and choices and type(choice := choices[0]) is dict:
            if choice.get("finish_reason") is not None:
                self._ended = True
            if self._chat:
                delta = choice.get("delta")
                if type(delta) is not dict or not _has_output(delta):
                    return
                text = delta.get("content")
            else:
                text = choice.get("text")
            self._times.append(now)
            if text and type(text) is str:
                self._text.append(text)
        elif usage := event.get("usage"):
            self._usage(usage)
        elif error := event.get("error"):
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(f"error event in the stream: {message}")

    def _usage(self, usage: object) -> None:
        outcome = self._outcome
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        # bool is an int to Python, not a count to anyone.
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            outcome.output_tokens = count
        else:
            outcome.output_tokens = None
            outcome.usage_problem = f"usage.completion_tokens is {count!r}, not a count"
        # As vLLM's client: the server's prompt count, where it gives one, is the truth.
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(prompt, int) and not isinstance(prompt, bool) and prompt >= 0:
            outcome.prompt_len = prompt
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
            outcome.cached_tokens = cached

    def finish(self) -> None:
        if self._buffer.strip():
            # The last message lacked its blank line: vLLM's client still reads it.
            self._message(self._buffer.strip(), time.perf_counter())
            self._buffer = b""
        if not self._outcome.message_times:
            self._outcome.error = _NO_CONTENT
        elif not self._ended:
            self._outcome.error = "the stream ended without [DONE] or a finish_reason"
        else:
            self._outcome.success = True

    def close(self) -> None:
        """Derive vLLM's per-request figures from the message times, whatever happened."""
        outcome = self._outcome
        times = outcome.message_times
        outcome.generated_text = "".join(self._text)
        if outcome.error:
            outcome.success = False
        if times:
            outcome.ttft = times[0] - outcome.start_time
            outcome.itl = [b - a for a, b in itertools.pairwise(times)]
            outcome.latency = times[-1] - outcome.start_time


class StreamError(Exception):
    """The server reported an error inside a stream that had started well."""


def _has_output(delta: dict[str, Any]) -> bool:
    if (
        delta.get("content")
        or delta.get("reasoning")
        or delta.get("reasoning_content")
        or delta.get("tool_calls")
        or delta.get("function_call")
    ):
        return True
    # A token that decodes to nothing still is a token; the role-only first chunk is not.
    return delta.get("content") == "" and "role" not in delta
