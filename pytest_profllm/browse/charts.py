"""Vega-Lite specs for our prepared pages, with their data inline: the SQL runs on the server
(each page's module), and these functions only say how the rows are drawn. Every chart is
full width and tall enough to read, and has tooltips; the browser draws it with the Vega-Lite
runtime that datasette-dashboards ships (browse/templates/profllm_base.html).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VEGA_LITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v6.json"
HEIGHT = 360
SMALL_HEIGHT = 220


def clean(value: Any) -> Any:
    """A cell as JSON can carry it: a non-finite number becomes null (Vega-Lite drops it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def rows_as_values(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{key: clean(value) for key, value in row.items()} for row in rows]


def spec(
    values: Sequence[Mapping[str, Any]],
    *,
    title: str,
    height: int = HEIGHT,
    layers: Sequence[Mapping[str, Any]] | None = None,
    **single: Any,
) -> dict[str, Any]:
    """A chart over `values`: either one view (`mark`, `encoding`, `transform`, ... as keyword
    arguments) or several `layers` over the same data."""
    chart: dict[str, Any] = {
        "$schema": VEGA_LITE_SCHEMA,
        "title": title,
        "width": "container",
        "height": height,
        "data": {"values": rows_as_values(values)},
        # A title starts where the plot does: centred over a plot that a wide legend has
        # narrowed, a long one ran off the chart's left edge.
        "config": {"legend": {"orient": "right", "labelLimit": 420, "titleLimit": 420},
                   "axis": {"labelLimit": 300}, "title": {"anchor": "start"}},
    }
    if layers is not None:
        chart["layer"] = list(layers)
    chart.update(single)
    return chart


def field(name: str, kind: str, title: str | None = None, **extra: Any) -> dict[str, Any]:
    """An encoding channel: `kind` is Vega-Lite's type (quantitative, nominal, ordinal,
    temporal)."""
    channel: dict[str, Any] = {"field": name, "type": kind, "title": title or name}
    channel.update(extra)
    return channel


# The most series a chart tells apart by colour: Vega's category20 has twenty.
MAX_COLOURS = 20


def series_colour(count: int, title: str = "configuration") -> dict[str, Any]:
    """The colour channel of `count` series named in the `series` field: ten colours while
    they are enough, else twenty (Vega's default ten would repeat a colour for the eleventh).
    Beyond twenty, colours repeat: the page says so (`too_many_series`)."""
    scheme = "category10" if count <= 10 else "category20"
    return field("series", "nominal", title, scale={"scheme": scheme})


def too_many_series(count: int, chart: str, narrow: str) -> str | None:
    """The note a page shows where a chart holds more series than it has colours."""
    if count <= MAX_COLOURS:
        return None
    return (f"{chart}: {count} series on one chart, more than its {MAX_COLOURS} colours tell "
            f"apart (colours repeat; the tooltip names each point): {narrow}.")


def tooltips(*names: str) -> list[dict[str, str]]:
    return [{"field": name, "title": name} for name in names]


def charts_json(charts: Mapping[str, Mapping[str, Any]]) -> str:
    """The page's charts as the JSON of its <script type="application/json">: `</` is escaped
    so no cell can close the script element."""
    return json.dumps(charts, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
