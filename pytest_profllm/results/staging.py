"""Staging rows for a load: whoever reads the records (`profllm ingest`'s worker processes)
writes their rows (results/rows.py), batch by batch, into an in-memory SQLite database and
serializes it; the one writing process (results/store.py) attaches that image and copies the
rows into `benchmark_runs` in C, not binding 400+ values a row from Python.
"""

from __future__ import annotations

import itertools
import operator
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pytest_profllm.results.rows import RowBatch
from pytest_profllm.results.table import PAGE_SIZE, quote

# Rows go to SQLite in batches: memory stays flat whatever the number of records.
BATCH = 500
# The in-memory database a batch of rows is staged in (the name the writer attaches it by).
# Its `rows` table holds each row's own columns and the id of its server block in `servers`:
# the records of one server configuration (every workload, every repeat) share one block of
# 300+ engine arguments.
STAGE = "profllm_stage"
_SERVER_ID = "profllm_server"  # reserved: results/rows.py RESERVED_COLUMNS


def batched(items: Iterable[Any], size: int = BATCH) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def column_list(columns: Iterable[str]) -> str:
    """The column names quoted for SQL, comma-separated."""
    return ", ".join(quote(name) for name in columns)


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
        named = ", ".join(("s." if name in servers else "r.") + column_list([name])
                          for name in columns)
        return (f"SELECT {'DISTINCT ' if distinct else ''}{named} FROM {STAGE}.rows AS r "
                f"LEFT JOIN {STAGE}.servers AS s ON s.{_SERVER_ID} = r.{_SERVER_ID}"
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
        connection.execute(f"CREATE TABLE rows ({column_list([*row_columns, _SERVER_ID])})")
        connection.execute(f"CREATE TABLE servers ({_SERVER_ID} INTEGER PRIMARY KEY"
                           + "".join(f", {column_list([name])}" for name in server_columns)
                           + ")")
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
    sql = (f"INSERT INTO {table} ({column_list(columns)}) "
           f"VALUES ({', '.join('?' for _ in columns)})")
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
