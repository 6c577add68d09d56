"""Each request's own story, without a server: the OTLP receiver (load/span_receiver.py) keeps
the expected loads' `llm_request` spans and refuses what is no export; the join
(load/trace_join.py) attaches them to the client's requests; the client's trace context
(load/trace_context.py); the simulator's spans (sim/spans.py) carry what its histograms do."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.span_receiver import (
    E2E,
    TTFT,
    ServerSpan,
    SpanReceiver,
    decode_export,
)
from pytest_profllm.load.trace_context import new_trace_id, request_headers
from pytest_profllm.load.trace_join import NO_SPANS, NOT_TRACED, join, take_spans
from pytest_profllm.sim.batching import ConstantStepCost, Scheduler, Sequence
from pytest_profllm.sim.spans import SpanTimes, _Finished, export_body, parent_of
from pytest_profllm.sim.stats import EngineStats


def export(*spans: tuple[str, str, float]) -> bytes:
    """An export of spans (name, trace id, TTFT seconds; E2E twice the TTFT)."""
    built = [
        Span(
            name=name, trace_id=bytes.fromhex(trace_id), span_id=b"\x01" * 8,
            attributes=[KeyValue(key=TTFT, value=AnyValue(double_value=ttft)),
                        KeyValue(key=E2E, value=AnyValue(double_value=2 * ttft))],
        )
        for name, trace_id, ttft in spans
    ]
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=built)])]
    )
    return request.SerializeToString()


@pytest.fixture
def receiver() -> Iterator[SpanReceiver]:
    with SpanReceiver(max_body_bytes=64 * 1024) as receiving:
        yield receiving


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    host, port = url.split("//")[1].split("/")[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("POST", "/v1/traces", body, headers or {})
        return connection.getresponse().status
    finally:
        connection.close()


def raw_post(url: str, head: bytes, body: bytes) -> bytes:
    """`head` and `body` on a socket whose write side then closes; the answer's first line."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        return sock.makefile("rb").readline()


def test_a_good_export_keeps_the_expected_loads_llm_request_spans(
    receiver: SpanReceiver,
) -> None:
    key = receiver.expect()
    mine, other = new_trace_id(key), new_trace_id(receiver.expect())
    stranger = new_trace_id()  # no load's: a start-up span, another session's
    body = export(("llm_request", mine, 0.01), ("llm_request", stranger, 0.02),
                  ("other_span", mine, 0.03), ("llm_request", other, 0.04))
    assert post(receiver.url, body) == 200
    spans = receiver.take(key, [mine], wait_s=0)
    assert list(spans) == [mine]
    assert spans[mine].ttft_s == 0.01 and spans[mine].e2e_s == 0.02
    assert receiver.counts.spans_unexpected == 1
    # gzip, as the SDK sends with OTEL_EXPORTER_OTLP_COMPRESSION=gzip; a late span (its load
    # was taken) is unexpected.
    zipped = gzip.compress(export(("llm_request", mine, 0.01)))
    assert post(receiver.url, zipped, {"Content-Encoding": "gzip"}) == 200
    assert receiver.counts.spans_unexpected == 2


