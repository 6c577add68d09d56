"""SQL functions the plugin registers on every connection Datasette opens (and the dashboards'
tests on theirs)."""

from __future__ import annotations

import sqlite3

from pytest_profllm.results.summaries import register_median


def register(connection: sqlite3.Connection) -> None:
    register_median(connection)  # the loads' summaries use it too
