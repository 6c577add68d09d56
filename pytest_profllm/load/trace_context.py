"""What ties a request to the server's span of it: a W3C `traceparent` and an `X-Request-Id`.

Every request the client sends carries `traceparent: 00-<trace id>-<span id>-01` (W3C Trace
Context, sampled), which vLLM takes as the parent of its `llm_request` span, so that span's
trace id is the request's (load/span_receiver.py). A trace id is 128 random bits, unique per
request; in a load whose spans are awaited, its first 64 bits are the load's key
(`SpanReceiver.expect`), which tells the receiver the span is one of that load's.
"""

from __future__ import annotations

import secrets

from pytest_profllm.load.metrics import RequestOutcome

_ZERO_SPAN = "0" * 16


def new_trace_id(key: str = "") -> str:
    """32 hex digits: `key` (16 hex digits, or none) followed by random ones."""
    trace_id = key + secrets.token_hex(16 - len(key) // 2)
    # All zeros is no trace id in W3C's rules; 2^-64 odds, but a rule is a rule.
    return trace_id if trace_id.strip("0") else new_trace_id(key)


def traceparent(trace_id: str) -> str:
    span_id = secrets.token_hex(8)
    return f"00-{trace_id}-{span_id if span_id != _ZERO_SPAN else '1' * 16}-01"


def request_headers(
    outcome: RequestOutcome, request_id: str | None, key: str = ""
) -> dict[str, str]:
    """The headers that name one request: its trace context, kept in `outcome.trace_id`, and
    its request id (a warmup's, which has no number, is its trace id)."""
    outcome.trace_id = new_trace_id(key)
    return {
        "x-request-id": request_id or f"profllm-{outcome.trace_id}",
        "traceparent": traceparent(outcome.trace_id),
    }
