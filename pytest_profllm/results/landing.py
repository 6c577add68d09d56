"""The landing table `runs`, what `datasette results.db` opens on: who ran what, the swept axes
(the `server_*` / `bench_*` columns that took more than one value, tracked in
`benchmark_axes`) and the headline metrics, rounded, the unit in their names. It is a narrow
table derived from `benchmark_runs` (results/table.py), rebuilt when the swept axes change and
else kept up to date row by row: its rows are a few hundred bytes, not the 7 KB of a full row,
so filters, counts and facets over it stay fast at 100,000 runs. How Datasette shows it
(titles, facets, descriptions) is browse/plugin.py's.
"""

from __future__ import annotations

import json
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


# The landing table's columns, in order: the run, its status, regression and validity, the
# headline metrics and the axes (all on the first screen), then the thresholds it missed
# (`failed_verdicts`, a stable name of the store), where and when it ran.
LANDING_LEAD = ("run_id", "status", "gate", "validity", "suite", "workload")
LANDING_TAIL = ("failed_verdicts", "gate_changes", "timestamp", "configuration", "engine",
                "device", "server_model", "session_id", "system_host")
LANDING_IDENTITY = (*LANDING_LEAD, *LANDING_TAIL)
HEADLINE_METRICS = (
    HeadlineMetric("request_throughput", "req_per_s", 2, 3),
    HeadlineMetric("output_throughput", "output_tok_per_s", 1, 2),
    HeadlineMetric("median_ttft_ms", "median_ttft_ms", 1, 2),
    HeadlineMetric("p99_ttft_ms", "p99_ttft_ms", 1, 2),
    HeadlineMetric("median_tpot_ms", "median_tpot_ms", 2, 3),
    HeadlineMetric("p99_tpot_ms", "p99_tpot_ms", 2, 3),
    HeadlineMetric("median_itl_ms", "median_itl_ms", 2),
    HeadlineMetric("failed", "failed_requests", None),
    # An accuracy case's (lm-eval's names): multiple choice, and generated answers.
    HeadlineMetric("acc", "acc", 3),
    HeadlineMetric("exact_match", "exact_match", 3),
)
# The landing columns Datasette facets on (browse/plugin.py's default facets that the landing
# table has): indexed, as the swept axes are.
LANDING_FACETS = ("server_model", "engine", "device", "suite", "status", "gate", "validity")
# Derived from the regression gate's decisions (the `regression` JSON of benchmark_runs):
# `gate` is one word (regressed, not judged, improved, ok, no baseline; empty where nothing
# was gated: a metric not judged is never folded into `ok`),
# `gate_changes` says which metrics moved and by how much.
_REGRESSION = "json_each(CASE WHEN json_valid(regression) THEN regression ELSE '[]' END)"
# An item's decision: rows stored before the key `decision` say `verdict`.
_DECISION = "coalesce(json_extract(value, '$.decision'), json_extract(value, '$.verdict'))"
_GATE_SQL = (
    "(SELECT CASE WHEN count(*) = 0 THEN NULL "
    f"WHEN sum({_DECISION} = 'regressed') > 0 THEN 'regressed' "
    f"WHEN sum({_DECISION} = 'not-judged') > 0 THEN 'not judged' "
    f"WHEN sum({_DECISION} = 'improved') > 0 THEN 'improved' "
    f"WHEN sum({_DECISION} = 'no-baseline') = count(*) THEN 'no baseline' "
    f"ELSE 'ok' END FROM {_REGRESSION})"
)
_GATE_CHANGES_SQL = (
    "(SELECT group_concat(json_extract(value, '$.metric') || ' ' || "
    "printf('%+.1f%%', 100.0 * json_extract(value, '$.change')), ', ') "
    f"FROM {_REGRESSION} WHERE {_DECISION} IN ('regressed', 'improved'))"
)
# A skipped run measured nothing and is no measurement either way: its validity is empty here,
# so the landing page's validity facet never counts it as `invalid` (docs/results.md).
_VALIDITY_SQL = "CASE WHEN status = 'skipped' THEN NULL ELSE validity END"
_DERIVED = {"gate": _GATE_SQL, "gate_changes": _GATE_CHANGES_SQL, "validity": _VALIDITY_SQL}
_DERIVED_TYPES = {"gate": "TEXT", "gate_changes": "TEXT"}


def landing_axes(swept: list[str]) -> list[str]:
    return [c for c in swept if c not in LANDING_IDENTITY][:MAX_LANDING_AXES]


