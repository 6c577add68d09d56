"""The server's own story of each request: the `llm_request` trace spans it exports.

vLLM started with `--otlp-traces-endpoint URL` (and `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf`) exports one OpenTelemetry span per finished request, named `llm_request`
(vllm/v1/engine/output_processor.py `do_tracing`), whose parent is the request's W3C
`traceparent` header: its trace id is the one the client sent (load/trace_context.py). Its
attributes are the request's phases in seconds (queue, TTFT, E2E, prefill, decode, inference)
and its token counts. The simulated engine exports the same spans (sim/spans.py).

`SpanReceiver` is an OTLP/HTTP receiver on 127.0.0.1 (POST /v1/traces, an
`ExportTraceServiceRequest` in protobuf) that runs in a thread of the worker. It keeps only the
`llm_request` spans of loads it was told to expect: a load's trace ids all begin with the key
`expect` drew for it, so the spans of vLLM's start-up, of warmups, of another session's loads
and those that come after their load was collected are dropped (and counted). An export over
`MAX_SPAN_EXPORT_BYTES` is refused with 413, one that is not an export with 400, both counted;
nothing a client sends stops the receiver.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from pytest_profllm.limits import MAX_SPAN_EXPORT_BYTES, MAX_SPAN_LOADS, MAX_SPANS_PER_LOAD

if TYPE_CHECKING:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

TRACES_PATH = "/v1/traces"
SPAN_NAME = "llm_request"
# vLLM's attribute names (vllm/tracing.py SpanAttributes): latencies in seconds, as floats.
QUEUE = "gen_ai.latency.time_in_queue"
TTFT = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
PREFILL = "gen_ai.latency.time_in_model_prefill"
DECODE = "gen_ai.latency.time_in_model_decode"
INFERENCE = "gen_ai.latency.time_in_model_inference"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
REQUEST_ID = "gen_ai.request.id"
KEY_HEX = 16  # a load's key: the first 64 bits of each of its trace ids, in hex
# How long a handler waits for the rest of a body its Content-Length promised.
_READ_TIMEOUT_S = 5.0


class MalformedExport(ValueError):
    """A body that is no `ExportTraceServiceRequest` (or no gzip of one)."""


@dataclass(frozen=True)
class ServerSpan:
    """One request as the server timed it; seconds, None where the span did not say."""

    trace_id: str
    request_id: str | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class ReceiverCounts:
    """What the receiver was sent and what it did with it."""

    exports: int = 0  # accepted exports
    refused_too_large: int = 0  # 413: over MAX_SPAN_EXPORT_BYTES
    refused_malformed: int = 0  # 400: no export, a cut body, bad gzip
    spans_received: int = 0  # llm_request spans in accepted exports: the four below
    spans_kept: int = 0
    spans_unexpected: int = 0  # llm_request spans of trace ids no expected load issued
    spans_over_limit: int = 0  # over MAX_SPANS_PER_LOAD for their load
    spans_duplicate: int = 0  # a trace id's later spans: the one ending last is kept

    def describe(self) -> dict[str, int]:
        return dict(self.__dict__)

    def since(self, earlier: ReceiverCounts) -> ReceiverCounts:
        """What was counted after `earlier` (a `SpanReceiver.snapshot`)."""
        then = earlier.describe()
        return ReceiverCounts(**{key: value - then[key] for key, value in self.describe().items()})


def decode_export(body: bytes) -> list[ServerSpan]:
    """The `llm_request` spans of an OTLP/HTTP protobuf export; MalformedExport where the body
    is not one."""
    # Deferred: protobuf and opentelemetry-proto load only where requests are traced; the
    # plugin is imported by every pytest run.
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    export = ExportTraceServiceRequest()
    try:
        export.ParseFromString(body)
    except (DecodeError, ValueError, RecursionError) as error:
        raise MalformedExport(f"not an OTLP trace export: {error}") from None
    spans: list[ServerSpan] = []
    for resource in export.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                if span.name != SPAN_NAME or len(span.trace_id) != 16:
                    continue
                values = {a.key: _value(a.value) for a in span.attributes}
                spans.append(ServerSpan(
                    trace_id=span.trace_id.hex(),
                    request_id=_text(values.get(REQUEST_ID)),
                    queue_s=_seconds(values.get(QUEUE)),
                    ttft_s=_seconds(values.get(TTFT)),
                    e2e_s=_seconds(values.get(E2E)),
                    prefill_s=_seconds(values.get(PREFILL)),
                    decode_s=_seconds(values.get(DECODE)),
                    inference_s=_seconds(values.get(INFERENCE)),
                    prompt_tokens=_count(values.get(PROMPT_TOKENS)),
                    completion_tokens=_count(values.get(COMPLETION_TOKENS)),
                ))
    return spans


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    # A phase is never negative nor infinite; a clock step may make one a hair below zero.
    return seconds if 0.0 <= seconds < 1e9 else None


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _text(value: object) -> str | None:
    return value[:256] if isinstance(value, str) else None


def _gunzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise MalformedExport(f"not gzip: {error}") from None
    if len(out) > limit:
        raise _TooLarge
    return out


class _TooLarge(Exception):
    pass


@dataclass
class _Load:
    spans: dict[str, ServerSpan] = field(default_factory=dict)


class SpanReceiver:
    """The OTLP/HTTP receiver; `url` is what a server's `--otlp-traces-endpoint` takes."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = MAX_SPAN_EXPORT_BYTES,
        max_spans_per_load: int = MAX_SPANS_PER_LOAD,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_spans_per_load = max_spans_per_load
        self.counts = ReceiverCounts()
        self._loads: OrderedDict[str, _Load] = OrderedDict()
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="profllm-span-receiver", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{TRACES_PATH}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> SpanReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self) -> ReceiverCounts:
        """The counts now, a copy (`ReceiverCounts.since` tells a load's part)."""
        with self._changed:
            return ReceiverCounts(**self.counts.describe())

    def expect(self) -> str:
        """A new load's key: the spans of trace ids that begin with it are kept until `take`."""
        key = secrets.token_hex(KEY_HEX // 2)
        with self._changed:
            self._loads[key] = _Load()
            while len(self._loads) > MAX_SPAN_LOADS:  # a load never taken, the oldest first
                self._loads.popitem(last=False)
        return key

    def take(
        self, key: str, trace_ids: Collection[str], wait_s: float
    ) -> dict[str, ServerSpan]:
        """The load's spans by trace id, once every one of `trace_ids` has come or `wait_s`
        has passed; the load is then forgotten (a span that comes later is unexpected)."""
        deadline = time.monotonic() + max(0.0, wait_s)
        wanted = set(trace_ids)
        with self._changed:
            while True:
                load = self._loads.get(key)
                if load is None or wanted <= load.spans.keys():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            taken = self._loads.pop(key, None)
        return dict(taken.spans) if taken is not None else {}

    def accept(self, body: bytes, encoding: str | None = None) -> int:
        """Keep what an export holds of the expected loads; the HTTP status to answer."""
        try:
            if encoding == "gzip":
                body = _gunzip(body, self.max_body_bytes)
            spans = decode_export(body)
        except _TooLarge:
            return self._refused(413)
        except MalformedExport:
            return self._refused(400)
        with self._changed:
            self.counts.exports += 1
            for span in spans:
                self._keep(span)
            self._changed.notify_all()
        return 200

    def _keep(self, span: ServerSpan) -> None:
        self.counts.spans_received += 1
        load = self._loads.get(span.trace_id[:KEY_HEX])
        if load is None:
            self.counts.spans_unexpected += 1
        elif span.trace_id in load.spans:
            # A pooling request of several inputs: vLLM runs each as an engine request of its
            # own, with the request's trace context, so each exports a span of the same trace
            # id. The request ended with its last input: the span that ends last is kept.
            self.counts.spans_duplicate += 1
            if _ends_after(span, load.spans[span.trace_id]):
                load.spans[span.trace_id] = span
        elif len(load.spans) >= self.max_spans_per_load:
            self.counts.spans_over_limit += 1
        else:
            load.spans[span.trace_id] = span
            self.counts.spans_kept += 1

    def _refused(self, status: int) -> int:
        with self._changed:
            if status == 413:
                self.counts.refused_too_large += 1
            else:
                self.counts.refused_malformed += 1
        return status


def _ends_after(span: ServerSpan, kept: ServerSpan) -> bool:
    return span.e2e_s is not None and (kept.e2e_s is None or span.e2e_s > kept.e2e_s)


def _handler_for(receiver: SpanReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = _READ_TIMEOUT_S

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != TRACES_PATH:
                self._answer(404, close=True)
                return
            length = _length(self.headers.get("Content-Length"))
            if length is None:
                self._answer(receiver._refused(400), close=True)
                return
            if length > receiver.max_body_bytes:
                # The body is not read: the connection closes after the answer.
                self._answer(receiver._refused(413), close=True)
                return
            try:
                body = self.rfile.read(length)
            except OSError:  # the rest never came within the timeout
                self._answer(receiver._refused(400), close=True)
                return
            if len(body) < length:  # the sender gave up mid-body
                self._answer(receiver._refused(400), close=True)
                return
            encoding = (self.headers.get("Content-Encoding") or "").strip().lower() or None
            self._answer(receiver.accept(body, encoding))

        def _answer(self, status: int, close: bool = False) -> None:
            # An empty ExportTraceServiceResponse: no partial success to report.
            with contextlib.suppress(OSError):
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: a worker's output is the test report

    return Handler


def _length(text: str | None) -> int | None:
    if text is None or not text.strip().isdigit() or len(text) > 20:
        return None
    return int(text)


@contextlib.contextmanager
def receiving() -> Iterator[SpanReceiver]:
    """A receiver for the block's time, closed on the way out."""
    receiver = SpanReceiver()
    try:
        yield receiver
    finally:
        receiver.close()
