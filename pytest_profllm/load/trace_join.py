"""Each request's own story: the client's row joined to the server's span of the same request.

After a load, the case takes the load's `llm_request` spans from the receiver
(load/span_receiver.py), waiting at most `SPAN_WAIT_S` for those still in the server's export
batch, and joins them to the client's requests by trace id (load/trace_context.py). Each
request row then holds the server's phases in milliseconds (queue, prefill, decode,
inference, TTFT, E2E) and token counts, and what the client added to that request alone
(client TTFT less server TTFT; the same for E2E). The load's figures are the spread of what
the client added (p50, p90, p99), beside the server view's means, and the share of the
completed requests whose span was joined. Where no span was joined, every figure is null and
`problem` says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.span_receiver import ReceiverCounts, ServerSpan, SpanReceiver

# How long a load's spans are awaited after its last response: vLLM's exporter sends every
# OTEL_BSP_SCHEDULE_DELAY (the plugin sets 200 ms; the simulator's default is the same), so
# spans still in a batch come well within it. The wait ends as soon as every span is in.
SPAN_WAIT_S = 2.0
NOT_TRACED = "not traced: --profllm-trace-requests is off"
NO_SPANS = (
    f"no llm_request span came within {SPAN_WAIT_S:g} s of the load's end: the server exports "
    "none (vLLM without OpenTelemetry installed, or started without --otlp-traces-endpoint)"
)
# A request row's keys from its span, in this order; null where its span was not joined.
ROW_KEYS = (
    "trace_id",
    "server_queue_ms",
    "server_prefill_ms",
    "server_decode_ms",
    "server_inference_ms",
    "server_ttft_ms",
    "server_e2el_ms",
    "server_prompt_tokens",
    "server_completion_tokens",
    "client_overhead_ttft_ms",
    "client_overhead_e2el_ms",
)
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))
JOINED_SHARE = "server_spans_joined_share"
# The load's figures (the record's `results`).
FIGURE_KEYS = (
    *(f"client_overhead_ttft_{name}_ms" for name, _ in PERCENTILES),
    *(f"client_overhead_e2el_{name}_ms" for name, _ in PERCENTILES),
    JOINED_SHARE,
)


@dataclass(frozen=True)
class Joined:
    rows: list[dict[str, Any]]  # one per outcome, in order: ROW_KEYS
    figures: dict[str, float | None]  # FIGURE_KEYS
    problem: str | None  # why no span was joined; None where any was
    duplicates: int = 0  # spans of a trace id already joined (the first is kept)
    # The server's own p99 TTFT (ms) over the joined requests' spans: exact, where the
    # histogram's is interpolated within a bucket. None where no span with a TTFT was joined.
    server_ttft_p99_ms: float | None = None
    # What the receiver counted during the load (`ReceiverCounts.describe`); None: not traced.
    receiver: dict[str, int] | None = None


def take_spans(
    receiver: SpanReceiver | None,
    key: str,
    outcomes: Sequence[RequestOutcome],
    wait_s: float = SPAN_WAIT_S,
    before: ReceiverCounts | None = None,
    not_traced: str | None = None,
) -> Joined:
    """The load's spans from `receiver` (None: not traced, `not_traced` says why), joined to
    its requests; with what the receiver counted since `before` (its `snapshot` as the load
    began)."""
    if receiver is None:
        return join(outcomes, None, not_traced or NOT_TRACED)
    wanted = [o.trace_id for o in outcomes if o.success and o.trace_id]
    spans = receiver.take(key, wanted, wait_s)
    joined = join(outcomes, spans.values(), NO_SPANS)
    if before is None:
        return joined
    return dataclasses.replace(joined, receiver=receiver.snapshot().since(before).describe())


def join(
    outcomes: Sequence[RequestOutcome],
    spans: Iterable[ServerSpan] | None,
    problem: str = NOT_TRACED,
) -> Joined:
    """Join `spans` to `outcomes` by trace id; `problem` is the reason given where none
    joins. Spans of no outcome (warmups, another load's) are left out."""
    by_trace: dict[str, ServerSpan] = {}
    duplicates = 0
    for span in spans or ():
        if span.trace_id in by_trace:
            duplicates += 1
        else:
            by_trace[span.trace_id] = span
    rows = [_row(outcome, by_trace.get(outcome.trace_id or "")) for outcome in outcomes]
    completed = [(row, o) for row, o in zip(rows, outcomes, strict=True) if o.success]
    joined = [row for row, o in completed if (o.trace_id or "") in by_trace]
    figures: dict[str, float | None] = dict.fromkeys(FIGURE_KEYS)
    if not joined:
        return Joined(rows, figures, problem, duplicates)
    figures[JOINED_SHARE] = len(joined) / len(completed)
    ttfts = [row["server_ttft_ms"] for row, o in completed
             if not o.pooled and row["server_ttft_ms"] is not None]
    server_p99 = float(np.percentile(np.array(ttfts, dtype=float), 99.0)) if ttfts else None
    for phase in ("ttft", "e2el"):
        values = [row[f"client_overhead_{phase}_ms"] for row in joined]
        present = np.array([v for v in values if v is not None], dtype=float)
        if present.size:
            for name, q in PERCENTILES:
                figures[f"client_overhead_{phase}_{name}_ms"] = float(np.percentile(present, q))
    return Joined(rows, figures, None, duplicates, server_p99)


def _row(outcome: RequestOutcome, span: ServerSpan | None) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row["trace_id"] = outcome.trace_id
    if span is None:
        return row
    row.update(
        server_queue_ms=_ms(span.queue_s),
        server_prefill_ms=_ms(span.prefill_s),
        server_decode_ms=_ms(span.decode_s),
        server_inference_ms=_ms(span.inference_s),
        server_ttft_ms=_ms(span.ttft_s),
        server_e2el_ms=_ms(span.e2e_s),
        server_prompt_tokens=span.prompt_tokens,
        server_completion_tokens=span.completion_tokens,
    )
    if outcome.success:
        if not outcome.pooled and span.ttft_s is not None:
            row["client_overhead_ttft_ms"] = (outcome.ttft - span.ttft_s) * 1000
        if span.e2e_s is not None:
            row["client_overhead_e2el_ms"] = (outcome.latency - span.e2e_s) * 1000
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
