"""Which servers export each request's trace span (--profllm-trace-requests auto|on|off).

`auto` traces where tracing is cheap or where its figures are needed. The simulated engine's
servers are always traced: tracing cost them +0.27 +- 0.68 % of their throughput, under the
2 % the product allows (docs/developing/performance.md). vLLM's cost could not be bounded
under 2 % on a noisy host, so its servers are traced only where a session measures capacity
(the server group holds a `kind: capacity` case) or gates regressions (a case with a
`regression:` block, in a session with --profllm-baseline or --profllm-require-baseline, be it
a compare or the update that writes the baseline: both sides of a compare then run alike),
and only where vLLM's Python has OpenTelemetry (engine/otel.py). An untraced server's records
say why in `server_view.spans_problem`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from pytest_profllm.plan.case import Case

TraceMode = Literal["auto", "on", "off"]
TRACE_MODES: tuple[TraceMode, ...] = ("auto", "on", "off")

OFF = "not traced: --profllm-trace-requests is off"
AUTO_VLLM = (
    "not traced: --profllm-trace-requests auto traces vLLM servers for capacity and gate runs "
    "only (--profllm-trace-requests on traces every server)"
)


@dataclass(frozen=True)
class TraceChoice:
    """Whether a server is traced; where not, the record's one line on why (`why_not`), or
    the error that fails its cases (`error`: tracing asked for and impossible)."""

    traced: bool
    why_not: str | None = None
    error: str | None = None


def choose(
    mode: TraceMode,
    engine: str,
    wants_spans: bool,
    otel_missing: Callable[[], str | None],
) -> TraceChoice:
    """Whether a server of `engine` is traced; `wants_spans`: its group measures capacity or
    is gated (`wanting_spans`); `otel_missing`: why vLLM's Python cannot export spans, or
    None (asked only where it matters: it runs that Python once)."""
    if mode == "off":
        return TraceChoice(False, OFF)
    if engine != "vllm":  # the simulated engine exports its spans itself, cheaply
        return TraceChoice(True)
    if mode == "auto" and not wants_spans:
        return TraceChoice(False, AUTO_VLLM)
    missing = otel_missing()
    if missing is None:
        return TraceChoice(True)
    if mode == "on":
        return TraceChoice(False, error=f"--profllm-trace-requests on: {missing}")
    return TraceChoice(False, f"not traced: {missing}")


def wanting_spans(cases: Iterable[Case], gated: bool) -> frozenset[str]:
    """The server keys whose group measures capacity, or (`gated`: the session compares with
    or writes a baseline) holds a case the regression gate judges."""
    return frozenset(
        case.server_key
        for case in cases
        if case.kind == "capacity" or (gated and case.regression)
    )


@dataclass
class Tracing:
    """A worker's tracing policy: the mode, and the server keys `auto` traces on vLLM."""

    mode: TraceMode = "auto"
    wanting: frozenset[str] = field(default_factory=frozenset)

    def choose(
        self, case: Case, engine: str, otel_missing: Callable[[], str | None]
    ) -> TraceChoice:
        return choose(self.mode, engine, case.server_key in self.wanting, otel_missing)
