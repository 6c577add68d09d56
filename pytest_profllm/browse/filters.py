"""The filter panel of the dashboards: what the query string selects, as SQL over
`benchmark_runs`, and the filters saved by name (presets).

A selection has two parts:
- the sessions whose runs are drawn: by default the latest session of each suite (so every
  suite shows, each as it was last measured), else the sessions named, or all of them;
- conditions on any column: several values of one column (`f.<column>`, multi-select, ORed),
  a numeric range (`min.<column>`, `max.<column>`), and a text search over case ids (`q`).
  The conditions are ANDed (`match=all`, the default) or ORed (`match=any`).

Column names come from the query string, so they are checked against the table's columns
and quoted; every value is a bound parameter.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sqlite3
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pytest_profllm.browse import latest
from pytest_profllm.browse.latest import Session
from pytest_profllm.results.landing import swept_axes
from pytest_profllm.results.table import TABLE, quote

PRESETS_TABLE = "filter_presets"
# The value of a multi-select that stands for "no value" (SQL NULL).
NONE_VALUE = "(none)"
# Categorical columns every panel offers, with their labels.
FIXED_FILTERS = (
    ("server_model", "model"),
    ("engine", "engine"),
    ("device", "device"),
    ("suite", "suite"),
)
# Numeric ranges the panel offers for every database (any numeric column works by URL).
RANGE_FILTERS = (
    ("output_throughput", "output tok/s"),
    ("request_throughput", "req/s"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("p99_tpot_ms", "p99 TPOT ms"),
)
ALL_SESSIONS = "all"
# Query-string keys a preset keeps (the rest, such as a CSRF token, are not a filter).
_FILTER_PREFIXES = ("f.", "min.", "max.")
_FILTER_KEYS = ("q", "match", "session", "blend")


@dataclass(frozen=True)
class Schema:
    """What the panel needs to know of one database: its columns and their types, its swept
    axes, and its sessions (newest first)."""

    types: Mapping[str, str]
    axes: tuple[str, ...]
    sessions: tuple[Session, ...]

    def is_numeric(self, column: str) -> bool:
        return self.types.get(column, "").upper() in ("REAL", "INTEGER", "NUMERIC", "FLOAT")


@dataclass
class Selection:
    """A parsed query string: the sessions drawn and the conditions on the runs."""

    values: dict[str, list[str]] = field(default_factory=dict)
    low: dict[str, float] = field(default_factory=dict)
    high: dict[str, float] = field(default_factory=dict)
    text: str = ""
    match_any: bool = False
    # Empty: the latest session of each suite. ["all"]: every session.
    sessions: list[str] = field(default_factory=list)
    # Medians over the selected sessions together, instead of a series per session.
    blend: bool = False
    # What was refused in the query string, in words (an unknown column, not a number).
    problems: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, pairs: Iterable[tuple[str, str]], schema: Schema) -> Selection:
        selection = cls()
        for key, raw in pairs:
            value = raw.strip()
            if key.startswith(_FILTER_PREFIXES):
                prefix, column = key.split(".", 1)
                if column not in schema.types:
                    selection.problems.append(f"no column named {column!r}: filter ignored")
                    continue
                if prefix == "f":
                    if value:
                        selection.values.setdefault(column, []).append(value)
                    continue
                if not value:
                    continue
                try:
                    number = float(value)
                except ValueError:
                    number = math.nan
                if math.isnan(number):
                    selection.problems.append(f"{key}={value!r} is not a number: ignored")
                    continue
                (selection.low if prefix == "min" else selection.high)[column] = number
            elif key == "q":
                selection.text = value
            elif key == "match":
                selection.match_any = value == "any"
            elif key == "session" and value:
                selection.sessions.append(value)
            elif key == "blend":
                selection.blend = value not in ("", "0", "off")
        return selection

    def conditions(self, schema: Schema) -> tuple[str, list[Any]]:
        """The conditions as one SQL expression (TRUE when there are none) and its
        parameters."""
        parts: list[str] = []
        params: list[Any] = []
        for column, chosen in self.values.items():
            ors = []
            values = [v for v in chosen if v != NONE_VALUE]
            if values:
                ors.append(f"{quote(column)} IN ({', '.join('?' for _ in values)})")
                params.extend(_typed(v, schema.is_numeric(column)) for v in values)
            if NONE_VALUE in chosen:
                ors.append(f"{quote(column)} IS NULL")
            parts.append("(" + " OR ".join(ors) + ")")
        for column in sorted(set(self.low) | set(self.high)):
            bounds = []
            if column in self.low:
                bounds.append(f"{quote(column)} >= ?")
                params.append(self.low[column])
            if column in self.high:
                bounds.append(f"{quote(column)} <= ?")
                params.append(self.high[column])
            parts.append("(" + " AND ".join(bounds) + ")")
        if self.text:
            parts.append("(case_id LIKE ? ESCAPE '\\')")
            params.append("%" + _like_escape(self.text) + "%")
        if not parts:
            return "1", params
        return "(" + (" OR " if self.match_any else " AND ").join(parts) + ")", params

    def session_ids(self, schema: Schema) -> list[str] | None:
        """The sessions drawn (None: all of them)."""
        if ALL_SESSIONS in self.sessions:
            return None
        if self.sessions:
            return list(dict.fromkeys(self.sessions))
        return list(dict.fromkeys(
            pair.session_id for pair in latest.latest_of_each_suite(schema.sessions)))

    def scope(self, schema: Schema) -> tuple[str, list[Any]] | None:
        """The runs of the sessions drawn, as a WHERE expression over `benchmark_runs` (None:
        every run). By default the latest session of each suite, each with its suite's runs
        only (browse/latest.py)."""
        if ALL_SESSIONS in self.sessions:
            return None
        if not self.sessions:
            return latest.scope(latest.latest_of_each_suite(schema.sessions))
        sessions = list(dict.fromkeys(self.sessions))
        return f"session_id IN ({', '.join('?' for _ in sessions)})", sessions

    def where(self, schema: Schema) -> tuple[str, list[Any]]:
        """The sessions and the conditions, as a WHERE expression over `benchmark_runs`."""
        conditions, params = self.conditions(schema)
        scoped = self.scope(schema)
        if scoped is None:
            return conditions, params
        return f"{scoped[0]} AND {conditions}", [*scoped[1], *params]

    def query_pairs(self) -> list[tuple[str, str]]:
        """The selection as a query string's pairs (what a preset keeps, and links carry)."""
        pairs: list[tuple[str, str]] = []
        for column, values in self.values.items():
            pairs += [(f"f.{column}", value) for value in values]
        pairs += [(f"min.{column}", _number_text(v)) for column, v in self.low.items()]
        pairs += [(f"max.{column}", _number_text(v)) for column, v in self.high.items()]
        if self.text:
            pairs.append(("q", self.text))
        if self.match_any:
            pairs.append(("match", "any"))
        pairs += [("session", session) for session in self.sessions]
        if self.blend:
            pairs.append(("blend", "1"))
        return pairs

    def query_string(self) -> str:
        return urllib.parse.urlencode(self.query_pairs())

    def describe(self) -> str:
        """The selection in words, for the page's heading."""
        words = []
        if ALL_SESSIONS in self.sessions:
            words.append("all sessions")
        elif self.sessions:
            words.append("session " + ", ".join(self.sessions))
        else:
            words.append("the latest session of each suite")
        joiner = " or " if self.match_any else " and "
        conditions = [f"{column} in {', '.join(values)}" for column, values in self.values.items()]
        conditions += [f"{column} >= {_number_text(v)}" for column, v in self.low.items()]
        conditions += [f"{column} <= {_number_text(v)}" for column, v in self.high.items()]
        if self.text:
            conditions.append(f"case id contains {self.text!r}")
        if conditions:
            words.append("where " + joiner.join(conditions))
        return ", ".join(words)


