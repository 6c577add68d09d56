"""`load.http`: the streaming HTTP/1.1 reader, fed by hand at every split point (and, with
the client's SSE timer behind it, at generated ones), and its connection pool against a real
loopback server."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.load.client import SseTimer
from pytest_profllm.load.http import HttpResponse, ResponseError, StreamingClient, _Connection
from pytest_profllm.load.metrics import RequestOutcome


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def _feed(response: bytes, cuts: list[int]) -> tuple[bytes, list[float], Any]:
    """Feed `response` to a connection in pieces cut at `cuts`; returns the body, the read
    times handed to the sink, and the future's outcome."""

    async def main() -> tuple[bytes, list[float], Any]:
        connection = _Connection()
        transport = FakeTransport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        received: list[bytes] = []
        times: list[float] = []

        def sink(data: bytes, now: float) -> None:
            received.append(data)
            times.append(now)

        done: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        connection.send(b"POST / HTTP/1.1\r\n\r\n", sink, done)
        edges = [0, *cuts, len(response)]
        for begin, end in itertools.pairwise(edges):
            connection.data_received(response[begin:end])
        if not done.done():
            connection.connection_lost(None)
        try:
            result: Any = done.result()
        except ResponseError as error:
            result = error
        return b"".join(received), times, result

    return asyncio.run(main())


RESPONSE = _chunked(b"data: one\n\n", b"data: two\n\n", b"data: three\n\n")


@pytest.mark.parametrize("cut", range(1, len(RESPONSE)))
def test_chunked_body_survives_a_cut_anywhere(cut: int) -> None:
    body, _, response = _feed(RESPONSE, [cut])
    assert body == b"data: one\n\ndata: two\n\ndata: three\n\n"
    assert isinstance(response, HttpResponse)
    assert response.status == 200


def test_one_read_is_one_delivery_with_one_time() -> None:
    body, times, _ = _feed(RESPONSE, [])
    assert len(times) == 1  # three chunks, one read: handed over together
    assert body.count(b"data:") == 3


def test_byte_by_byte() -> None:
    body, times, response = _feed(RESPONSE, list(range(1, len(RESPONSE))))
    assert body == b"data: one\n\ndata: two\n\ndata: three\n\n"
    assert times == sorted(times)
    assert response.status == 200


def test_sized_body_and_error_status_keep_the_body_apart() -> None:
    text = b'{"error": "no such model"}'
    raw = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text)
    body, _, response = _feed(raw, [30])
    assert body == b""  # a non-200 body never reaches the SSE parser
    assert (response.status, response.reason, response.body) == (404, "Not Found", text)


def test_close_delimited_body_ends_at_close() -> None:
    body, _, response = _feed(b"HTTP/1.0 200 OK\r\n\r\ndata: x\n\n", [])
    assert body == b"data: x\n\n"
    assert response.status == 200


def test_cut_mid_body_is_an_error() -> None:
    _, _, error = _feed(RESPONSE[:-20], [])
    assert isinstance(error, ResponseError)
    assert "in the middle of the body" in str(error)


def test_cut_before_headers_is_an_error() -> None:
    _, _, error = _feed(b"HTTP/1.1 200", [])
    assert "before the response" in str(error)


def test_pool_reuses_keep_alive_connections_and_honours_close() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            close = body == b"close"
            headers = b"Connection: close\r\n" if close else b""
            writer.write(
                _chunked(b"data: " + body + b"\n\n").replace(
                    b"\r\n\r\n", b"\r\n" + headers + b"\r\n", 1
                )
            )
            await writer.drain()
            if close:
                writer.close()
                return

    async def main() -> list[bytes]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}", {"X-Test": "1"}, limit=4)
        bodies: list[bytes] = []
        try:
            for body in (b"a", b"b", b"close", b"c"):
                await client.post("/v1/x", body, lambda data, now: bodies.append(data))
        finally:
            client.close()
            server.close()
        return bodies

    bodies = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert bodies == [b"data: a\n\n", b"data: b\n\n", b"data: close\n\n", b"data: c\n\n"]
    assert connections == 2  # one for a, b and close; a new one after the server closed


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="only http:// and https://"):
        StreamingClient("ftp://host", {})


