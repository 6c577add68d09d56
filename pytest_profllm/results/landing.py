"""The landing table `runs`, what `datasette results.db` opens on: who ran what, the swept axes
(the `server_*` / `bench_*` columns that took more than one value, tracked in
`benchmark_axes`) and the headline metrics, rounded, the unit in their names. It is a narrow
table derived from `benchmark_runs` (results/table.py), rebuilt when the swept axes change and
else kept up to date row by row: its rows are a few hundred bytes, not the 7 KB of a full row,
so filters, counts and facets over it stay fast at 100,000 runs. How Datasette shows it
(titles, facets, descriptions) is browse/plugin.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_profllm.results.table import TABLE, quote

LANDING = "runs"
# One row per `server_*` / `bench_*` column: its first value seen and whether another value
# was seen since (a swept axis, shown on the landing view and faceted by default).
AXES_TABLE = "benchmark_axes"
# The landing table shows at most this many swept axes (the rest stay one click away).
MAX_LANDING_AXES = 12


@dataclass(frozen=True)
class HeadlineMetric:
    """A metric shown on the landing table and compared by the canned queries (browse/)."""

    # Its column in `benchmark_runs`.
    column: str
    # Its name where it is shown: the unit in the name.
    name: str
    # The digits it is rounded to on the landing table (None: shown as stored).
    digits: int | None
    # The digits of its median per session in the canned comparisons (None: not compared).
    compared_digits: int | None = None


# The landing table's columns, in order: who and what, the swept axes, the headline metrics.
LANDING_IDENTITY = ("run_id", "timestamp", "status", "validity", "suite", "configuration",
                    "workload", "engine", "device", "server_model", "session_id", "system_host")
HEADLINE_METRICS = (
    HeadlineMetric("request_throughput", "req_per_s", 2, 3),
    HeadlineMetric("output_throughput", "output_tok_per_s", 1, 2),
    HeadlineMetric("median_ttft_ms", "median_ttft_ms", 1, 2),
    HeadlineMetric("p99_ttft_ms", "p99_ttft_ms", 1, 2),
    HeadlineMetric("median_tpot_ms", "median_tpot_ms", 2, 3),
    HeadlineMetric("p99_tpot_ms", "p99_tpot_ms", 2, 3),
    HeadlineMetric("median_itl_ms", "median_itl_ms", 2),
    HeadlineMetric("failed", "failed_requests", None),
)
# The landing columns Datasette facets on (browse/plugin.py's default facets that the landing
# table has): indexed, as the swept axes are.
LANDING_FACETS = ("server_model", "engine", "device", "suite", "status")


def landing_axes(swept: list[str]) -> list[str]:
    return [c for c in swept if c not in LANDING_IDENTITY][:MAX_LANDING_AXES]


def landing_sql(swept: list[str]) -> str:
    columns = [quote(c) for c in LANDING_IDENTITY]
    columns += [quote(c) for c in landing_axes(swept)]
    for metric in HEADLINE_METRICS:
        columns.append(f"{quote(metric.column)} AS {quote(metric.name)}" if metric.digits is None
                       else f"round({quote(metric.column)}, {metric.digits}) AS "
                       f"{quote(metric.name)}")
    columns.append("[failed_verdicts]")
    return f"SELECT {', '.join(columns)} FROM [{TABLE}]"


def refresh_landing(db: Any, swept: list[str], fresh: list[str], rebuild: bool) -> None:
    """Brings the landing table up to date in a load's transaction (`db`: a sqlite-utils
    Database): rebuilt where asked (`rebuild`: the swept axes changed) or where its columns are
    not the expected ones, else the rows of the `fresh` run ids replaced."""
    expected = [*LANDING_IDENTITY, *landing_axes(swept),
                *(metric.name for metric in HEADLINE_METRICS), "failed_verdicts"]
    existing = [row[1] for row in db.conn.execute(f"PRAGMA table_info([{LANDING}])")]
    is_table = db.conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (LANDING,)
    ).fetchone()
    if rebuild or not is_table or existing != expected:
        kind = db.conn.execute(
            "SELECT type FROM sqlite_master WHERE name = ?", (LANDING,)
        ).fetchone()
        if kind is not None:  # a view where an older store made one
            db.conn.execute(f"DROP {kind[0].upper()} [{LANDING}]")
        declared = {row[1]: row[2] for row in db.conn.execute(f"PRAGMA table_info([{TABLE}])")}
        columns = [f"{quote(name)} {declared.get(name, '')}" for name in LANDING_IDENTITY]
        columns[0] += " PRIMARY KEY"
        columns += [f"{quote(name)} {declared.get(name, '')}" for name in landing_axes(swept)]
        columns += [f"{quote(metric.name)} {declared.get(metric.column, 'REAL')}"
                    for metric in HEADLINE_METRICS]
        columns.append("[failed_verdicts] TEXT")
        db.conn.execute(f"CREATE TABLE [{LANDING}] ({', '.join(columns)})")
        db.conn.execute(f"INSERT INTO [{LANDING}] {landing_sql(swept)}")
        for column in ("timestamp", *LANDING_FACETS, *landing_axes(swept)):
            db.conn.execute(
                f"CREATE INDEX IF NOT EXISTS {quote(f'idx_{LANDING}_{column}')} ON [{LANDING}] "
                f"({quote(column)})"
            )
    elif fresh:
        db.conn.execute("CREATE TEMP TABLE IF NOT EXISTS profllm_fresh (run_id TEXT)")
        db.conn.execute("DELETE FROM profllm_fresh")
        db.conn.executemany("INSERT INTO profllm_fresh VALUES (?)", [(i,) for i in fresh])
        db.conn.execute(
            f"INSERT OR REPLACE INTO [{LANDING}] {landing_sql(swept)} "
            "WHERE run_id IN (SELECT run_id FROM profllm_fresh)"
        )
        db.conn.execute("DROP TABLE profllm_fresh")
    # The query planner's statistics: without them it can read thousands of rows through a
    # one-column index where a scan of another would read a hundred.
    # The landing table is narrow: all of it is analysed; the wide table by samples.
    db.conn.execute("PRAGMA analysis_limit = 0")
    db.conn.execute(f"ANALYZE [{LANDING}]")
    db.conn.execute("PRAGMA analysis_limit = 1000")
    db.conn.execute(f"ANALYZE [{TABLE}]")


class SweptAxes:
    """Which `server_*` / `bench_*` columns took more than one value: the swept axes."""

    def __init__(self, first: dict[str, Any], swept: set[str]) -> None:
        self.first = first
        self._swept = swept
        self._changed = False

    @classmethod
    def read(cls, db: Any) -> SweptAxes:
        db.conn.execute(
            f"CREATE TABLE IF NOT EXISTS [{AXES_TABLE}] "
            "([column] TEXT PRIMARY KEY, first_value, swept INTEGER NOT NULL)"
        )
        first, swept = {}, set()
        for column, value, is_swept in db.conn.execute(f"SELECT * FROM [{AXES_TABLE}]"):
            first[column] = value
            if is_swept:
                swept.add(column)
        return cls(first, swept)

    def watched(self, columns: list[str]) -> list[str]:
        """The columns that may be swept axes and are not known to be yet."""
        return [column for column in columns
                if column.startswith(("server_", "bench_")) and column not in self._swept]

    def see(self, columns: list[str], distinct_rows: list[tuple[Any, ...]]) -> None:
        """Takes note of the distinct values of `columns` in rows being loaded."""
        for column, seen in zip(columns, zip(*distinct_rows, strict=True), strict=True):
            if column not in self.first:
                self.first[column] = seen[0]
                self._changed = True
            if len(set(seen) | {self.first[column]}) > 1:
                self._swept.add(column)
                self._changed = True

    def swept(self) -> list[str]:
        return sorted(self._swept)

    def write(self, db: Any) -> bool:
        if self._changed:
            db.conn.executemany(
                f"INSERT OR REPLACE INTO [{AXES_TABLE}] VALUES (?, ?, ?)",
                [(name, value, name in self._swept) for name, value in self.first.items()],
            )
        return self._changed


def swept_axes(connection: Any) -> list[str]:
    """The swept axes recorded in a database (empty where there is no axes table)."""
    try:
        rows = connection.execute(f"SELECT [column] FROM [{AXES_TABLE}] WHERE swept ORDER BY 1")
    except Exception:  # no such table: a database loaded before axes were tracked
        return []
    return [row[0] for row in rows]
