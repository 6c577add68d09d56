"""A minimal HTTP/1.1 client for streamed responses, on asyncio's Protocol API, with a pool of
keep-alive connections.

Why not aiohttp: its response reader handles each HTTP chunk on its own (a feed, a wake-up and
a copy per SSE message, about three quarters of the client's CPU per message when measured);
here a socket read is de-chunked in one pass and handed over whole, with the moment it was
read, so a read holding 50 messages costs one wake-up. It speaks only what an OpenAI-compatible
server answers a POST with: a status line, headers, and a chunked, sized or close-delimited body.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

# Called with a piece of body and the perf_counter time its bytes were read.
BodySink = Callable[[bytes, float], None]
# A connection idle this long is closed rather than reused: servers close idle keep-alive
# connections (uvicorn, which vLLM runs, after 5 s: VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a
# request sent as the server closes is lost with the connection.
MAX_IDLE_S = 4.0


class ResponseError(Exception):
    """The connection failed or closed before the response was complete."""


class HttpResponse:
    status: int = 0
    reason: str = ""
    body: bytes = b""  # only for a non-200 response: the first bytes of its body


class _Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0  # time.monotonic() when it last went back to the pool
        self.reused = False  # it carried a response before this request
        self._reset(None, None)

    def _reset(self, sink: BodySink | None, done: asyncio.Future[HttpResponse] | None) -> None:
        self._sink = sink
        self._done = done
        self._response = HttpResponse()
        self._buffer = b""
        self._in_headers = True
        self._chunked = False
        self._remaining = -1  # bytes left in a sized body, or in the current chunk
        self._keep_alive = True
        self._error_body: list[bytes] = []

    @property
    def closed_unanswered(self) -> bool:
        """It closed before a byte of the response came: the server never took the request."""
        return self.closed and self._in_headers and not self._buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def send(self, request: bytes, sink: BodySink, done: asyncio.Future[HttpResponse]) -> None:
        self._reset(sink, done)
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._done is None or self._done.done():
            return  # nothing asked for: a stray byte after a finished response
        try:
            self._parse(self._buffer + data if self._buffer else data, now)
        except Exception as error:  # a bad response fails this request, not the loop
            self._fail(error)

    def _parse(self, data: bytes, now: float) -> None:
        if self._in_headers:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                self._buffer = data
                return
            self._headers(data[:end])
            data = data[end + 4 :]
            self._in_headers = False
        if not self._chunked:
            self._sized(data, now)
            return
        # Locals, not attributes, in the loop: it runs once per chunk, for every message.
        pieces = []
        position = 0
        remaining = self._remaining
        length = len(data)
        finished = False
        while True:
            if remaining > 0:  # inside a chunk
                end = position + remaining
                if end > length:  # the chunk goes on in a later read
                    pieces.append(data[position:])
                    remaining = end - length
                    position = length
                    break
                pieces.append(data[position:end])
                position = end
                remaining = -2  # the chunk's closing CRLF comes next
            if remaining < -1:  # a CRLF ends a chunk (-2), and the last one the body (-3)
                if length - position < 2:
                    break
                position += 2
                if remaining == -3:
                    finished = True
                    break
                remaining = -1
            line_end = data.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(data[position:line_end].split(b";", 1)[0], 16)
            position = line_end + 2
            # The last chunk (size 0) is followed by an empty trailer: one more CRLF.
            remaining = size if size else -3
        self._remaining = remaining
        self._buffer = b"" if finished or position == length else data[position:]
        if pieces:
            self._deliver(pieces[0] if len(pieces) == 1 else b"".join(pieces), now)
        if finished:
            self._finish()

    def _sized(self, data: bytes, now: float) -> None:
        if self._remaining >= 0:
            data = data[: self._remaining]
            self._remaining -= len(data)
        self._buffer = b""
        self._deliver(data, now)
        if self._remaining == 0:
            self._finish()

    def _headers(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        self._response.status = int(code)
        self._response.reason = reason
        self._keep_alive = version == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length":
                self._remaining = int(value)
            elif name == "connection":
                self._keep_alive = value != "close"
        if self._chunked:
            self._remaining = -1  # a chunk size line comes first, whatever Content-Length says
        elif self._remaining < 0:
            self._keep_alive = False  # the body runs until the server closes

    def _deliver(self, data: bytes, now: float) -> None:
        if not data:
            return
        if self._response.status == 200:
            assert self._sink is not None
            self._sink(data, now)
        elif sum(map(len, self._error_body)) < 4096:
            self._error_body.append(data)

    def _finish(self) -> None:
        self._response.body = b"".join(self._error_body)
        if not self._keep_alive and self.transport is not None:
            self.transport.close()
            self.closed = True
        if self._done is not None and not self._done.done():
            self._done.set_result(self._response)

    def _fail(self, error: BaseException) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if not self._in_headers and not self._chunked and self._remaining < 0:
            self._finish()  # a close-delimited body ends here
            return
        where = "before the response" if self._in_headers else "in the middle of the body"
        self._done.set_exception(ResponseError(f"connection closed {where}: {exc or 'EOF'}"))


class StreamingClient:
    """POSTs to one server over pooled keep-alive connections (at most `limit` open at once)."""

    def __init__(self, base_url: str, headers: dict[str, str], limit: int | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"only http:// and https:// URLs are supported, not {base_url!r}")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        # No local holds the joined headers: an Authorization value would show in plain text
        # in a traceback's locals (pytest -l); `headers` shows it as a Secret, ***.
        self._head = (
            f"Host: {parts.netloc}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        ).encode("latin-1")
        self._idle: list[_Connection] = []
        self._limit = limit or None
        self._slots = asyncio.Semaphore(limit) if limit else None

    async def post(
        self,
        path: str,
        body: bytes,
        sink: BodySink,
        headers: dict[str, str] | None = None,
    ) -> HttpResponse:
        """Send `body`; every piece of a 200 response's body goes to `sink` as it is read."""
        if self._slots is not None:
            async with self._slots:
                return await self._post(path, body, sink, headers)
        return await self._post(path, body, sink, headers)

    async def _post(
        self, path: str, body: bytes, sink: BodySink, headers: dict[str, str] | None
    ) -> HttpResponse:
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        request = (
            f"POST {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1")
            + self._head
            + f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
            + body
        )
        connection = await self._connection()
        try:
            return await self._send(connection, request, sink)
        except ResponseError:
            # A kept-alive connection the server closed as the request went out (its idle
            # timeout raced ours): no byte of an answer came, so the server never took the
            # request. It is sent once more, on a new connection, as HTTP clients do.
            if not (connection.reused and connection.closed_unanswered):
                raise
        return await self._send(await self._connection(fresh=True), request, sink)

    async def _send(self, connection: _Connection, request: bytes,
                    sink: BodySink) -> HttpResponse:
        done: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        connection.send(request, sink, done)
        try:
            response = await done
        except BaseException:
            connection.closed = True
            if connection.transport is not None:
                connection.transport.abort()
            raise
        if not connection.closed:
            connection.reused = True
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        return response

    async def open(self, count: int) -> int:
        """Open up to `count` connections into the pool ahead of the requests, and say how
        many opened. A connection that fails to open is left to the request that would have
        used it (which opens its own and fails its own way): this never raises for it."""
        if self._limit is not None:
            count = min(count, self._limit)  # never more than may be in use at once
        opened = await asyncio.gather(
            *(self._connection(fresh=True) for _ in range(max(0, count))), return_exceptions=True
        )
        now = time.monotonic()
        for connection in opened:
            if isinstance(connection, _Connection):
                # As a kept-alive one: a server that closes it before a request goes out
                # never took that request, which is then sent once more on a new connection.
                connection.reused = True
                connection.idle_since = now
                self._idle.append(connection)
        return sum(isinstance(connection, _Connection) for connection in opened)

    async def _connection(self, fresh: bool = False) -> _Connection:
        now = time.monotonic()
        while self._idle and not fresh:
            connection = self._idle.pop()
            transport = connection.transport
            if connection.closed or transport is None or transport.is_closing():
                continue
            if now - connection.idle_since > MAX_IDLE_S:
                connection.closed = True
                transport.close()
                continue
            return connection
        loop = asyncio.get_running_loop()
        if self._tls:
            _, protocol = await loop.create_connection(
                _Connection, self._host, self._port, ssl=ssl.create_default_context()
            )
        else:
            _, protocol = await loop.create_connection(_Connection, self._host, self._port)
        return protocol

    def close(self) -> None:
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle.clear()
