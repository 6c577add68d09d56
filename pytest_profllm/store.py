"""The SQLite store: one row per record in `benchmark_runs`, one column per server argument,
workload parameter, metric and system figure, and the landing view `runs` over it.

Columns are prefixed by where they come from (`server_`, `bench_`, `system_`, `runtime_`);
metrics keep vLLM's names unprefixed. Column types come from the record's schema and the
engine-argument registry, never from the first value seen: a numeric parameter is REAL or
INTEGER, and an infinite request rate is stored as SQLite's REAL Infinity, so numeric filters
and sorts work. Loading is an upsert on `run_id` in one `BEGIN IMMEDIATE` transaction with a
busy timeout, in WAL mode: re-loading a record changes nothing, concurrent writers wait their
turn, readers (Datasette) read while a run writes, and a failed load leaves the database as
it was.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import operator
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_profllm import metrics

TABLE = "benchmark_runs"
# What `datasette results.db` opens on: who ran what, the swept axes, the headline metrics.
# A narrow table derived from `benchmark_runs` by the store (rebuilt when the swept axes
# change, else kept up to date row by row): its rows are a few hundred bytes, not the 7 KB of
# a full row, so filters, counts and facets over it stay fast at 100,000 runs.
LANDING = "runs"
# One row per `server_*` / `bench_*` column: its first value seen and whether another value
# was seen since (a swept axis, shown on the landing view and faceted by default).
AXES_TABLE = "benchmark_axes"
# Metric columns every table has, so that queries over them work whatever a suite measured.
STANDARD_METRICS = metrics.result_names(metrics.LATENCY_METRICS, (50.0, 90.0, 95.0, 99.0)) + list(
    metrics.CLIENT_HEALTH_KEYS
)
BUSY_TIMEOUT_MS = 30_000
PAGE_SIZE = 32_768
CACHE_KIB = 65_536
# Rows go to SQLite in batches: memory stays flat whatever the number of records.
BATCH = 500
# The landing table shows at most this many swept axes (the rest stay one click away).
MAX_LANDING_AXES = 12

# Columns of the record's top level and of derived values: (name, SQLite type).
_FIXED_COLUMNS: dict[str, str] = {
    "run_id": "TEXT",
    "session_id": "TEXT",
    "suite": "TEXT",
    "source": "TEXT",
    "case_id": "TEXT",
    "nodeid": "TEXT",
    "repeat_index": "INTEGER",
    "timestamp": "TEXT",
    "status": "TEXT",
    "message": "TEXT",
    "case_duration": "REAL",
    "engine": "TEXT",
    "engine_version": "TEXT",
    "engine_reason": "TEXT",
    "engine_distribution": "TEXT",
    "engine_args_version": "TEXT",
    "engine_args_source": "TEXT",
    # Derived, for grouping: the case without its workload, the workload without its repeat
    # number, and the devices it ran on.
    "configuration": "TEXT",
    "workload": "TEXT",
    "device": "TEXT",
    "thresholds": "TEXT",
    "verdicts": "TEXT",
    "profiling": "TEXT",
    "regression": "TEXT",
    "failed_verdicts": "TEXT",
    # A digest of the record: loading the same record again is recognised as unchanged.
    "record_digest": "TEXT",
}
_INTEGER_METRICS = {"completed", "failed", "total_input_tokens", "total_output_tokens"}
# Single-column indexes: the default facets and the filters people use most.
_INDEXED = (
    "suite",
    "case_id",
    "session_id",
    "timestamp",
    "status",
    "engine",
    "device",
    "configuration",
    "server_model",
)
# One covering index for the aggregating queries (charts, canned queries): they read these
# columns from the index, never the 400-column rows.
SUMMARY_COLUMNS = (
    # In the GROUP BY order of the queries, so they group as they scan, without sorting.
    "configuration",
    "engine",
    "device",
    "bench_random_input_len",
    "bench_random_output_len",
    "workload",
    "bench_request_rate",
    "bench_max_concurrency",
    "server_model",
    "suite",
    "case_id",
    "session_id",
    "timestamp",
    "status",
    "run_id",
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


@functools.cache
def column_types() -> dict[str, str]:
    """The SQLite type of every column the record schema and the registry define."""
    from pytest_profllm.engine_args import bundled
    from pytest_profllm.record import RuntimeInfo, SystemInfo
    from pytest_profllm.suite import BenchmarkConfig, LatencyConfig, ThroughputConfig

    types_ = dict(_FIXED_COLUMNS)
    for name, option in bundled().options.items():
        types_["server_" + name] = _OPTION_TYPES.get(option.kind, "TEXT")
    for prefix, model in (("bench_", BenchmarkConfig), ("bench_", ThroughputConfig),
                          ("bench_", LatencyConfig), ("system_", SystemInfo),
                          ("runtime_", RuntimeInfo)):
        for name, info in model.model_fields.items():
            # A name two workload kinds share (num_prompts) keeps the serving kind's type.
            types_.setdefault(prefix + name, _annotation_type(info.annotation))
    for name in (*metrics.COUNT_METRICS, *STANDARD_METRICS):
        types_[name] = "INTEGER" if name in _INTEGER_METRICS else "REAL"
    return types_


_OPTION_TYPES = {"int": "INTEGER", "float": "REAL", "bool": "INTEGER", "flag": "INTEGER"}


def _annotation_type(annotation: Any) -> str:
    # `float | None` is REAL; a list, a mapping or a Literal is TEXT (JSON or a word).
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = {_annotation_type(arg) for arg in typing.get_args(annotation)
                 if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else "TEXT"
    if annotation is bool or annotation is int:
        return "INTEGER"
    if annotation is float:
        return "REAL"
    return "TEXT"


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record flattened to one table row, each value of its column's type."""
    import orjson

    row: dict[str, Any] = {
        key: record.get(key)
        for key in (
            "run_id",
            "session_id",
            "suite",
            "source",
            "case_id",
            "nodeid",
            "repeat_index",
            "timestamp",
            "status",
            "message",
        )
    }
    # `duration` is the metric (vLLM's: the benchmark's requests); the whole case is apart.
    row["case_duration"] = record.get("duration")
    engine = record.get("engine") or {}
    row["engine"] = engine.get("name")
    row["engine_version"] = engine.get("version")
    row["engine_reason"] = engine.get("reason")
    row["engine_distribution"] = engine.get("distribution")
    config = record.get("config") or {}
    engine_args = config.get("engine_args") or {}
    row["engine_args_version"] = engine_args.get("vllm_version")
    row["engine_args_source"] = engine_args.get("source")
    case_id = str(record.get("case_id") or "")
    configuration, _, workload = case_id.rpartition("::")
    row["configuration"] = configuration or case_id
    row["workload"] = re.sub(r"-r\d+$", "", workload)
    system = record.get("system") or {}
    row["device"] = _device(system)
    # A row is built for every record of an ingest (100,000 of them, 400+ values each): the
    # blocks are copied in comprehensions, and only text in a numeric column is converted.
    for prefix, block in (("server_", config.get("server")), ("bench_", config.get("benchmark")),
                          ("", record.get("results")), ("system_", system),
                          ("runtime_", record.get("runtime"))):
        if block:
            names = _prefixed(prefix, tuple(block))
            row.update(zip(names, block.values(), strict=True))
            for name, value in zip(names, block.values(), strict=True):
                if value.__class__ is dict or value.__class__ is list:
                    row[name] = _cell(value)
    for key in ("thresholds", "verdicts", "profiling", "regression"):
        row[key] = _cell(record.get(key))
    row["failed_verdicts"] = (
        ",".join(
            verdict["metric"] for verdict in record.get("verdicts") or [] if not verdict["passed"]
        )
        or None
    )
    # Text in a numeric column ("inf" for an infinite request rate) comes from the workload
    # and the metrics; engine arguments arrive typed by the registry.
    numeric = _numeric_columns()
    for block, prefix in ((config.get("benchmark"), "bench_"), (record.get("results"), "")):
        for key, value in (block or {}).items():
            if value.__class__ is str and prefix + key in numeric:
                row[prefix + key] = _number(value)
    row["record_digest"] = hashlib.blake2b(
        orjson.dumps(record, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS),
        digest_size=12,
    ).hexdigest()
    return row


