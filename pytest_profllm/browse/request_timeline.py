"""Where a slow request's time went, on the run page: each request's server span (queue,
prefill, decode; load/trace_join.py) and what the client added, from `request_samples`.

- `timeline`: one horizontal bar per request from its send, split into its parts, in order of
  arrival; at most `CAP` bars (the `SLOWEST_KEPT` slowest by E2E always, an even sample of the
  rest), its title saying how many of how many are shown;
- `slowest`: the `TOP` slowest requests by TTFT and by E2E, each with the part that dominated.

Only successful requests whose span was joined are drawn or ranked: a request without one
cannot be split.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_profllm.browse import charts
from pytest_profllm.results.gate_tables import SAMPLES

CAP = 500
SLOWEST_KEPT = 20
TOP = 10
# The parts of a request, in the order they happen (the client's share is drawn last: it
# falls partly before the server saw the request and partly after, in proportions the span
# does not tell), with their colours.
PARTS = ("queue", "prefill", "decode", "server, other", "client")
COLOURS = ("#e45756", "#f58518", "#4c78a8", "#bab0ac", "#54a24b")
_COLUMNS = (
    "request_index", "start_ms", "prompt_len", "output_tokens", "ttft_ms", "e2el_ms",
    "server_queue_ms", "server_prefill_ms", "server_decode_ms", "server_ttft_ms",
    "server_e2el_ms", "client_overhead_ttft_ms", "client_overhead_e2el_ms",
)
NO_SPANS = ("No request of this run has the server's span (it ran without "
            "--profllm-trace-requests, or its server exported none): no per-request timeline.")
NOT_KEPT = ("This database keeps no per-request server spans (loaded before they were kept): "
            "no per-request timeline.")


@dataclass(frozen=True)
class Request:
    """A successful request with its span: its figures in ms (parts never below zero)."""

    index: int
    start_ms: float
    prompt_len: int | None
    output_tokens: int | None
    ttft_ms: float | None
    e2el_ms: float
    queue: float
    prefill: float
    decode: float
    server_ttft: float
    server_e2el: float
    client_ttft: float
    client_e2el: float

    def parts(self, metric: str) -> dict[str, float]:
        """The request's `metric` (ttft or e2el) split into its parts, in ms."""
        if metric == "ttft":
            return {"queue": self.queue, "prefill": self.prefill,
                    "server, other": _left(self.server_ttft, self.queue + self.prefill),
                    "client": self.client_ttft}
        return {"queue": self.queue, "prefill": self.prefill, "decode": self.decode,
                "server, other": _left(self.server_e2el, self.queue + self.prefill + self.decode),
                "client": self.client_e2el}

    def dominant(self, metric: str) -> str:
        """The largest part, named with its figures."""
        parts = self.parts(metric)
        name = max(parts, key=lambda part: parts[part])
        total = sum(parts.values())
        share = f"{parts[name]:.1f} of {total:.1f} ms ({parts[name] / total:.0%})" if total else (
            "0 ms")
        return f"{_named(name, self)}: {share}"


def _left(total: float, parts: float) -> float:
    return max(total - parts, 0.0)


def _named(part: str, request: Request) -> str:
    if part == "prefill":
        return f"the prefill of a {_count(request.prompt_len)}-token prompt"
    if part == "decode":
        return f"the decode of {_count(request.output_tokens)} tokens"
    if part == "queue":
        return "the queue"
    if part == "client":
        return "the client (send, HTTP, stream)"
    return "the server outside its phases"


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _ms(value: Any) -> float:
    return max(float(value), 0.0) if isinstance(value, int | float) else 0.0


def requests(connection: sqlite3.Connection, run_id: str) -> tuple[list[Request], str | None]:
    """The run's successful requests with a span, in order of arrival; or why there are none
    (None where the run has no per-request rows at all: the page says that already)."""
    columns = {row[1] for row in connection.execute(f"PRAGMA table_info([{SAMPLES}])")}
    if not columns:
        return [], None
    if not set(_COLUMNS) <= columns:
        return [], NOT_KEPT
    rows = connection.execute(
        f"SELECT {', '.join(_COLUMNS)} FROM [{SAMPLES}] WHERE run_id = ? AND success "
        "ORDER BY start_ms, request_index", (run_id,)).fetchall()
    if not rows:
        return [], None
    found = [
        Request(index, float(start or 0.0), prompt, tokens, ttft, float(e2el), _ms(queue),
                _ms(prefill), _ms(decode), _ms(s_ttft), _ms(s_e2el), _ms(c_ttft), _ms(c_e2el))
        for (index, start, prompt, tokens, ttft, e2el, queue, prefill, decode, s_ttft, s_e2el,
             c_ttft, c_e2el) in rows
        if s_e2el is not None and e2el is not None
    ]
    return found, None if found else NO_SPANS