def _serve_then_drop(answers_per_connection: int) -> tuple[Any, list[int]]:
    """A server that answers `answers_per_connection` requests on a connection, then closes
    it on the next one unanswered: a keep-alive timeout that races the client's request."""
    taken: list[int] = []  # per request read: the connection's number

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len(set(taken))
        answered = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            taken.append(number)
            if answered == answers_per_connection:
                writer.close()  # as the idle timeout would: the request is dropped unread
                return
            answered += 1
            writer.write(_chunked(b"data: " + body + b"\n\n"))
            await writer.drain()

    return handle, taken


def _against(handle: Any, steps: list[bytes | float]) -> list[bytes]:
    """POST each body of `steps` in turn over one client (pool of 1) to a loopback server
    running `handle`, sleeping where a step is a number of seconds; the bodies read."""

    async def main() -> list[bytes]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}", {}, limit=1)
        bodies: list[bytes] = []
        try:
            for step in steps:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    await client.post("/v1/x", step, lambda data, now: bodies.append(data))
        finally:
            client.close()
            server.close()
        return bodies

    return asyncio.run(asyncio.wait_for(main(), timeout=10))


def test_a_kept_alive_connection_closed_under_a_request_is_retried_once_on_a_new_one() -> None:
    handle, taken = _serve_then_drop(answers_per_connection=1)
    bodies = _against(handle, [b"a", b"b", b"c"])
    # b went out on a's connection, which the server closed unanswered: sent again on a new
    # one, and so for c. Every request answered once.
    assert bodies == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"]
    assert taken == [0, 0, 1, 1, 2]


def test_a_new_connection_closed_unanswered_is_an_error_not_a_retry() -> None:
    handle, taken = _serve_then_drop(answers_per_connection=0)
    with pytest.raises(ResponseError, match="before the response"):
        _against(handle, [b"a"])
    assert taken == [0]  # sent once: a server that drops a new connection's request is down


def test_a_connection_idle_past_the_servers_keep_alive_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("pytest_profllm.load.http.MAX_IDLE_S", 0.05)
    handle, taken = _serve_then_drop(answers_per_connection=5)
    # b at once reuses a's connection; c, after an idle spell past the bound, takes a new one.
    _against(handle, [b"a", b"b", 0.2, b"c"])
    assert taken == [0, 0, 1]


