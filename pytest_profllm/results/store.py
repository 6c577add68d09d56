"""The SQLite store: one row per record in `benchmark_runs`, one column per server argument,
workload parameter, metric and system figure, and the landing view `runs` over it.

Columns are prefixed by where they come from (`server_`, `bench_`, `system_`, `runtime_`);
metrics keep vLLM's names unprefixed. Column types come from the record's schema and the
engine-argument registry, never from the first value seen: a numeric parameter is REAL or
INTEGER, and an infinite request rate is stored as SQLite's REAL Infinity, so numeric filters
and sorts work. Loading is an upsert on `run_id` in one `BEGIN IMMEDIATE` transaction with a
busy timeout, in WAL mode: re-loading a record changes nothing (its `record_digest`, of its
file's bytes, is the same), concurrent writers wait their turn, readers (Datasette) read
while a run writes, and a failed load leaves the database as it was.

Rows reach the table staged: whoever reads the records (`profllm ingest`'s worker processes)
writes them into an in-memory SQLite database, and the one writing process copies them over
in C.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import operator
import re
import sqlite3
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_profllm.load import metrics

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
    # A digest of the record's file: loading the same file again is recognised as unchanged
    # (without reading it: ingest digests the bytes and skips a file whose digest is stored).
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
    from pytest_profllm.engine.registry import bundled
    from pytest_profllm.plan.suite import BenchmarkConfig, LatencyConfig, ThroughputConfig
    from pytest_profllm.results.record import RuntimeInfo, SystemInfo

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


def record_digest(content: bytes) -> str:
    """The digest of a record file's bytes: the same file loaded again is unchanged."""
    return hashlib.blake2b(content, digest_size=12).hexdigest()


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record flattened to one table row, each value of its column's type."""
    rows = RowBuilder()
    rows.add(record)
    (batch,) = rows.batches()
    return dict(zip(batch.columns, batch.values[0], strict=True))


# The record's blocks, in row order, with the prefix of their columns.
_BLOCK_PREFIXES = ("server_", "bench_", "", "system_", "runtime_")
_FIXED = tuple(_FIXED_COLUMNS)
_CONTAINERS = frozenset((dict, list))
_EMPTY_JSON = {dict: "{}", list: "[]"}
_REPEAT_SUFFIX = re.compile(r"-r\d+$")