def sample(found: Sequence[Request], cap: int = CAP, slowest: int = SLOWEST_KEPT
           ) -> list[Request]:
    """At most `cap` of `found` (in order of arrival), in order of arrival: the `slowest` by
    E2E always, and an even sample of the rest over the load."""
    if len(found) <= cap:
        return list(found)
    kept = sorted(found, key=lambda r: -r.e2el_ms)[:slowest]
    chosen = {r.index for r in kept}
    rest = [r for r in found if r.index not in chosen]
    room = cap - len(kept)
    kept += [rest[i * len(rest) // room] for i in range(room)]
    return sorted(kept, key=lambda r: (r.start_ms, r.index))


def timeline(found: Sequence[Request]) -> tuple[dict[str, Any], str]:
    """The chart of the sampled requests and its caption."""
    shown = sample(found)
    slowest = {r.index for r in sorted(found, key=lambda r: -r.e2el_ms)[:SLOWEST_KEPT]}
    rows = []
    for row, request in enumerate(shown):
        parts = request.parts("e2el")
        point: dict[str, Any] = {"row": row, "row_end": row + 0.8, "request": request.index,
                                 "prompt_tokens": request.prompt_len,
                                 "output_tokens": request.output_tokens,
                                 "ttft_ms": _round(request.ttft_ms), "e2el_ms":
                                 _round(request.e2el_ms), "slowest": request.index in slowest}
        at = request.start_ms / 1000
        point["start_s"] = round(at, 4)
        for number, part in enumerate(PARTS):
            point[f"{part}_ms"] = _round(parts[part])
            at += parts[part] / 1000
            point[f"end{number}_s"] = round(at, 4)
        rows.append(point)
    count = f"{len(shown):,} of {len(found):,} requests shown"
    how = (f": the {SLOWEST_KEPT} slowest by E2E and an even sample of the rest"
           if len(shown) < len(found) else "")
    x_title = "seconds since the load started"
    tips = charts.tooltips("request", "start_s", "e2el_ms", "ttft_ms",
                           *(f"{part}_ms" for part in PARTS), "prompt_tokens", "output_tokens")
    y = charts.field("row", "quantitative", "requests, in order of arrival",
                     scale={"reverse": True, "domain": [0, max(len(shown), 1)], "nice": False},
                     axis={"labels": False, "ticks": False, "grid": False})
    layers: list[dict[str, Any]] = []
    for number, part in enumerate(PARTS):
        start = "start_s" if number == 0 else f"end{number - 1}_s"
        layers.append({
            "mark": {"type": "rect", "tooltip": True},
            "encoding": {
                "x": charts.field(start, "quantitative", x_title),
                "x2": {"field": f"end{number}_s"},
                "y": y, "y2": {"field": "row_end"},
                "color": {"datum": part, "type": "nominal", "title": "part of the request",
                          "scale": {"domain": list(PARTS), "range": list(COLOURS)}},
                "tooltip": tips,
            },
        })
    # The slowest marked at their end, so they are found among hundreds of bars.
    layers.append({
        "transform": [{"filter": "datum.slowest"}],
        "mark": {"type": "point", "shape": "triangle-left", "filled": True, "size": 40,
                 "color": "#222", "tooltip": True},
        "encoding": {"x": charts.field(f"end{len(PARTS) - 1}_s", "quantitative", x_title),
                     "y": {"field": "row", "type": "quantitative"}, "tooltip": tips},
    })
    height = min(max(12 * len(shown), 160), 640)
    chart = charts.spec(rows, title=f"Each request's time from its send: {count}",
                        height=height, layers=layers)
    caption = (
        f"{count}{how}. Each bar is one request from the moment the client sent it: the server's "
        "queue, prefill and decode (its span), the server's time outside them, then what the "
        "client added (sending, HTTP, reading the stream: drawn last, though part of it came "
        f"before the server saw the request). ◀ marks the {SLOWEST_KEPT} slowest by E2E.")
    return chart, caption


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@dataclass(frozen=True)
class Slowest:
    """One table of the slowest requests by a metric."""

    metric: str  # ttft, e2el
    title: str
    rows: list[dict[str, Any]]


def slowest(found: Sequence[Request], top: int = TOP) -> list[Slowest]:
    """The `top` slowest requests by TTFT, then by E2E, each with its parts and what
    dominated."""
    tables = []
    for metric, title in (("ttft", "TTFT"), ("e2el", "E2E")):
        def value(request: Request, metric: str = metric) -> float | None:
            return request.ttft_ms if metric == "ttft" else request.e2el_ms

        ranked = sorted((r for r in found if value(r) is not None),
                        key=lambda r: -(value(r) or 0.0))[:top]
        rows = []
        for rank, request in enumerate(ranked, start=1):
            parts = request.parts(metric)
            rows.append({
                "rank": rank, "request": request.index, "start_s": f"{request.start_ms / 1000:.3f}",
                "prompt": _count(request.prompt_len), "output": _count(request.output_tokens),
                "value": f"{value(request) or 0.0:.1f}",
                "parts": [f"{parts[part]:.1f}" if part in parts else "-" for part in PARTS],
                "dominant": request.dominant(metric),
            })
        if rows:
            tables.append(Slowest(metric, f"The {len(rows)} slowest by {title}", rows))
    return tables