_PREFIXED: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}


def _prefixed(prefix: str, keys: tuple[str, ...]) -> tuple[str, ...]:
    # Records of one database share their key lists: the prefixed names are made once.
    names = _PREFIXED.get((prefix, keys))
    if names is None:
        names = _PREFIXED[(prefix, keys)] = tuple(prefix + key for key in keys)
    return names


@functools.cache
def _numeric_columns() -> frozenset[str]:
    return frozenset(name for name, kind in column_types().items() if kind in ("REAL", "INTEGER"))


def _device(system: dict[str, Any]) -> str:
    names = system.get("gpu_names") or []
    if not names:
        # vLLM's CPU build on the host's cores, or the simulator on virtual GPUs.
        if system.get("device_kind") == "virtual":
            return "virtual"
        return f"cpu: {system['device_name']}" if system.get("device_name") else "cpu"
    distinct = sorted(set(names))
    return " + ".join(f"{names.count(name)}x {name}" for name in distinct)


def _cell(value: Any) -> Any:
    # SQLite has no lists or mappings: store them as JSON text, which Datasette renders.
    if isinstance(value, dict | list):
        import orjson

        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return value


def _number(text: str) -> Any:
    # JSON has no infinity: records carry an infinite request rate as "inf". SQLite's REAL
    # holds it (Infinity), so `bench_request_rate > 10` and sorting treat it as a number.
    try:
        return float(text)
    except ValueError:
        return text