def _typed(value: str, numeric: bool) -> Any:
    if not numeric:
        return value
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if number.is_integer() and abs(number) < 2**53 else number


def _number_text(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def filter_pairs(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs of a query string that are part of a selection."""
    return [(key, value) for key, value in pairs
            if key.startswith(_FILTER_PREFIXES) or key in _FILTER_KEYS]


def read_schema(connection: sqlite3.Connection) -> Schema:
    types = {row[1]: row[2] for row in connection.execute(f"PRAGMA table_info([{TABLE}])")}
    # The covering index (results/table.py) holds session_id, suite and timestamp: one scan
    # of it, never of the rows.
    rows = connection.execute(
        "SELECT session_id, min(timestamp), max(timestamp), count(*), "
        f"group_concat(DISTINCT suite) FROM [{TABLE}] GROUP BY session_id "
        "ORDER BY max(timestamp) DESC"
    ).fetchall()
    sessions = tuple(
        _session(connection, session_id, first, last, runs, suites)
        for session_id, first, last, runs, suites in rows if session_id is not None
    )
    axes = tuple(axis for axis in swept_axes(connection) if axis in types)
    return Schema(types, axes, sessions)


def _session(connection: sqlite3.Connection, session_id: str, first: str | None,
             last: str | None, runs: int, suites: str | None) -> Session:
    names: tuple[str, ...] = (suites or "",)
    if suites and "," in suites:
        # group_concat joins with a comma, which a suite's name may hold: ask again.
        names = tuple(sorted(row[0] or "" for row in connection.execute(
            f"SELECT DISTINCT suite FROM [{TABLE}] WHERE session_id = ?", (session_id,))))
    return Session(session_id, first or "", last or "", runs, names)


_T = TypeVar("_T")


class DatabaseMemo:
    """Values computed from a database file, kept until the file changes (its size or
    modification time, or its write-ahead log's): the session list takes one index scan,
    which at a million runs is worth not repeating on every page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], tuple[tuple[int, ...], Any]] = {}

    @staticmethod
    def state(path: str) -> tuple[int, ...]:
        marks: list[int] = []
        for name in (path, path + "-wal"):
            try:
                status = os.stat(name)
            except OSError:
                marks += [0, 0]
            else:
                marks += [status.st_mtime_ns, status.st_size]
        return tuple(marks)

    def get(self, path: str, key: str, compute: Callable[[], _T]) -> _T:
        state = self.state(path)
        with self._lock:
            cached = self._values.get((path, key))
        if cached is not None and cached[0] == state:
            value: _T = cached[1]
            return value
        value = compute()
        with self._lock:
            self._values[(path, key)] = (state, value)
        return value


@dataclass(frozen=True)
class Preset:
    name: str
    dashboard: str
    query: str
    saved_by: str | None
    saved_at: str


def presets(connection: sqlite3.Connection) -> list[Preset]:
    """The saved filters (none where the table does not exist yet)."""
    with contextlib.suppress(sqlite3.Error):
        return [Preset(*row) for row in connection.execute(
            f"SELECT name, dashboard, query, saved_by, saved_at FROM [{PRESETS_TABLE}] "
            "ORDER BY name")]
    return []


def save_preset(connection: sqlite3.Connection, name: str, dashboard: str,
                pairs: Iterable[tuple[str, str]], actor: str | None) -> Preset:
    """Saves (or replaces) a named filter: the selection part of a query string only."""
    name = name.strip()
    if not name or len(name) > 100:
        raise ValueError("a preset needs a name of 1 to 100 characters")
    query = urllib.parse.urlencode(filter_pairs(pairs))
    preset = Preset(name, dashboard, query, actor,
                    datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    with connection:
        connection.execute(
            f"CREATE TABLE IF NOT EXISTS [{PRESETS_TABLE}] (name TEXT PRIMARY KEY, "
            "dashboard TEXT NOT NULL, query TEXT NOT NULL, saved_by TEXT, saved_at TEXT)")
        connection.execute(
            f"INSERT OR REPLACE INTO [{PRESETS_TABLE}] VALUES (?, ?, ?, ?, ?)",
            (preset.name, preset.dashboard, preset.query, preset.saved_by, preset.saved_at))
    return preset


def option_values(connection: sqlite3.Connection, columns: Sequence[str], where: str,
                  params: Sequence[Any], limit: int = 200) -> dict[str, list[tuple[Any, int]]]:
    """The values of each of `columns` among the selected runs, with their counts: what the
    multi-selects offer. One pass over the runs (a query per column read them once each)."""
    counts: dict[str, Counter[Any]] = {column: Counter() for column in columns}
    if not columns:
        return {}
    cursor = connection.execute(
        f"SELECT {', '.join(quote(c) for c in columns)} FROM [{TABLE}] WHERE {where}",
        list(params))
    for row in cursor:
        for column, value in zip(columns, row, strict=True):
            counts[column][value] += 1
    return {column: sorted(counted.items(), key=lambda item: (item[0] is None, str(item[0])))
            [:limit] for column, counted in counts.items()}
