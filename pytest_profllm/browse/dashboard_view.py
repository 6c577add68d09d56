"""What a dashboard page shows (browse/dashboards/ builds it, browse/dashboard_pages.py
renders it): charts with captions, tables and notes; and a dashboard itself, a function from
a selection to that."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_profllm.browse.filters import Schema, Selection


@dataclass
class Table:
    """A table under the charts: `rows` are mappings from column to cell; a cell of
    `link_columns` links to the URL in `links[row index][column]`."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    links: list[dict[str, str]] = field(default_factory=list)
    empty: str = "Nothing to show for this selection."


@dataclass
class View:
    """What a dashboard shows: charts (id -> Vega-Lite spec), in order, with a caption each,
    tables, and notes (what was left out and why)."""

    charts: dict[str, dict[str, Any]] = field(default_factory=dict)
    captions: dict[str, str] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Inputs the dashboard takes besides the filter panel: name -> (label, value, choices).
    inputs: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)
    # Charts that take the page's whole width rather than half of it.
    wide: set[str] = field(default_factory=set)
    # The runs the page's counts of runs left out are of, where not the filter panel's (the
    # latest dashboard shows one session, not the latest of each suite).
    counted: Selection | None = None

    def add(self, chart_id: str, spec: dict[str, Any], caption: str,
            wide: bool = False) -> None:
        self.charts[chart_id] = spec
        self.captions[chart_id] = caption
        if wide:
            self.wide.add(chart_id)


@dataclass(frozen=True)
class Dashboard:
    name: str
    title: str
    question: str
    build: Callable[[sqlite3.Connection, Schema, Selection, Mapping[str, str]], View]