def test_what_is_no_export_is_refused_and_counted(receiver: SpanReceiver) -> None:
    assert post(receiver.url, b"not a protobuf at all \xff") == 400
    assert post(receiver.url, b"\x1f\x8b junk", {"Content-Encoding": "gzip"}) == 400
    # A body cut short: the sender closed before its Content-Length.
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
    assert b" 400 " in raw_post(receiver.url, head, export(("llm_request", "ab" * 16, 0.1)))
    # A protobuf cut in the middle of a span.
    body = export(("llm_request", new_trace_id(receiver.expect()), 0.1))
    assert post(receiver.url, body[: len(body) // 2]) == 400
    assert receiver.counts.refused_malformed == 4
    # Over the bound: refused before it is read, as is a gzip that inflates over it.
    assert post(receiver.url, b"\0" * (64 * 1024 + 1)) == 413
    bomb = gzip.compress(b"\0" * (1 << 20))
    assert post(receiver.url, bomb, {"Content-Encoding": "gzip"}) == 413
    assert receiver.counts.refused_too_large == 2
    # Still serving.
    assert post(receiver.url, export()) == 200


def test_spans_over_the_loads_bound_are_dropped_and_counted() -> None:
    with SpanReceiver(max_spans_per_load=2) as receiver:
        key = receiver.expect()
        ids = [new_trace_id(key) for _ in range(3)]
        assert receiver.accept(export(*(("llm_request", i, 0.1) for i in ids))) == 200
        assert receiver.accept(export(("llm_request", ids[0], 0.5))) == 200
        assert len(receiver.take(key, ids, wait_s=0)) == 2
        assert receiver.counts.spans_over_limit == 1
        assert receiver.counts.spans_duplicate == 1


def test_take_waits_for_late_spans_and_no_longer_than_its_bound(receiver: SpanReceiver) -> None:
    key = receiver.expect()
    ids = [new_trace_id(key), new_trace_id(key)]
    receiver.accept(export(("llm_request", ids[0], 0.1)))
    later = threading.Timer(0.1, receiver.accept, [export(("llm_request", ids[1], 0.1))])
    later.start()
    try:
        started = time.monotonic()
        assert set(receiver.take(key, ids, wait_s=5)) == set(ids)
        assert time.monotonic() - started < 4  # it ended when the last came
    finally:
        later.join()
    missing = new_trace_id(key := receiver.expect())
    started = time.monotonic()
    assert receiver.take(key, [missing], wait_s=0.2) == {}
    assert 0.15 < time.monotonic() - started < 3


def outcome(trace_id: str, ttft: float = 0.05, latency: float = 0.2) -> RequestOutcome:
    return RequestOutcome(prompt_len=8, success=True, ttft=ttft, latency=latency,
                          trace_id=trace_id)


def span(trace_id: str, ttft: float = 0.04, e2e: float = 0.18) -> ServerSpan:
    return ServerSpan(trace_id=trace_id, ttft_s=ttft, e2e_s=e2e, queue_s=0.001, prefill_s=0.03,
                      decode_s=0.14, inference_s=0.17, prompt_tokens=8, completion_tokens=4)


def test_the_join_attaches_each_span_to_its_request() -> None:
    outcomes = [outcome(new_trace_id()) for _ in range(4)]
    ids = [o.trace_id or "" for o in outcomes]
    # One request's span missing, one sent twice (the first kept), one of no request.
    spans = [span(ids[0]), span(ids[1], ttft=0.01), span(ids[1], ttft=0.03), span(ids[2]),
             span(new_trace_id())]
    joined = join(outcomes, spans)
    assert joined.problem is None and joined.duplicates == 1
    assert joined.figures["server_spans_joined_share"] == 0.75
    first, second, _, last = joined.rows
    assert first["server_ttft_ms"] == pytest.approx(40)
    assert first["client_overhead_ttft_ms"] == pytest.approx(10)
    assert first["client_overhead_e2el_ms"] == pytest.approx(20)
    assert second["client_overhead_ttft_ms"] == pytest.approx(40)
    assert last["trace_id"] == ids[3] and last["server_ttft_ms"] is None
    assert joined.figures["client_overhead_ttft_p50_ms"] == pytest.approx(10)
    assert joined.figures["client_overhead_ttft_p99_ms"] == pytest.approx(39.4)
    # The server's own p99 TTFT, exact, over the joined spans (40, 10, 40 ms).
    assert joined.server_ttft_p99_ms == pytest.approx(40.0)


def test_a_loads_receiver_counts_are_what_came_during_it(receiver: SpanReceiver) -> None:
    """What the record keeps of the receiver: its counts between the load's start and its
    spans' taking; a malformed and an oversized export counted as refused, spans of no load
    (a warmup's) as unexpected."""
    assert post(receiver.url, b"before the load") == 400
    key = receiver.expect()
    before = receiver.snapshot()
    outcomes = [outcome(new_trace_id(key)) for _ in range(3)]
    ids = [o.trace_id or "" for o in outcomes]
    assert post(receiver.url, export(*(("llm_request", i, 0.01) for i in ids),
                                     ("llm_request", new_trace_id(), 0.01))) == 200
    assert post(receiver.url, b"\x0a\xff\xff not an export") == 400
    assert post(receiver.url, gzip.compress(b"\0" * (1 << 20)),
                {"Content-Encoding": "gzip"}) == 413
    joined = take_spans(receiver, key, outcomes, wait_s=5, before=before)
    assert joined.figures["server_spans_joined_share"] == 1.0
    assert joined.receiver == {
        "exports": 1, "refused_too_large": 1, "refused_malformed": 1, "spans_received": 4,
        "spans_kept": 3, "spans_unexpected": 1, "spans_over_limit": 0, "spans_duplicate": 0,
    }
    assert receiver.counts.refused_malformed == 2  # the session's, the earlier one too
    assert take_spans(receiver, receiver.expect(), outcomes, wait_s=0).receiver is None


def test_without_spans_every_figure_is_null_with_the_reason() -> None:
    outcomes = [outcome(new_trace_id())]
    untraced = take_spans(None, "", outcomes)
    assert untraced.problem == NOT_TRACED
    assert set(untraced.figures.values()) == {None}
    assert untraced.rows[0]["server_e2el_ms"] is None
    with SpanReceiver() as receiver:
        silent = take_spans(receiver, receiver.expect(), outcomes, wait_s=0)
    assert silent.problem == NO_SPANS and set(silent.figures.values()) == {None}


def test_every_request_names_itself() -> None:
    sent = RequestOutcome(prompt_len=1)
    headers = request_headers(sent, "profllm-7", "ab" * 8)
    assert headers["x-request-id"] == "profllm-7"
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, flags) == ("00", "01") and len(span_id) == 16
    assert trace_id == sent.trace_id and trace_id.startswith("ab" * 8) and len(trace_id) == 32
    assert parent_of(headers["traceparent"]) == (bytes.fromhex(trace_id), bytes.fromhex(span_id))
    warmup = RequestOutcome(prompt_len=1)
    assert request_headers(warmup, None)["x-request-id"] == f"profllm-{warmup.trace_id}"
    assert len({new_trace_id() for _ in range(1000)}) == 1000
    for bad in ("", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "ff-" + "1" * 32 + "-" + "1" * 16
                + "-01", "00-xyz"):
        assert parent_of(bad) is None


@settings(max_examples=50, deadline=None)
@given(
    queue=st.floats(0, 5), api=st.floats(0, 0.1), prefill=st.floats(0, 5),
    decode=st.floats(0, 50), tokens=st.integers(1, 10_000),
)
def test_the_simulators_span_carries_what_its_histograms_observe(
    queue: float, api: float, prefill: float, decode: float, tokens: int
) -> None:
    arrived = 1000.0
    sequence = Sequence(prompt_len=tokens, max_tokens=4, arrived=arrived, queued=arrived + api)
    sequence.scheduled_at = sequence.queued + queue
    sequence.first_token_at = sequence.scheduled_at + prefill
    sequence.finished_at = sequence.last_token_at = sequence.first_token_at + decode
    sequence.generated = 4
    stats = EngineStats()
    scheduler = Scheduler(ConstantStepCost(), max_num_seqs=4, max_num_batched_tokens=64,
                          stats=stats)
    scheduler._finished(sequence, sequence.finished_at)
    trace_id = new_trace_id()
    parent = parent_of(f"00-{trace_id}-{'2' * 16}-01")
    times = SpanTimes.of(sequence)
    body = export_body([_Finished(parent, "r-1", 0, 1, times, tokens, 4)])
    (decoded,) = decode_export(body)
    # TTFT is observed at the first token (sim/batching.py), the rest when the request ends.
    assert decoded.ttft_s == pytest.approx(api + queue + prefill, abs=1e-9)
    observed = {short: stats.histograms[name].total for short, name in (
        ("e2e_s", "vllm:e2e_request_latency_seconds"),
        ("queue_s", "vllm:request_queue_time_seconds"),
        ("prefill_s", "vllm:request_prefill_time_seconds"),
        ("decode_s", "vllm:request_decode_time_seconds"),
        ("inference_s", "vllm:request_inference_time_seconds"))}
    for attribute, total in observed.items():
        assert getattr(decoded, attribute) == pytest.approx(total, abs=1e-9)
    assert decoded.trace_id == trace_id and decoded.request_id == "r-1"
    assert (decoded.prompt_tokens, decoded.completion_tokens) == (tokens, 4)
