"""Where a run's time went, on its run page: the client's mean TTFT and E2E split by the
server's own histograms (load/server_view.py) into the engine's queue, its prefill and decode,
and the rest (the API server before the engine, the HTTP path and the client); and the
server's view as a table, each quantile with the bucket bounds it lies between."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_profllm.browse import charts

# (bar, the client's mean, the server's phases in it): vLLM's phases add up within a request
# (queue + prefill is the engine's share of TTFT; decode follows the first token).
_BARS = (
    ("mean TTFT", "mean_ttft_ms", ("queue", "prefill")),
    ("mean E2E", "mean_e2el_ms", ("queue", "prefill", "decode")),
)
_PARTS = {
    "queue": "server: queue",
    "prefill": "server: prefill",
    "decode": "server: decode",
    "rest": "API server, HTTP and client",
}
_COLOURS = ("#7a9cc6", "#2a7", "#d90", "#bbb")
# The narrowest part, as a share of the longest bar, that has its number written in it.
_MIN_LABELLED = 0.04
# The server's histograms as the table lists them (load/server_view.py's short names).
_TABLE = (
    ("ttft", "TTFT"), ("e2el", "E2E"), ("queue", "queue"), ("prefill", "prefill"),
    ("decode", "decode"), ("inference", "inference"), ("itl", "ITL"), ("tpot", "TPOT"),
    ("iteration_tokens", "tokens per step"), ("preemptions", "preemptions per request"),
)


@dataclass(frozen=True)
class Breakdown:
    spec: dict[str, Any]
    caption: str


def breakdown(row: Mapping[str, Any]) -> Breakdown | None:
    """The stacked bars of a run's mean TTFT and E2E, or None where the server kept no
    histograms (or the client measured no mean)."""
    parts: list[dict[str, Any]] = []
    said: list[str] = []
    for bar, client_key, phases in _BARS:
        client = row.get(client_key)
        read = [row.get(f"system_server_{phase}_mean_ms") for phase in phases]
        server = [float(value) for value in read if isinstance(value, int | float)]
        if not isinstance(client, int | float) or len(server) != len(phases):
            continue
        start = 0.0
        pieces = [*zip(phases, server, strict=True), ("rest", client - sum(server))]
        for phase, value in pieces:
            # A rest below zero is the two clocks' noise: drawn as nothing, said as it is.
            end = start + max(float(value), 0.0)
            parts.append({"bar": bar, "part": _PARTS[phase], "start": start, "end": end,
                          "mid": (start + end) / 2, "ms": value, "label": f"{value:.1f}"})
            start = end
        said.append(f"{bar} {client:.1f} ms = " + " + ".join(
            f"{phase} {value:.1f}" for phase, value in pieces))
    if not parts:
        return None
    # A part too narrow for its number keeps it in the tooltip and the caption only.
    widest = max(part["end"] for part in parts)
    for part in parts:
        if part["end"] - part["start"] < _MIN_LABELLED * widest:
            part["label"] = ""
    x = charts.field("start", "quantitative", "milliseconds (mean per request)")
    colour = charts.field("part", "nominal", "where the time went",
                          scale={"domain": list(_PARTS.values()), "range": list(_COLOURS)})
    # The bars' names say what they are: no axis title.
    y = {**charts.field("bar", "nominal", sort=[bar for bar, _, _ in _BARS]), "title": None}
    spec = charts.spec(
        parts, title="Where the time goes", height=110,
        layers=[
            {"mark": {"type": "bar", "tooltip": True},
             "encoding": {"x": x, "x2": {"field": "end"}, "y": y, "color": colour}},
            {"mark": {"type": "text", "fontSize": 11, "color": "#111"},
             "encoding": {"x": {"field": "mid", "type": "quantitative"}, "y": y,
                          "text": {"field": "label"}}},
        ],
    )
    caption = ("The client's mean split by the server's own histograms (vLLM's "
               "vllm:request_queue_time_seconds, _prefill_, _decode_): " + "; ".join(said)
               + " ms. The rest is the API server before the engine, the HTTP path and the "
               "client.")
    return Breakdown(spec, caption)


def server_table(row: Mapping[str, Any]) -> tuple[list[dict[str, str]], str | None]:
    """The server's histograms over the load as table rows (count, mean, and each quantile
    as the bucket that holds it, with the estimate within it), and why some or all are
    missing."""
    text = row.get("engine_view")
    try:
        view = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        view = None
    if not isinstance(view, dict):
        return [], None
    found = view.get("histograms")
    histograms: dict[str, Any] = found if isinstance(found, dict) else {}
    rows = []
    for short, title in _TABLE:
        figures = histograms.get(short)
        if not isinstance(figures, dict):
            continue
        unit = str(figures.get("unit") or "")
        rows.append({
            "name": title, "unit": unit, "count": _number(figures.get("count"), "{:,.0f}"),
            "mean": _number(figures.get("mean"), "{:.4g}"),
            **{label: _quantile(figures.get(label)) for label in ("median", "p90", "p99")},
        })
    problem = view.get("problem")
    return rows, str(problem) if problem else None


def _number(value: Any, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, int | float) else "-"


def _quantile(estimate: Any) -> str:
    if not isinstance(estimate, dict) or not isinstance(estimate.get("estimate"), int | float):
        return "-"
    upper = estimate.get("upper")
    bound = f"{upper:g}" if isinstance(upper, int | float) else "+Inf"
    # The bucket first: vLLM's buckets are coarse (its latencies' first ends at 300 ms), so
    # the interpolated estimate alone could read as a measured figure.
    return f"({estimate.get('lower', 0):g} .. {bound}], est. {estimate['estimate']:.4g}"