def landing_columns(swept: list[str]) -> list[str]:
    # The headline metrics before the axes: at 1400 pixels they are on the first screen.
    return [*LANDING_LEAD, *(metric.name for metric in HEADLINE_METRICS),
            *landing_axes(swept), *LANDING_TAIL]


def landing_sql(swept: list[str]) -> str:
    metrics = {metric.name: metric for metric in HEADLINE_METRICS}
    columns = []
    for name in landing_columns(swept):
        if name in _DERIVED:
            columns.append(f"{_DERIVED[name]} AS {quote(name)}")
        elif name in metrics:
            metric = metrics[name]
            columns.append(f"{quote(metric.column)} AS {quote(metric.name)}"
                           if metric.digits is None
                           else f"round({quote(metric.column)}, {metric.digits}) AS "
                           f"{quote(metric.name)}")
        else:
            columns.append(quote(name))
    return f"SELECT {', '.join(columns)} FROM [{TABLE}]"


def refresh_landing(db: Any, swept: list[str], fresh: list[str], rebuild: bool) -> None:
    """Brings the landing table up to date in a load's transaction (`db`: a sqlite-utils
    Database): rebuilt where asked (`rebuild`: the swept axes changed) or where its columns are
    not the expected ones, else the rows of the `fresh` run ids replaced."""
    expected = landing_columns(swept)
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
        metrics = {metric.name: metric.column for metric in HEADLINE_METRICS}
        columns = [f"{quote(name)} " + (_DERIVED_TYPES.get(name) or declared.get(
            metrics.get(name, name), "REAL" if name in metrics else "")) for name in expected]
        columns[0] += " PRIMARY KEY"
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
    skewed_statistics(db.conn)
    db.conn.execute("PRAGMA analysis_limit = 1000")
    db.conn.execute(f"ANALYZE [{TABLE}]")


# Columns whose rare values are the ones people filter on: almost every run is ungated or
# `ok`, and valid; `regressed` and `invalid` are a handful.
SKEWED = ("gate", "validity")
# Rows per value the planner is told to expect of them (ANALYZE's average says half the
# table: with it, at a million runs, `gate = 'regressed'` under a facet scanned every row
# through the facet column's index, 1.9 s, instead of reading the few regressed ones).
SKEWED_ROWS_PER_VALUE = 100


def skewed_statistics(connection: Any) -> None:
    """Tells SQLite's planner that a filter on a skewed column is selective, by the row of
    `sqlite_stat1` SQLite documents as editable for this."""
    for column in SKEWED:
        connection.execute(
            "UPDATE sqlite_stat1 SET stat = (CAST(stat AS INTEGER) || ' ' || ?) "
            "WHERE tbl = ? AND idx = ?",
            (SKEWED_ROWS_PER_VALUE, LANDING, f"idx_{LANDING}_{column}"))


