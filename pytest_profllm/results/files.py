"""Files of the results: a database file made whole on its own, so that it may be moved or
copied (no log beside it), and a record file read as a regular file only, no further than its
limit."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from pytest_profllm.limits import InputLimitError

# What a read asks of the kernel at a time past the size a file said it had (a file that grew,
# or one of /proc's, which say 0).
_CHUNK = 1 << 16


def sidecars(db_path: Path) -> list[Path]:
    """The files SQLite keeps beside a database: its write-ahead log, its shared memory and
    its rollback journal. A stale log beside another database would be replayed into it."""
    return [db_path.with_name(db_path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


@contextmanager
def scratch_database(db_path: Path, doing: str) -> Iterator[Path]:
    """A scratch database file beside `db_path` (`.NAME.DOING-PID`) to be made whole and
    moved into place; whatever is left of it (and of its sidecars) is removed when the block
    ends, also on failure."""
    temp = db_path.with_name(f".{db_path.name}.{doing}-{os.getpid()}")
    try:
        yield temp
    finally:
        for path in (temp, *sidecars(temp)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def settle(db_path: Path) -> None:
    """The database's log folded into it and removed (rollback-journal mode; the next load
    sets WAL mode again), and the file on disk: then it is whole by itself."""
    with closing(sqlite3.connect(db_path, isolation_level=None)) as connection:
        connection.execute("PRAGMA journal_mode = DELETE")
    with open(db_path, "rb") as handle:
        os.fsync(handle.fileno())


def read_regular(path: Path, max_bytes: int, what: str = "the file") -> bytes:
    """The bytes of the regular file at `path` (a link to one followed): ValueError, in one
    line, where it is anything else (a FIFO, a device, a folder, a socket, or a link to one),
    and InputLimitError, naming `what`, where it is over `max_bytes`, of which no more than
    `max_bytes` + 1 are read.

    The file is opened non-blocking, so that a FIFO (which would wait for a writer) cannot
    hang the open, and told apart after the open, by the descriptor's own fstat: what is read
    is what was checked, whatever the name points at by then."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        # A socket cannot be opened at all: say what it is rather than ENXIO's text.
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise ValueError(not_regular(path, mode)) from None
        raise ValueError(f"cannot read: {error.strerror or error}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(not_regular(path, status.st_mode))
        if status.st_size > max_bytes:
            raise _too_big(what, max_bytes, status.st_size)
        parts: list[bytes] = []
        total = 0
        while True:
            # The size said, and one byte more to see the end; past it, a chunk at a time.
            want = min(max(status.st_size + 1 - total, _CHUNK), max_bytes + 1 - total)
            part = os.read(fd, want)
            if not part:
                break
            parts.append(part)
            total += len(part)
            if total > max_bytes:
                raise _too_big(what, max_bytes)
    except OSError as error:
        raise ValueError(f"cannot read: {error.strerror or error}") from None
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_big(what: str, max_bytes: int, size: int | None = None) -> InputLimitError:
    if size is None:  # grew past the size it said, or said none
        return InputLimitError(f"{what} is more than the {max_bytes:,} bytes read")
    return InputLimitError(f"{what} is {size:,} bytes, more than the {max_bytes:,} read")


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(path: Path, mode: int | None = None) -> str:
    """Why `path` (of `mode`, else as it is now) is not read, in words."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode
        except OSError as error:
            return f"cannot read: {error.strerror or error}"
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    if os.path.islink(path):
        kind = f"a link to {kind} ({os.path.realpath(path)})"
    return f"{kind}, not a regular file: only regular files are read"