@dataclass
class LoadReport:
    """What a load did, by record: new rows, changed rows, rows already there as they are."""

    new: int = 0
    updated: int = 0
    unchanged: int = 0
    swept_axes: list[str] = field(default_factory=list)

    @property
    def stored(self) -> int:
        return self.new + self.updated + self.unchanged


def connect(db_path: Path, busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000) -> Any:
    """A sqlite-utils Database in WAL mode that waits up to `busy_timeout_s` for other
    writers (then sqlite3.OperationalError: database is locked)."""
    import sqlite3

    import sqlite_utils

    db_path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(sqlite3.connect(db_path, timeout=busy_timeout_s))
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    # A row is 5-10 KB (400+ columns, JSON of config classes): with SQLite's 4 KB pages each
    # row spills into overflow pages, which made loading twice as slow. The page size of a
    # new database only (WAL mode fixes it).
    db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
    db.enable_wal()
    # In WAL mode NORMAL still never corrupts the database; a power cut may lose the last
    # transaction, whose records are safe on disk as JSON.
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    return db


@dataclass
class RowBatch:
    """Rows as one column list and a tuple of values per row: what SQLite binds, and what
    crosses from a reading process to the writing one at a third of the cost of dicts."""

    columns: list[str]
    values: list[tuple[Any, ...]]

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]]) -> RowBatch:
        columns = list(dict.fromkeys(itertools.chain.from_iterable(rows)))
        return cls(columns, [tuple(map(row.get, columns)) for row in rows])

    def run_ids(self) -> list[str]:
        if not self.values:
            return []
        at = self.columns.index("run_id")
        return [row[at] for row in self.values]


def load_records(
    db_path: Path,
    records: Iterable[dict[str, Any]],
    busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000,
) -> int:
    """Upsert records into `benchmark_runs` in one transaction (all or nothing: a full disk or
    an error leaves the database as it was); returns how many of them the table now holds
    (new, changed or already there). Waits up to `busy_timeout_s` for another writer."""
    rows = [record_row(record) for record in records]
    if not rows:
        return 0
    return load_rows(db_path, [RowBatch.from_rows(rows)], busy_timeout_s=busy_timeout_s).stored


def load_rows(
    db_path: Path,
    batches: Iterable[RowBatch],
    progress: Callable[[int], None] | None = None,
    busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000,
) -> LoadReport:
    """Upsert batches of rows (from `record_row`) in one transaction, refresh the swept axes,
    their indexes and the landing table. `progress` is called with each batch's size."""
    report = LoadReport()
    db = connect(db_path, busy_timeout_s)
    try:
        db.conn.execute("BEGIN IMMEDIATE")
        try:
            _prepare(db)
            digests = dict(db.conn.execute(f"SELECT run_id, record_digest FROM [{TABLE}]"))
            axes = _Axes.read(db)
            fresh: list[str] = []
            for batch in batches:
                fresh += _load_batch(db, batch, digests, axes, report)
                if progress is not None:
                    progress(len(batch.values))
            changed = axes.write(db)
            report.swept_axes = axes.swept()
            _refresh_indexes(db)
            _refresh_landing(db, report.swept_axes, fresh, rebuild=changed)
            db.conn.execute("COMMIT")
        except BaseException:
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            raise
    finally:
        db.close()
    return report


