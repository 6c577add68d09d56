"""The simulated engine's per-request trace spans, as vLLM exports them with
`--otlp-traces-endpoint URL`: one `llm_request` span per finished request, its parent the
request's W3C `traceparent`, with vLLM's attribute names in vLLM's units (seconds) and meaning
(vllm/v1/engine/output_processor.py `do_tracing`), taken from the timestamps its `/metrics`
histograms are taken from (sim/batching.py `_finished`), so the two agree request by request.

Spans leave as vLLM's SDK sends them: in batches (an OTLP/HTTP protobuf
`ExportTraceServiceRequest`, built with opentelemetry-proto's classes), from a thread of their
own, a short while after their request ended. A receiver that is down or refuses loses those
spans, never a request; a backlog over `MAX_QUEUED` drops the newest spans, counted.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pytest_profllm.load.span_receiver import (
    COMPLETION_TOKENS,
    DECODE,
    E2E,
    INFERENCE,
    PREFILL,
    PROMPT_TOKENS,
    QUEUE,
    REQUEST_ID,
    SPAN_NAME,
    TTFT,
)
from pytest_profllm.sim.batching import Sequence

log = logging.getLogger("profllm.sim")
# The batch span processor's defaults in vLLM's SDK are 5 s and 512 spans; a shorter delay
# lets a case collect its spans soon after its load (OTEL_BSP_SCHEDULE_DELAY sets it in ms).
DEFAULT_DELAY_S = 0.2
MAX_BATCH = 512
MAX_QUEUED = 2048  # the SDK's default queue size
_POST_TIMEOUT_S = 5.0
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parent_of(header: str | None) -> tuple[bytes, bytes] | None:
    """The trace id and parent span id of a W3C `traceparent`, or None where it is not one."""
    match = _TRACEPARENT.match((header or "").strip().lower())
    if match is None or match[1] == "ff":
        return None
    trace_id, span_id = bytes.fromhex(match[2]), bytes.fromhex(match[3])
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id


@dataclass(frozen=True)
class SpanTimes:
    """One finished request's phases, in seconds, as its span carries them."""

    queue: float
    ttft: float
    e2e: float
    prefill: float
    decode: float
    inference: float

    @classmethod
    def of(cls, sequence: Sequence) -> SpanTimes:
        # As sim/batching.py `_finished` observes vLLM's histograms.
        end = sequence.finished_at if sequence.finished_at is not None else sequence.arrived
        first = sequence.first_token_at if sequence.first_token_at is not None else end
        scheduled = sequence.scheduled_at if sequence.scheduled_at is not None else end
        return cls(
            queue=scheduled - sequence.queued,
            ttft=first - sequence.arrived,
            e2e=end - sequence.arrived,
            prefill=first - scheduled,
            decode=end - first,
            inference=end - scheduled,
        )


@dataclass(frozen=True)
class _Finished:
    parent: tuple[bytes, bytes] | None
    request_id: str
    start_ns: int
    end_ns: int
    times: SpanTimes
    prompt_tokens: int
    completion_tokens: int


