"""A database file made whole on its own, so that it may be moved or copied: no log beside it."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path


def sidecars(db_path: Path) -> list[Path]:
    """The files SQLite keeps beside a database: its write-ahead log, its shared memory and
    its rollback journal. A stale log beside another database would be replayed into it."""
    return [db_path.with_name(db_path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def settle(db_path: Path) -> None:
    """The database's log folded into it and removed (rollback-journal mode; the next load
    sets WAL mode again), and the file on disk: then it is whole by itself."""
    with closing(sqlite3.connect(db_path, isolation_level=None)) as connection:
        connection.execute("PRAGMA journal_mode = DELETE")
    with open(db_path, "rb") as handle:
        os.fsync(handle.fileno())