class SweptAxes:
    """Which `server_*` / `bench_*` columns are a suite's axes: those the suite file declares
    as axes (a list; the record's `axes`), and those that took more than one value within one
    suite. An argument that merely differs between suites (one suite sets `block_size`,
    another keeps the default) is no axis of either. Kept per suite in `benchmark_axes`."""

    def __init__(self, first: dict[tuple[str, str], Any], swept: set[tuple[str, str]],
                 declared: set[tuple[str, str]]) -> None:
        self.first = first
        self._swept = swept
        self._declared = declared
        self._changed = False

    @classmethod
    def read(cls, db: Any) -> SweptAxes:
        existing = [row[1] for row in db.conn.execute(f"PRAGMA table_info([{AXES_TABLE}])")]
        if existing and "suite" not in existing:
            # Tracked across all suites by an older store: read again, per suite, for the
            # columns that varied at all (only they can vary within a suite).
            older = [row[0] for row in db.conn.execute(
                f"SELECT [column] FROM [{AXES_TABLE}] WHERE swept")]
            db.conn.execute(f"DROP TABLE [{AXES_TABLE}]")
            axes = cls._create(db)
            columns = [c for c in older if c in _table_columns(db)]
            if columns:
                axes.see(columns, db.conn.execute(
                    f"SELECT DISTINCT suite, NULL, {', '.join(quote(c) for c in columns)} "
                    f"FROM [{TABLE}]").fetchall())
            return axes
        return cls._create(db)

    @classmethod
    def _create(cls, db: Any) -> SweptAxes:
        db.conn.execute(
            f"CREATE TABLE IF NOT EXISTS [{AXES_TABLE}] (suite TEXT NOT NULL, [column] TEXT "
            "NOT NULL, first_value, swept INTEGER NOT NULL, declared INTEGER NOT NULL, "
            "PRIMARY KEY (suite, [column]))"
        )
        first, swept, declared = {}, set(), set()
        for suite, column, value, is_swept, is_declared in db.conn.execute(
            f"SELECT suite, [column], first_value, swept, declared FROM [{AXES_TABLE}]"
        ):
            first[(suite, column)] = value
            if is_swept:
                swept.add((suite, column))
            if is_declared:
                declared.add((suite, column))
        axes = cls(first, swept, declared)
        axes._changed = False
        return axes

    def watched(self, columns: list[str]) -> list[str]:
        """The columns that may be axes. Never the workload's seed: unless a suite sets it,
        each case draws its prompts from a seed of its own (plan/case.py), by design."""
        return [column for column in columns
                if column.startswith(("server_", "bench_")) and column != "bench_seed"]

    def see(self, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
        """Takes note of distinct rows being loaded: (suite, axes, *values of `columns`);
        `axes` is the record's JSON list of its suite's declared axes (or NULL)."""
        by_suite: dict[str, list[tuple[Any, ...]]] = {}
        declared_texts: dict[str, set[Any]] = {}
        for suite_value, declared, *values in rows:
            suite = "" if suite_value is None else str(suite_value)
            by_suite.setdefault(suite, []).append(tuple(values))
            declared_texts.setdefault(suite, set()).add(declared)
        for suite, texts in declared_texts.items():
            for text in texts:
                for column in _declared(text):
                    if (suite, column) not in self._declared:
                        self._declared.add((suite, column))
                        self._changed = True
        for suite, suite_rows in by_suite.items():
            # A column at a time, over the distinct rows: a load sees hundreds of columns.
            for column, seen in zip(columns, zip(*suite_rows, strict=True), strict=True):
                key = (suite, column)
                if key in self._swept:
                    continue
                if key not in self.first:
                    self.first[key] = seen[0]
                    self._changed = True
                # A set of the values (built in C; equal as == says, 1 and 1.0 alike): a load's
                # batch checks 400 columns of 500 distinct rows, and a generator comparing
                # each value took a second of CPU every 20,000 records.
                distinct = set(seen)
                if len(distinct) > 1 or self.first[key] not in distinct:
                    self._swept.add(key)
                    self._changed = True

    def swept(self) -> list[str]:
        """The axes, most telling first: declared by a suite file (by how many suites), then
        varied within a suite; never a JSON-valued column (a mapping is not a position on an
        axis, and as a facet it is a page of text)."""
        json_valued = {column for (_, column), value in self.first.items()
                       if isinstance(value, str) and value[:1] in ("{", "[")}
        declared: dict[str, int] = {}
        for _, column in self._declared:
            declared[column] = declared.get(column, 0) + 1
        varied = {column for _, column in self._swept}
        order = sorted(declared, key=lambda c: (-declared[c], c))
        order += sorted(varied - set(declared))
        return [c for c in order if c not in json_valued]

    def write(self, db: Any) -> bool:
        if self._changed:
            db.conn.executemany(
                f"INSERT OR REPLACE INTO [{AXES_TABLE}] VALUES (?, ?, ?, ?, ?)",
                [(suite, column, value, key in self._swept, key in self._declared)
                 for key, value in self.first.items() for suite, column in (key,)]
                + [(suite, column, None, False, True) for suite, column in self._declared
                   if (suite, column) not in self.first],
            )
        return self._changed


def _declared(value: Any) -> list[str]:
    if not isinstance(value, str) or not value.startswith("["):
        return []
    try:
        names = json.loads(value)
    except ValueError:
        return []
    return [name for name in names if isinstance(name, str)]


def _table_columns(db: Any) -> set[str]:
    return {row[1] for row in db.conn.execute(f"PRAGMA table_info([{TABLE}])")}


def swept_axes(connection: Any) -> list[str]:
    """The axes recorded in a database (empty where there is no axes table), in the order
    SweptAxes.swept gives them."""
    try:
        rows = connection.execute(
            f"SELECT suite, [column], first_value, swept, declared FROM [{AXES_TABLE}]"
        ).fetchall()
    except Exception:  # no such table, or an older one: a database loaded before
        return []
    first = {(suite, column): value for suite, column, value, _, _ in rows}
    return SweptAxes(first, {(r[0], r[1]) for r in rows if r[3]},
                     {(r[0], r[1]) for r in rows if r[4]}).swept()