class SpanExporter:
    """Exports the `llm_request` spans of finished requests to `endpoint` in batches."""

    def __init__(
        self,
        endpoint: str,
        clock: Callable[[], float] = time.perf_counter,
        delay_s: float = DEFAULT_DELAY_S,
    ) -> None:
        self.endpoint = endpoint
        self.delay_s = delay_s
        self.dropped = 0  # spans the backlog had no room for
        self.failed = 0  # spans of exports that did not reach the receiver
        self.sent = 0
        # The scheduler's clock to Unix nanoseconds, as the span's times are.
        self._clock = clock
        self._offset_ns = time.time_ns() - int(clock() * 1e9)
        self._queue: deque[_Finished] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._flush = False  # send what is queued now: the engine went idle
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="profllm-sim-spans", daemon=True)
        self._thread.start()

    def finished(
        self,
        sequence: Sequence,
        traceparent: str | None,
        request_id: str,
        pooled: bool = False,
        idle: bool = False,
    ) -> None:
        """The span of a request that ended (called on the event loop: only queues it). A
        pooled input generated nothing: vLLM counts no completion token for it. `idle`: the
        engine holds no other request, so a load has likely ended and its case is waiting
        for its spans: they go now, not at the next batch (vLLM's exporter would wait; the
        spans are the same)."""
        end = sequence.finished_at if sequence.finished_at is not None else self._clock()
        span = _Finished(
            parent=parent_of(traceparent),
            request_id=request_id,
            start_ns=self._offset_ns + int(sequence.arrived * 1e9),
            end_ns=self._offset_ns + int(end * 1e9),
            times=SpanTimes.of(sequence),
            prompt_tokens=sequence.prompt_len,
            completion_tokens=0 if pooled else sequence.generated,
        )
        with self._wake:
            if len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return
            self._queue.append(span)
            if idle:
                self._flush = True
            if self._flush or len(self._queue) >= MAX_BATCH:
                self._wake.notify()

    def close(self) -> None:
        """Send what is queued, then stop."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=2 * _POST_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._wake:
                if not (self._closing or self._flush) and len(self._queue) < MAX_BATCH:
                    self._wake.wait(self.delay_s)
                self._flush = False
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                closing = self._closing
            if batch:
                self._send(batch)
            if closing and not self._queue:
                return

    def _send(self, batch: list[_Finished]) -> None:
        body = export_body(batch)
        request = urllib.request.Request(
            self.endpoint, data=body, method="POST",
            headers={"Content-Type": "application/x-protobuf"},
        )
        try:
            with urllib.request.urlopen(request, timeout=_POST_TIMEOUT_S) as response:
                response.read()
            self.sent += len(batch)
        except (OSError, ValueError) as error:  # refused, down, a 4xx/5xx (HTTPError)
            self.failed += len(batch)
            if not self._warned:
                self._warned = True
                log.warning("trace export to %s failed: %s", self.endpoint, error)


def export_body(batch: list[_Finished]) -> bytes:
    """An ExportTraceServiceRequest of `batch`, serialized."""
    # Deferred, as each import below: opentelemetry-proto loads only in a simulator that
    # exports spans (the plugin imports the simulator's command line).
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    # Deferred: opentelemetry-proto.
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue

    # Deferred: opentelemetry-proto.
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    # Deferred: opentelemetry-proto.
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    def seconds(key: str, value: float) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(double_value=value))

    def count(key: str, value: int) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(int_value=value))

    spans = []
    for item in batch:
        trace_id, parent = item.parent or (secrets.token_bytes(16), b"")
        t = item.times
        spans.append(Span(
            trace_id=trace_id,
            span_id=secrets.token_bytes(8),
            parent_span_id=parent,
            name=SPAN_NAME,
            kind=Span.SpanKind.SPAN_KIND_SERVER,
            start_time_unix_nano=item.start_ns,
            end_time_unix_nano=item.end_ns,
            attributes=[
                seconds(TTFT, t.ttft), seconds(E2E, t.e2e), seconds(QUEUE, t.queue),
                count(PROMPT_TOKENS, item.prompt_tokens),
                count(COMPLETION_TOKENS, item.completion_tokens),
                seconds(PREFILL, t.prefill), seconds(DECODE, t.decode),
                seconds(INFERENCE, t.inference),
                KeyValue(key=REQUEST_ID, value=AnyValue(string_value=item.request_id)),
            ],
        ))
    resource = Resource(attributes=[
        KeyValue(key="service.name", value=AnyValue(string_value="vllm")),
    ])
    scope = InstrumentationScope(name="vllm.llm_engine")
    export = ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource=resource, scope_spans=[ScopeSpans(scope=scope, spans=spans)]),
    ])
    return export.SerializeToString()
