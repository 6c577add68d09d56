"""A paced OpenAI-compatible server, for measuring the client rather than a server:
`python benchmarks/perf/paced_server.py --port P [--ttft-ms 50] [--itl-ms 10]`.

Every `POST /v1/completions` stream gets its first token `--ttft-ms` after its request was
read, then one token every `--itl-ms` until `max_tokens`, then vLLM's usage chunk and
`[DONE]`. One timer tick per ITL writes every stream whose next token is due, so a Python
server keeps up with thousands of streams: a token is written up to a tick late, and the
server says how late (its own lateness, which the client's figures must not be blamed for).

`GET /log` answers, as JSON, and forgets: per request id, the moment its request was read, the
moment its bytes reached the server's socket (the kernel's receive stamp, SO_TIMESTAMPNS, so
the server's own lateness in reading is told apart from the client's in sending) and the
moment its first token was written (perf_counter, the host's monotonic clock, as the
client's), so a client's TTFT can be set against the server's own (`client_error.py`); the
ticks' lateness (p50/p99/max ms), the tokens written and the completions requests read (a
request id sent twice counts twice there, once in the per-id maps). `POST
/reset_prefix_cache` answers `{}`; any other path 404. Not a pytest file; the benchmark
starts and reaps it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
import time
from typing import Any, ClassVar

# Linux's socket option for a nanosecond receive stamp on every read (asm-generic/socket.h;
# Python's socket module does not name it): the stamp is CLOCK_REALTIME's, a struct timespec.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("@qq")
_READ_SIZE = 65536

_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(choice_text: str, finish: str | None) -> bytes:
    event = {"id": "cmpl-paced", "object": "text_completion", "created": 0, "model": "paced",
             "choices": [{"index": 0, "text": choice_text, "logprobs": None,
                          "finish_reason": finish, "stop_reason": None}]}
    return _chunk(b"data: " + json.dumps(event).encode() + b"\n\n")


_TOKEN = _event(" tok", None)
_LAST = _event(" tok", "length")


def _tail(tokens: int) -> bytes:
    usage = {"id": "cmpl-paced", "object": "text_completion", "created": 0, "model": "paced",
             "choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": tokens,
                                      "total_tokens": 16 + tokens}}
    return (_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")
            + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _plain(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % len(body) + body)


class Pace:
    """The server's settings and what it saw, shared by its connections."""

    ttft_s = 0.05
    itl_s = 0.01
    read: ClassVar[dict[str, float]] = {}  # request id -> when its request was read
    # request id -> when its bytes reached the socket (the kernel's stamp, as perf_counter)
    arrived: ClassVar[dict[str, float]] = {}
    first: ClassVar[dict[str, float]] = {}  # request id -> when its first token was written
    lateness: ClassVar[list[float]] = []  # each tick's, seconds
    tokens = 0
    requests = 0  # completions requests read, a request id read twice counted twice