def _prepare(db: Any) -> None:
    """The table with the schema's columns, an older table's mistyped columns retyped."""
    table = db.table(TABLE)
    typed = column_types()
    if not table.exists():
        table.create({name: _python_type(kind) for name, kind in typed.items()}, pk="run_id")
        return
    existing = table.columns_dict
    missing = {name: _python_type(kind) for name, kind in typed.items() if name not in existing}
    for name, kind in missing.items():
        table.add_column(name, kind)
    # Tables written before columns were typed by the schema: `bench_request_rate` was TEXT
    # because its first value was "inf". Retype them; "inf" becomes REAL Infinity.
    declared = {row[1]: row[2].upper() for row in db.conn.execute(f"PRAGMA table_info([{TABLE}])")}
    wrong = {name: _python_type(typed[name]) for name, kind in declared.items()
             if name in typed and typed[name] in ("REAL", "INTEGER") and kind == "TEXT"}
    if wrong:
        table.transform(types=wrong)
        for name in wrong:
            db.conn.execute(
                f"UPDATE [{TABLE}] SET [{name}] = 9e999 WHERE [{name}] IN ('inf', 'Infinity')"
            )
            db.conn.execute(
                f"UPDATE [{TABLE}] SET [{name}] = -9e999 WHERE [{name}] IN ('-inf', '-Infinity')"
            )


def _python_type(kind: str) -> type:
    return {"INTEGER": int, "REAL": float}.get(kind, str)


def _load_batch(
    db: Any,
    batch: RowBatch,
    digests: dict[str, str],
    axes: _Axes,
    report: LoadReport,
) -> list[str]:
    """Writes the rows that are new or changed; returns their run ids."""
    columns = batch.columns
    run_id_at, digest_at = columns.index("run_id"), columns.index("record_digest")
    values = []
    for row in batch.values:
        run_id, digest = row[run_id_at], row[digest_at]
        before = digests.get(run_id)
        if before == digest:
            report.unchanged += 1
            continue
        if before is not None:
            report.updated += 1
        else:
            report.new += 1
        digests[run_id] = digest
        values.append(row)
    if not values:
        return []
    table = db.table(TABLE)
    known = set(table.columns_dict)
    extra = [(at, name) for at, name in enumerate(columns) if name not in known]
    if extra:
        # Columns the schema does not know (an engine argument of a newer vLLM): typed by
        # their values, as sqlite-utils suggests.
        from sqlite_utils.utils import suggest_column_types

        suggested = suggest_column_types([{name: row[at] for at, name in extra}
                                          for row in values])
        for _, name in sorted(extra, key=lambda pair: pair[1]):
            table.add_column(name, suggested[name])
    # sqlite-utils' insert_all binds at most 999 values a statement: with a column per engine
    # argument (~420 columns) that is two rows a statement, 8x slower. The rows go in one
    # executemany.
    names = ", ".join(f"[{name}]" for name in columns)
    marks = ", ".join("?" for _ in columns)
    db.conn.executemany(f"INSERT OR REPLACE INTO [{TABLE}] ({names}) VALUES ({marks})", values)
    axes.see(columns, values)
    return [row[run_id_at] for row in values]


class _Axes:
    """Which `server_*` / `bench_*` columns took more than one value: the swept axes."""

    def __init__(self, first: dict[str, Any], swept: set[str]) -> None:
        self.first = first
        self._swept = swept
        self._changed = False

    @classmethod
    def read(cls, db: Any) -> _Axes:
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

    def see(self, columns: list[str], values: list[tuple[Any, ...]]) -> None:
        watched = [index for index, column in enumerate(columns)
                   if column.startswith(("server_", "bench_")) and column not in self._swept]
        if not watched:
            return
        # Rows of one batch mostly repeat a few configurations: their distinct axis tuples
        # (hashed at C speed) are few, and only those are looked at column by column.
        pick = operator.itemgetter(*watched) if len(watched) > 1 else (
            lambda row: (row[watched[0]],))
        distinct_rows = set(map(pick, values))
        for index, seen in zip(watched, zip(*distinct_rows, strict=True), strict=True):
            column = columns[index]
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


