"""How many runs hold each value of the columns the results pages facet on, counted by each
load (in its transaction) into `facet_counts`.

A facet of a page with no filter counts every run: about 0.1 s a column at a million runs,
even from an index, and a landing page facets on ten. browse/facets.py reads these counts
there instead; a filtered page groups its own rows. The counts are taken again whole by each
load that changed a row (a second or two at a million runs), never adjusted by difference: a
count the page shows is one SQLite gave for the rows as they are.
"""

from __future__ import annotations

import sqlite3

from pytest_profllm.results.landing import LANDING, LANDING_FACETS, landing_axes
from pytest_profllm.results.table import TABLE, TABLE_FACETS, quote

FACET_COUNTS = "facet_counts"
# One row per (table, column, value); a column's NULL row (its count of empty cells) is always
# there, so a column with no value at all is known to be counted.
_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS [{FACET_COUNTS}] (table_name TEXT NOT NULL, "
    "column_name TEXT NOT NULL, value, count INTEGER NOT NULL)"
)
_INDEX = (
    f"CREATE INDEX IF NOT EXISTS [idx_{FACET_COUNTS}] ON [{FACET_COUNTS}] "
    "(table_name, column_name, count DESC)"
)


def counted_columns(swept: list[str]) -> dict[str, tuple[str, ...]]:
    """The columns counted, by table: every column a page of it may facet on."""
    return {TABLE: TABLE_FACETS, LANDING: (*LANDING_FACETS, *landing_axes(swept))}


def refresh_facet_counts(connection: sqlite3.Connection, swept: list[str]) -> None:
    """Counts every value of the counted columns each table has, replacing the counts before
    (in the caller's open transaction)."""
    connection.execute(_SCHEMA)
    connection.execute(_INDEX)
    connection.execute(f"DELETE FROM [{FACET_COUNTS}]")
    for table, wanted in counted_columns(swept).items():
        present = {row[1] for row in connection.execute(f"PRAGMA table_info([{table}])")}
        for column in dict.fromkeys(name for name in wanted if name in present):
            connection.execute(
                f"INSERT INTO [{FACET_COUNTS}] SELECT ?, ?, {quote(column)}, count(*) "
                f"FROM [{table}] GROUP BY {quote(column)}", (table, column))
            if not connection.execute(
                    f"SELECT 1 FROM [{FACET_COUNTS}] WHERE table_name = ? AND column_name = ? "
                    "AND value IS NULL", (table, column)).fetchone():
                connection.execute(f"INSERT INTO [{FACET_COUNTS}] VALUES (?, ?, NULL, 0)",
                                   (table, column))


def correct_statistics(connection: sqlite3.Connection) -> None:
    """The planner's statistics of the wide table's counted columns, from their counts.

    The wide table is analysed by samples (results/landing.py): 1,000 entries of an index on
    a column of three models all hold one model, and the planner took a filter on any model
    to match 1,001 rows of a million. With that, a filter on a model and on eight sessions
    read a third of the runs through the model's index (1.2 s) instead of eight sessions'
    through theirs. The counts give the true rows per value, as a full ANALYZE would."""
    present = {row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE name IN (?, 'sqlite_stat1')", (FACET_COUNTS,))}
    if len(present) < 2:
        return
    # Distinct values: those counted, and empty cells as one where there are any.
    counted = connection.execute(
        "SELECT column_name, sum(count), count(value) + max(value IS NULL AND count > 0) "
        f"FROM [{FACET_COUNTS}] WHERE table_name = ? GROUP BY column_name", (TABLE,)
    ).fetchall()
    if not counted or not counted[0][1]:
        return
    rows = counted[0][1]
    # Every index's row count is the table's (the samples extrapolated 0.5 to 1.3 million).
    for index, stat in connection.execute(
            "SELECT idx, stat FROM sqlite_stat1 WHERE tbl = ?", (TABLE,)).fetchall():
        connection.execute("UPDATE sqlite_stat1 SET stat = ? WHERE tbl = ? AND idx = ?",
                           (" ".join([str(rows), *str(stat).split()[1:]]), TABLE, index))
    for column, _, values in counted:
        connection.execute(
            "UPDATE sqlite_stat1 SET stat = ? WHERE tbl = ? AND idx = ?",
            (f"{rows} {-(-rows // max(1, values))}", TABLE, f"idx_{TABLE}_{column}"))
