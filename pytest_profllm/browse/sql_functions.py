"""SQL functions the plugin registers on every connection Datasette opens (and the dashboards'
tests on theirs)."""

from __future__ import annotations

import sqlite3
import statistics
from typing import Any


class Median:
    """SQLite aggregate `median(x)`: charts combine repeats with it, never with a sum."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def step(self, value: Any) -> None:
        if isinstance(value, int | float):
            self.values.append(value)

    def finalize(self) -> float | None:
        return statistics.median(self.values) if self.values else None


def register(connection: sqlite3.Connection) -> None:
    connection.create_aggregate("median", 1, Median)  # type: ignore[arg-type]