def _refresh_indexes(db: Any) -> None:
    for column in _INDEXED:
        db.conn.execute(
            f"CREATE INDEX IF NOT EXISTS [idx_{TABLE}_{column}] ON [{TABLE}] ([{column}])"
        )
    db.conn.execute(f"DROP INDEX IF EXISTS [idx_{TABLE}_summary]")  # an older column order
    db.conn.execute(
        f"CREATE INDEX IF NOT EXISTS [idx_{TABLE}_groups] ON [{TABLE}] "
        f"({', '.join(f'[{c}]' for c in SUMMARY_COLUMNS)})"
    )


def _refresh_landing(db: Any, swept: list[str], fresh: list[str], rebuild: bool) -> None:
    expected = [*LANDING_IDENTITY, *landing_axes(swept),
                *(name for _, name, _ in LANDING_METRICS), "failed_verdicts"]
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
        columns = [f"[{name}] {declared.get(name, '')}" for name in LANDING_IDENTITY]
        columns[0] += " PRIMARY KEY"
        columns += [f"[{name}] {declared.get(name, '')}" for name in landing_axes(swept)]
        columns += [f"[{name}] {declared.get(column, 'REAL')}"
                    for column, name, _ in LANDING_METRICS]
        columns.append("[failed_verdicts] TEXT")
        db.conn.execute(f"CREATE TABLE [{LANDING}] ({', '.join(columns)})")
        db.conn.execute(f"INSERT INTO [{LANDING}] {landing_sql(swept)}")
        for column in ("timestamp", *LANDING_FACETS, *landing_axes(swept)):
            db.conn.execute(
                f"CREATE INDEX IF NOT EXISTS [idx_{LANDING}_{column}] ON [{LANDING}] ([{column}])"
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


# The landing table's columns, in order: who and what, the swept axes, the headline metrics
# (rounded; the unit in the name).
LANDING_IDENTITY = ("run_id", "timestamp", "status", "suite", "configuration", "workload",
                    "engine", "device", "server_model", "session_id", "system_host")
LANDING_METRICS = (
    ("request_throughput", "req_per_s", 2),
    ("output_throughput", "output_tok_per_s", 1),
    ("median_ttft_ms", "median_ttft_ms", 1),
    ("p99_ttft_ms", "p99_ttft_ms", 1),
    ("median_tpot_ms", "median_tpot_ms", 2),
    ("p99_tpot_ms", "p99_tpot_ms", 2),
    ("median_itl_ms", "median_itl_ms", 2),
    ("failed", "failed_requests", None),
)


LANDING_FACETS = ("server_model", "engine", "device", "suite", "status")


def landing_axes(swept: list[str]) -> list[str]:
    return [c for c in swept if c not in LANDING_IDENTITY][:MAX_LANDING_AXES]


def landing_sql(swept: list[str]) -> str:
    columns = [f"[{c}]" for c in LANDING_IDENTITY]
    columns += [f"[{c}]" for c in landing_axes(swept)]
    for column, name, digits in LANDING_METRICS:
        columns.append(f"[{column}] AS [{name}]" if digits is None
                       else f"round([{column}], {digits}) AS [{name}]")
    columns.append("[failed_verdicts]")
    return f"SELECT {', '.join(columns)} FROM [{TABLE}]"


def swept_axes(connection: Any) -> list[str]:
    """The swept axes recorded in a database (empty where there is no axes table)."""
    try:
        rows = connection.execute(f"SELECT [column] FROM [{AXES_TABLE}] WHERE swept ORDER BY 1")
    except Exception:  # no such table: a database loaded before axes were tracked
        return []
    return [row[0] for row in rows]


def batched(items: Iterable[Any], size: int = BATCH) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)