class _Socket:
    """A connection's socket, read with its kernel receive stamps and written without
    blocking (asyncio's transports hand a protocol the bytes, never the stamps)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 stream: _Stream) -> None:
        self.sock, self.loop, self.stream = sock, loop, stream
        self.pending = bytearray()
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(_READ_SIZE, socket.CMSG_SPACE(16))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancillary = b"", []
        now = time.perf_counter()
        if not data:
            self.close()
            return
        arrived = now
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                seconds, nanoseconds = _TIMESPEC.unpack(payload[: _TIMESPEC.size])
                # The real-time stamp on the monotonic clock, by the two clocks' offset now.
                arrived = seconds + nanoseconds / 1e9 - (time.time() - time.perf_counter())
        self.stream.data_received(data, now, min(arrived, now))

    def write(self, data: bytes) -> None:
        if self.pending:
            self.pending += data
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.close()
            return
        if sent < len(data):
            self.pending += data[sent:]
            self.loop.add_writer(self.sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self.sock.send(self.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        del self.pending[:sent]
        if not self.pending:
            self.loop.remove_writer(self.sock.fileno())

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
        _Stream.active.discard(self.stream)
        self.stream.transport = None


class _Stream:
    """One keep-alive connection, one request at a time."""

    active: ClassVar[set[_Stream]] = set()

    def __init__(self) -> None:
        self.buffer = b""
        self.transport: _Socket | None = None
        self.request_id = ""
        self.due = 0.0
        self.remaining = 0
        self.asked = 0
        self.arrived = 0.0  # the kernel's stamp of the buffer's first unread request

    def data_received(self, data: bytes, now: float, arrived: float) -> None:
        if not self.buffer:
            self.arrived = arrived
        self.buffer += data
        if self not in _Stream.active:
            self._next(now)

    def _next(self, now: float) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1")
        length = 0
        request_id = ""
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
            elif name.strip().lower() == "x-request-id":
                request_id = value.strip()
        if len(self.buffer) < end + 4 + length:
            return
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        # A request read behind this one came with this read (no stamp of its own).
        arrived_next = now
        assert self.transport is not None
        method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
        if method == "POST" and path.endswith("/v1/completions"):
            asked = int(json.loads(body or b"{}").get("max_tokens") or 16)
            self.request_id = request_id or f"anonymous-{len(Pace.read)}"
            Pace.read[self.request_id] = now
            Pace.arrived[self.request_id] = self.arrived
            Pace.requests += 1
            self.transport.write(_HEAD)
            self.remaining = self.asked = max(1, asked)
            self.due = now + Pace.ttft_s
            _Stream.active.add(self)
            if self.buffer:
                self.arrived = arrived_next
            return
        if method == "GET" and path == "/log":
            self.transport.write(_plain(b"200 OK", json.dumps(_log()).encode()))
        elif method == "POST" and path == "/reset_prefix_cache":
            self.transport.write(_plain(b"200 OK", b"{}"))
        else:
            self.transport.write(_plain(b"404 Not Found", b'{"error": "not found"}'))
        if self.buffer:
            self._next(now)

    def write_due(self, now: float) -> None:
        """Its next token if it is due; the stream's end after its last."""
        if self.due > now or self.transport is None:
            return
        if self.remaining == self.asked:
            Pace.first[self.request_id] = now
        self.remaining -= 1
        Pace.tokens += 1
        if self.remaining:
            self.transport.write(_TOKEN)
            self.due += Pace.itl_s
            return
        self.transport.write(_LAST + _tail(self.asked))
        _Stream.active.discard(self)
        if self.buffer:
            self._next(now)


def _log() -> dict[str, Any]:
    lateness = sorted(Pace.lateness)

    def at(share: float) -> float | None:
        return lateness[min(len(lateness) - 1, int(share * len(lateness)))] * 1000 if lateness \
            else None

    out = {
        "read": dict(Pace.read), "arrived": dict(Pace.arrived), "first": dict(Pace.first),
        "tokens": Pace.tokens,
        "requests": Pace.requests,
        "ticks": len(lateness), "tick_lateness_p50_ms": at(0.5),
        "tick_lateness_p99_ms": at(0.99),
        "tick_lateness_max_ms": lateness[-1] * 1000 if lateness else None,
    }
    Pace.read.clear()
    Pace.arrived.clear()
    Pace.first.clear()
    Pace.lateness.clear()
    Pace.tokens = 0
    Pace.requests = 0
    return out


def _ticks(loop: asyncio.AbstractEventLoop) -> None:
    """A tick every ITL on a fixed cadence: every due stream gets its token; the tick's own
    lateness is kept while streams run."""
    due = loop.time() + Pace.itl_s

    def tick() -> None:
        nonlocal due
        now = loop.time()
        if _Stream.active:
            Pace.lateness.append(max(0.0, now - due))
            stamp = time.perf_counter()
            for stream in list(_Stream.active):
                stream.write_due(stamp)
        while due <= now:
            due += Pace.itl_s
        loop.call_at(due, tick)

    loop.call_at(due, tick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    args = parser.parse_args()
    Pace.ttft_s = args.ttft_ms / 1000
    Pace.itl_s = args.itl_ms / 1000

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        _ticks(loop)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", args.port))
        listener.listen(8192)
        listener.setblocking(False)

        def accept() -> None:
            while True:
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                stream = _Stream()
                stream.transport = _Socket(sock, loop, stream)

        loop.add_reader(listener.fileno(), accept)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