class RowBuilder:
    """Records to rows, grouped in batches by shape (the keys of their blocks).

    An ingest builds 100,000 rows of 400+ values. Records of one database share a few
    shapes, so the column names, the positions of numeric values and the handling of a key
    two blocks share are worked out once per shape; a row is then the record's block values
    in one tuple, with only the JSON cells and text in numeric columns converted.
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[tuple[str, ...], ...], _Shape] = {}

    def add(self, record: dict[str, Any], digest: str | None = None) -> None:
        """Adds a record's row. `digest` is its file's `record_digest`; without it, that of
        the bytes its file is written with."""
        if digest is None:
            from pytest_profllm.results.record import record_bytes

            digest = record_digest(record_bytes(record))
        config = record.get("config") or {}
        blocks = (config.get("server") or {}, config.get("benchmark") or {},
                  record.get("results") or {}, record.get("system") or {},
                  record.get("runtime") or {})
        key = tuple(map(tuple, blocks))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape.of(key)
        values = list(_fixed_values(record, digest))
        for block in blocks:
            values += block.values()
        # SQLite has no lists or mappings: they are stored as JSON text.
        for at in itertools.compress(range(len(values)),
                                     map(_CONTAINERS.__contains__, map(type, values))):
            value = values[at]
            values[at] = _json_text(value) if value else _EMPTY_JSON[value.__class__]
        # JSON has no infinity: records carry an infinite request rate as "inf".
        for at in shape.numeric:
            if values[at].__class__ is str:
                values[at] = _number(values[at])
        shape.rows.append(tuple(values) if shape.keep is None else shape.keep(values))

    def batches(self) -> list[RowBatch]:
        return [RowBatch(shape.columns, shape.rows) for shape in self._shapes.values()]


@dataclass
class _Shape:
    columns: list[str]
    # The positions of text that may be a number: workload parameters and metrics.
    numeric: tuple[int, ...]
    # Where two blocks share a column name, the first value (the record's top level first)
    # is kept: a metric named like a fixed column never overwrites it.
    keep: Callable[[list[Any]], tuple[Any, ...]] | None
    rows: list[tuple[Any, ...]] = field(default_factory=list)

    @classmethod
    def of(cls, key: tuple[tuple[str, ...], ...]) -> _Shape:
        names = list(_FIXED)
        numeric_columns = _numeric_columns()
        numeric = []
        for prefix, keys in zip(_BLOCK_PREFIXES, key, strict=True):
            for name in (prefix + key for key in keys):
                if prefix in ("bench_", "") and name in numeric_columns:
                    numeric.append(len(names))
                names.append(name)
        first = {name: at for at, name in reversed(list(enumerate(names)))}
        if len(first) == len(names):
            return cls(names, tuple(numeric), None)
        kept = sorted(first.values())
        return cls([names[at] for at in kept], tuple(numeric),
                   lambda values: tuple(values[at] for at in kept))


def _fixed_values(record: dict[str, Any], digest: str) -> tuple[Any, ...]:
    """The values of `_FIXED_COLUMNS`, in their order."""
    engine = record.get("engine") or {}
    engine_args = (record.get("config") or {}).get("engine_args") or {}
    case_id = str(record.get("case_id") or "")
    configuration, _, workload = case_id.rpartition("::")
    verdicts = record.get("verdicts")
    failed = ",".join(verdict["metric"] for verdict in verdicts or () if not verdict["passed"])
    return (
        record.get("run_id"),
        record.get("session_id"),
        record.get("suite"),
        record.get("source"),
        record.get("case_id"),
        record.get("nodeid"),
        record.get("repeat_index"),
        record.get("timestamp"),
        record.get("status"),
        record.get("message"),
        # `duration` is the metric (vLLM's: the benchmark's requests); the whole case apart.
        record.get("duration"),
        engine.get("name"),
        engine.get("version"),
        engine.get("reason"),
        engine.get("distribution"),
        engine_args.get("vllm_version"),
        engine_args.get("source"),
        # For grouping: the case without its workload, the workload without its repeat
        # number, the devices it ran on.
        configuration or case_id,
        _REPEAT_SUFFIX.sub("", workload),
        _device(record.get("system") or {}),
        record.get("thresholds"),
        verdicts,
        record.get("profiling"),
        record.get("regression"),
        failed or None,
        digest,
    )


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


def _json_text(value: dict[str, Any] | list[Any]) -> str:
    import orjson

    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()


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


def connect(
    db_path: Path, busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000, wal: bool = True
) -> Any:
    """A sqlite-utils Database in WAL mode (`wal`; else as the file is) that waits up to
    `busy_timeout_s` for other writers (then sqlite3.OperationalError: database is locked)."""
    import sqlite_utils

    db_path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(sqlite3.connect(db_path, timeout=busy_timeout_s))
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    # A row is 5-10 KB (400+ columns, JSON of config classes): with SQLite's 4 KB pages each
    # row spills into overflow pages, which made loading twice as slow. The page size of a
    # new database only (WAL mode fixes it).
    db.execute(f"PRAGMA page_size = {PAGE_SIZE}")
    if wal:
        db.enable_wal()
    # In WAL mode NORMAL still never corrupts the database; a power cut may lose the last
    # transaction, whose records are safe on disk as JSON.
    db.execute("PRAGMA synchronous = NORMAL")
    db.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    return db


@dataclass
class RowBatch:
    """Rows as one column list and a tuple of values per row."""

    columns: list[str]
    values: list[tuple[Any, ...]]

    def column(self, name: str) -> list[Any]:
        if not self.values:
            return []
        at = self.columns.index(name)
        return [row[at] for row in self.values]

    def run_ids(self) -> list[str]:
        return self.column("run_id")


# The in-memory database a batch of rows is staged in. Its `rows` table holds each row's own
# columns and the id of its server block in `servers`: the records of one server
# configuration (every workload, every repeat) share one block of 300+ engine arguments.
_STAGE = "profllm_stage"
_SERVER_ID = "profllm_server"


@dataclass
class StagedRows:
    """Rows written into an in-memory SQLite database and serialized: what a reading process
    hands the writing one, which copies them into the table in C. Binding 400+ values a row
    from Python cost the writer 0.13 ms a row (the copy: 0.025 ms), and the writer is the
    one process an ingest cannot multiply."""

    row_columns: list[str]
    server_columns: list[str]
    run_ids: list[str]
    digests: list[str]
    image: bytes

    @property
    def columns(self) -> list[str]:
        return self.row_columns + self.server_columns

    def select(self, columns: list[str], where: str = "", distinct: bool = False) -> str:
        """A query of `columns` over the staged rows (`where`: a condition on `rows`)."""
        servers = set(self.server_columns)
        named = ", ".join(("s." if name in servers else "r.") + _names([name])
                          for name in columns)
        return (f"SELECT {'DISTINCT ' if distinct else ''}{named} FROM {_STAGE}.rows AS r "
                f"LEFT JOIN {_STAGE}.servers AS s ON s.{_SERVER_ID} = r.{_SERVER_ID}"
                + (f" WHERE r.{where}" if where else ""))


def stage(batches: list[RowBatch]) -> StagedRows | None:
    """Rows in stage order (batch by batch), each distinct server block stored once; None
    where there are none."""
    batches = [batch for batch in batches if batch.values]
    if not batches:
        return None
    columns = list(dict.fromkeys(itertools.chain.from_iterable(b.columns for b in batches)))
    server_columns = [name for name in columns if name.startswith("server_")]
    row_columns = [name for name in columns if not name.startswith("server_")]
    run_ids: list[str] = []
    digests: list[str] = []
    connection = sqlite3.connect(":memory:")
    try:
        connection.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        # Untyped columns: values stay as bound until the table's own types apply.
        connection.execute(f"CREATE TABLE rows ({_names([*row_columns, _SERVER_ID])})")
        connection.execute(f"CREATE TABLE servers ({_SERVER_ID} INTEGER PRIMARY KEY"
                           + "".join(f", {_names([name])}" for name in server_columns) + ")")
        shapes: dict[tuple[str, ...], int] = {}
        server_ids: dict[tuple[Any, ...], int] = {}
        for batch in batches:
            _stage_batch(connection, batch, shapes, server_ids)
            run_ids += batch.run_ids()
            digests += batch.column("record_digest")
        connection.commit()
        return StagedRows(row_columns, server_columns, run_ids, digests,
                          connection.serialize())
    finally:
        connection.close()


def _stage_batch(
    connection: Any,
    batch: RowBatch,
    shapes: dict[tuple[str, ...], int],
    server_ids: dict[tuple[Any, ...], int],
) -> None:
    server_at = [at for at, name in enumerate(batch.columns) if name.startswith("server_")]
    row_at = [at for at, name in enumerate(batch.columns) if not name.startswith("server_")]
    server_names = [batch.columns[at] for at in server_at]
    # A block's key: its columns (as the number of their list), its values and their types.
    # 1, 1.0 and True are equal in Python, not in a TEXT column.
    shape = shapes.setdefault(tuple(server_names), len(shapes))
    pick_server, pick_row = _picker(server_at), _picker(row_at)
    rows, new_servers = [], []
    for values in batch.values:
        block = pick_server(values)
        key = (shape, block, tuple(map(type, block)))
        server_id = server_ids.get(key)
        if server_id is None:
            server_id = server_ids[key] = len(server_ids) + 1
            new_servers.append((server_id, *block))
        rows.append((*pick_row(values), server_id))
    _insert(connection, "servers", [_SERVER_ID, *server_names], new_servers)
    _insert(connection, "rows", [*(batch.columns[at] for at in row_at), _SERVER_ID], rows)


def _insert(connection: Any, table: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    sql = f"INSERT INTO {table} ({_names(columns)}) VALUES ({', '.join('?' for _ in columns)})"
    (last,) = connection.execute(f"SELECT coalesce(max(rowid), 0) FROM {table}").fetchone()
    try:
        connection.executemany(sql, rows)
    except OverflowError:
        # JSON integers from 2**63 to 2**64 (orjson reads them) do not fit SQLite's INTEGER:
        # they are stored as REAL, as JSON readers store larger ones. The rows before the
        # one that did not fit are taken back first.
        connection.execute(f"DELETE FROM {table} WHERE rowid > ?", (last,))
        connection.executemany(sql, [tuple(map(_fit, row)) for row in rows])


def _fit(value: Any) -> Any:
    if value.__class__ is int and not -(2**63) <= value < 2**63:
        return float(value)
    return value


def _picker(positions: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The values at `positions` of a row, as a tuple (itemgetter, for any length)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        at = positions[0]
        return lambda row: (row[at],)
    return lambda row: ()


def _names(columns: Iterable[str]) -> str:
    return ", ".join('"' + name.replace('"', '""') + '"' for name in columns)


def load_records(
    db_path: Path,
    records: Iterable[dict[str, Any]],
    busy_timeout_s: float = BUSY_TIMEOUT_MS / 1000,
) -> int:
    """Upsert records into `benchmark_runs` in one transaction (all or nothing: a full disk or
    an error leaves the database as it was); returns how many of them the table now holds
    (new, changed or already there). Waits up to `busy_timeout_s` for another writer."""
    rows = RowBuilder()
    for record in records:
        rows.add(record)
    staged = stage(rows.batches())
    if staged is None:
        return 0
    with Load(db_path, busy_timeout_s) as load:
        load.add(staged)
    return load.report.stored


class Load:
    """One loading transaction (`BEGIN IMMEDIATE`, so the digests read at its start stay
    true): staged rows go in batch by batch; leaving it without an error refreshes the swept
    axes, the indexes and the landing table and commits, an error rolls all of it back."""

    def __init__(self, db_path: Path, busy_timeout_s: float | None = None) -> None:
        self.db_path = db_path
        self.busy_timeout_s = BUSY_TIMEOUT_MS / 1000 if busy_timeout_s is None else busy_timeout_s
        self.report = LoadReport()
        self._fresh: list[str] = []

    def __enter__(self) -> Load:
        # A new database is written with a rollback journal, then set to WAL mode: in WAL
        # mode each page is written twice (to the log, then into the file when the log is
        # checkpointed at the commit), which made the commit of 100,000 runs take 3.4 s of
        # the ingest's 26. A rollback journal keeps no copy of pages a new file never had.
        self._new = not self.db_path.exists() or self.db_path.stat().st_size == 0
        self.db = connect(self.db_path, self.busy_timeout_s, wal=not self._new)
        try:
            # Attached before the transaction: SQLite attaches nothing inside one.
            self.db.conn.execute(f"ATTACH ':memory:' AS {_STAGE}")
            self.db.conn.execute("BEGIN IMMEDIATE")
            _prepare(self.db)
            _refresh_indexes(self.db)
            self.digests: dict[str, str] = dict(
                self.db.conn.execute(f"SELECT run_id, record_digest FROM [{TABLE}]")
            )
            self.axes = _Axes.read(self.db)
            self._columns = set(self.db.table(TABLE).columns_dict)
        except BaseException:
            self._close(commit=False)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._close(commit=kind is None)

    def stored_digests(self) -> dict[str, str]:
        """The run id of each stored record's digest."""
        return {digest: run_id for run_id, digest in self.digests.items() if digest}

    def add(self, staged: StagedRows, positions: Iterable[int] | None = None) -> None:
        """Writes the staged rows (those at `positions`, else all) that are new or changed."""
        report, digests = self.report, self.digests
        keep = []
        for at in range(len(staged.run_ids)) if positions is None else positions:
            run_id, digest = staged.run_ids[at], staged.digests[at]
            before = digests.get(run_id)
            if before == digest:
                report.unchanged += 1
                continue
            if before is None:
                report.new += 1
            else:
                report.updated += 1
            digests[run_id] = digest
            keep.append(at)
        if not keep:
            return
        connection = self.db.conn
        connection.deserialize(staged.image, name=_STAGE)
        # Row ids of the staged rows count them from 1, in stage order.
        where = ("" if len(keep) == len(staged.run_ids)
                 else f"rowid IN ({', '.join(str(at + 1) for at in keep)})")
        self._add_columns(staged, where)
        connection.execute(f"INSERT OR REPLACE INTO main.[{TABLE}] ({_names(staged.columns)}) "
                           + staged.select(staged.columns, where))
        watched = self.axes.watched(staged.columns)
        if watched:
            self.axes.see(watched, connection.execute(
                staged.select(watched, where, distinct=True)).fetchall())
        self._fresh += [staged.run_ids[at] for at in keep]

    def add_unchanged(self, count: int) -> None:
        """Records known by their digest to be stored as they are."""
        self.report.unchanged += count

    def _add_columns(self, staged: StagedRows, where: str) -> None:
        # Columns the schema does not know (an engine argument of a newer vLLM): typed by
        # their values, as sqlite-utils suggests.
        extra = [name for name in staged.columns if name not in self._columns]
        if not extra:
            return
        from sqlite_utils.utils import suggest_column_types

        rows = self.db.conn.execute(staged.select(extra, where)).fetchall()
        suggested = suggest_column_types([dict(zip(extra, row, strict=True)) for row in rows])
        table = self.db.table(TABLE)
        for name in sorted(extra):
            table.add_column(name, suggested[name])
            self._columns.add(name)

    def _close(self, commit: bool) -> None:
        db = self.db
        try:
            if commit:
                changed = self.axes.write(db)
                self.report.swept_axes = self.axes.swept()
                _refresh_landing(db, self.report.swept_axes, self._fresh, rebuild=changed)
                db.conn.execute("COMMIT")
                if self._new:
                    # Where another writer has it open already, the next load sets WAL mode.
                    with contextlib.suppress(sqlite3.OperationalError):
                        db.enable_wal()
        finally:
            try:
                if db.conn.in_transaction:
                    db.conn.execute("ROLLBACK")
            finally:
                db.close()


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
