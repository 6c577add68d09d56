"""The one definition of "the latest session" every page uses.

- The latest session of the database: the session that holds its newest run
  (`LATEST_SESSION_SQL`, `latest_session`), what the latest dashboard and the canned
  queries show.
- The latest session of each suite: for each suite, the newest session that ran it, and of
  that session only that suite's runs (`latest_of_each_suite`, `scope`), what every other
  dashboard and the filter panel draw by default. Selecting whole sessions instead drew a
  suite twice wherever its latest session was not the latest of another suite run beside it
  earlier: bars from one session and lines from the next, and medians over both.

Sessions are ordered by their newest run, newest first (`filters.read_schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pytest_profllm.results.table import TABLE

LATEST_SESSION_SQL = f"(SELECT session_id FROM [{TABLE}] ORDER BY timestamp DESC LIMIT 1)"


@dataclass(frozen=True)
class Session:
    session_id: str
    first: str
    last: str
    runs: int
    suites: tuple[str, ...]


@dataclass(frozen=True)
class SuiteSession:
    """One suite as one session measured it ("" for runs with no suite)."""

    suite: str
    session_id: str


def latest_session(sessions: Sequence[Session]) -> Session | None:
    """The session holding the newest run (`sessions` newest first)."""
    return sessions[0] if sessions else None


def latest_of_each_suite(sessions: Sequence[Session]) -> list[SuiteSession]:
    """For each suite, the newest session that ran it (`sessions` newest first)."""
    chosen: dict[str, str] = {}
    for session in sessions:
        for suite in session.suites:
            chosen.setdefault(suite, session.session_id)
    return [SuiteSession(suite, session_id) for suite, session_id in chosen.items()]


def scope(pairs: Sequence[SuiteSession]) -> tuple[str, list[Any]]:
    """The runs of these suites in these sessions, as a WHERE expression over
    `benchmark_runs` (or a view of it) and its parameters. The `session_id IN` part lets
    SQLite read the session index; the row values keep each session to its own suites."""
    if not pairs:
        return "0", []
    sessions = list(dict.fromkeys(pair.session_id for pair in pairs))
    marks = ", ".join("?" for _ in sessions)
    values = ", ".join("(?, ?)" for _ in pairs)
    params: list[Any] = [*sessions]
    for pair in pairs:
        params += [pair.session_id, pair.suite]
    return (f"(session_id IN ({marks}) AND (session_id, coalesce(suite, '')) IN "
            f"(VALUES {values}))", params)