def test_the_pool_opens_connections_ahead_within_its_limit_and_requests_use_them() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            writer.write(_chunked(b"data: " + body + b"\n\n"))
            await writer.drain()

    async def main() -> tuple[int, int, list[bytes]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(f"http://127.0.0.1:{port}", {}, limit=3)
        bodies: list[bytes] = []
        try:
            opened = await client.open(5)  # never more than the limit
            await asyncio.sleep(0.05)  # the server has seen them all
            seen = connections
            await asyncio.gather(*(
                client.post("/v1/x", body, lambda data, now: bodies.append(data))
                for body in (b"a", b"b", b"c")
            ))
        finally:
            client.close()
            server.close()
        return opened, seen, bodies

    opened, seen, bodies = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert (opened, seen) == (3, 3)
    assert sorted(bodies) == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"]
    assert connections == 3  # the three requests went out on the connections opened ahead


def test_a_pool_that_cannot_open_ahead_says_so_and_leaves_it_to_the_requests() -> None:
    async def main() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # nothing listens there now
        client = StreamingClient(f"http://127.0.0.1:{port}", {})
        try:
            return await client.open(4)
        finally:
            client.close()

    assert asyncio.run(asyncio.wait_for(main(), timeout=10)) == 0


# An SSE message of a completions stream: ("content", text, finish), ("usage", count), a
# keep-alive comment, or [DONE]; "data:" with or without its space.
sse_messages = st.lists(
    st.one_of(
        st.tuples(st.just("content"), st.text(max_size=4), st.booleans()),
        st.tuples(st.just("usage"), st.integers(0, 50)),
        st.sampled_from([("comment",), ("done",)]),
    ),
    min_size=1,
    max_size=12,
)


def _sse(message: tuple[Any, ...], spaced: bool) -> bytes:
    field = b"data: " if spaced else b"data:"
    if message[0] == "content":
        finish = "length" if message[2] else None
        event: object = {"choices": [{"index": 0, "text": message[1], "finish_reason": finish}]}
    elif message[0] == "usage":
        event = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": message[1]}}
    elif message[0] == "comment":
        return b": keep-alive\n\n"
    else:
        return field + b"[DONE]\n\n"
    return field + json.dumps(event).encode() + b"\n\n"


@settings(max_examples=300, deadline=None)
@given(messages=sse_messages, spaced=st.booleans(), data=st.data())
def test_any_chunking_and_any_reads_time_each_message_at_the_read_that_completed_it(
    messages: list[tuple[Any, ...]], spaced: bool, data: st.DataObject
) -> None:
    """However the server cuts the stream into HTTP chunks and the network into reads, each
    content message is counted once, at the time of the read that brought its blank line,
    and the text, the usage count and the stream's end are what the server sent."""
    body = b"".join(_sse(message, spaced) for message in messages)
    chunk_cuts = sorted(set(data.draw(st.lists(st.integers(1, len(body) - 1), max_size=8))))
    pieces = [body[a:b] for a, b in itertools.pairwise([0, *chunk_cuts, len(body)])]
    response = _chunked(*pieces)
    read_cuts = sorted(set(data.draw(st.lists(st.integers(1, len(response) - 1), max_size=12))))
    reads = [response[a:b] for a, b in itertools.pairwise([0, *read_cuts, len(response)])]

    # Where each content message's blank line ends in the response, and so its read's index.
    expected_times: list[float] = []
    body_start = response.index(b"\r\n\r\n") + 4
    position = 0
    for message in messages:
        position += len(_sse(message, spaced))
        if message[0] != "content":
            continue
        last = position - 1  # the body offset of the message's last newline
        before = sum(len(piece) for piece in pieces[: bisect.bisect_right(chunk_cuts, last)])
        index = bisect.bisect_right(chunk_cuts, last)
        # In the response: the chunks before it, each with its size line and CRLF, then its own.
        offset = body_start + sum(
            len(b"%x\r\n" % len(piece)) + len(piece) + 2 for piece in pieces[:index]
        ) + len(b"%x\r\n" % len(pieces[index])) + (last - before)
        expected_times.append(float(bisect.bisect_right(read_cuts, offset)))

    async def main() -> tuple[RequestOutcome, Any]:
        outcome = RequestOutcome(prompt_len=3)
        timer = SseTimer(outcome)
        connection = _Connection()
        connection.connection_made(FakeTransport())  # type: ignore[arg-type]
        done: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        connection.send(b"POST / HTTP/1.1\r\n\r\n", timer.feed, done)
        clock = itertools.count()
        for read in reads:
            now = float(next(clock))
            # Every read is handed over with its time: the reader takes perf_counter's.
            connection._parse(connection._buffer + read if connection._buffer else read, now)
        timer.finish()
        timer.close()
        return outcome, done.result()

    outcome, answer = asyncio.run(main())
    assert answer.status == 200
    assert outcome.message_times == expected_times
    contents = [message for message in messages if message[0] == "content"]
    assert outcome.generated_text == "".join(message[1] for message in contents)
    usages = [message[1] for message in messages if message[0] == "usage"]
    assert outcome.output_tokens == (usages[-1] if usages else None)
    ended = any(m[0] == "done" or (m[0] == "content" and m[2]) for m in messages)
    assert outcome.success == (bool(contents) and ended), outcome.error
