"""`profllm backup` and `profllm restore`.

A backup goes through SQLite's online backup API from inside one read transaction: in WAL
mode sessions go on writing while it copies, and the copy is the database as it was when the
backup began (a copy of the file could take half of a transaction, or none of its log). The
record files and request samples may go beside it, as a tar or a folder.

A restore checks the backup (a results database this plugin knows, whole) and writes it into
the database in place, through the same API, in one write transaction: readers (Datasette) go
on reading and see the restored database at their next read, a session's load waits for it as
for any writer, and the database stays in WAL mode. Replacing the file instead left a reader
serving the deleted one, and a load beside it failed (`attempt to write a readonly database`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import stat
import tarfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pytest_profllm.results.files import not_regular, scratch_database, settle, sidecars
from pytest_profllm.results.schema_version import NewerSchema, refuse_newer
from pytest_profllm.results.store import BUSY_TIMEOUT_MS
from pytest_profllm.results.table import TABLE

# Pages copied a step (32 KiB each: 32 MiB), between which progress is told.
PAGES_PER_STEP = 1024
# How long a restore waits for another writer (a session's load) before it says who holds the
# database: as long as a load waits for one.
RESTORE_WAIT_S = BUSY_TIMEOUT_MS / 1000


class BackupError(Exception):
    """A backup or restore that cannot be done, in one line."""


@dataclass
class BackupReport:
    path: Path
    version: int
    runs: int  # benchmark_runs' rows at the backup's moment
    pages: int
    records: Path | None = None
    record_files: int = 0
    skipped: list[str] = field(default_factory=list)  # files of the records left out, why


def backup(
    db_path: Path,
    dest: Path,
    progress: Callable[[int, int], None] | None = None,
    records: Path | None = None,
    records_as: Literal["tar", "folder"] = "tar",
    pages_per_step: int = PAGES_PER_STEP,
) -> BackupReport:
    """Copies the database at `db_path` to `dest` (a new file) as it is at this moment;
    `progress(copied, total)` in pages. `records`: a folder of record files, copied beside
    it as DEST.records.tar or DEST.records/."""
    if not db_path.is_file():
        raise BackupError(f"{db_path}: no such database")
    if dest.exists():
        raise BackupError(f"{dest}: exists; name a new file for the backup")
    if not dest.parent.is_dir():
        raise BackupError(f"{dest.parent}: no such folder")
    if records is not None and not records.is_dir():
        raise BackupError(f"--with-records {records}: no such folder")
    beside = dest.with_name(dest.name + (".records.tar" if records_as == "tar" else ".records"))
    if records is not None and beside.exists():
        raise BackupError(f"{beside}: exists; name a new file for the backup")
    try:
        source = sqlite3.connect(
            db_path.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None, timeout=30
        )
    except sqlite3.Error as error:
        raise BackupError(f"{db_path}: cannot open: {error}") from None
    with scratch_database(dest, "backup") as temp:
        with closing(source):
            try:
                version = refuse_newer(source, db_path)
                # One read transaction over every step: the snapshot the copy is of, and the
                # row count at its moment.
                source.execute("BEGIN")
                runs = _runs(source)
                with closing(sqlite3.connect(temp)) as target:
                    source.backup(target, pages=pages_per_step, progress=_pages(progress))
                pages = _page_count(temp)
                source.execute("COMMIT")
            except NewerSchema:
                raise
            except sqlite3.DatabaseError as error:
                raise BackupError(f"{db_path}: {error}") from None
        settle(temp)
        os.replace(temp, dest)
    report = BackupReport(dest, version, runs, pages)
    if records is not None:
        report.records = beside
        report.record_files, report.skipped = _copy_records(records, beside, records_as)
    return report


def _pages(
    progress: Callable[[int, int], None] | None,
) -> Callable[[int, int, int], None] | None:
    if progress is None:
        return None

    def told(status: int, remaining: int, total: int) -> None:
        progress(total - remaining, total)

    return told


def _runs(connection: sqlite3.Connection) -> int:
    try:
        count: int = connection.execute(f"SELECT count(*) FROM [{TABLE}]").fetchone()[0]
    except sqlite3.OperationalError:  # no such table: a database no load has written yet
        return 0
    return count


def _page_count(path: Path) -> int:
    with closing(sqlite3.connect(path)) as connection:
        pages: int = connection.execute("PRAGMA page_count").fetchone()[0]
    return pages


def _copy_records(records: Path, beside: Path, records_as: str) -> tuple[int, list[str]]:
    """The record files and their request files, into a tar or a folder (written under a
    temporary name, renamed when whole); the count copied, and a line for each file left out.

    Only regular files inside the folder go in: a link (`notes.json -> /etc/passwd`) is left
    out with a line, never followed, and each file is checked by the descriptor it is copied
    from, so that what was checked is what is copied."""
    files, skipped = _regular_records(records)
    temp = beside.with_name(f".{beside.name}.{os.getpid()}")
    copied = 0
    try:
        with contextlib.ExitStack() as stack:
            tar = None
            if records_as == "tar":
                tar = stack.enter_context(tarfile.open(temp, "w"))
            else:
                temp.mkdir()
            for path in files:
                left_out = _copy_one(path, tar, temp)
                if left_out is None:
                    copied += 1
                else:
                    skipped.append(left_out)
        os.replace(temp, beside)
    finally:
        if temp.is_dir():
            shutil.rmtree(temp)
        elif temp.exists():
            temp.unlink()
    return copied, skipped


def _copy_one(path: Path, tar: tarfile.TarFile | None, folder: Path) -> str | None:
    """Copies the file at `path` into the tar, else into `folder`, from a descriptor that
    follows no link and is a regular file's; else the line that says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:  # a link put there since the folder was read: ELOOP
        return f"{path}: {error.strerror or error}; not copied"
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"{path}: {not_regular(path)}; not copied"
        if tar is not None:
            tar.addfile(tar.gettarinfo(arcname=path.name, fileobj=handle), handle)
        else:
            with open(folder / path.name, "xb") as out:
                shutil.copyfileobj(handle, out)
            shutil.copystat(path, folder / path.name, follow_symlinks=False)
    return None


def _regular_records(records: Path) -> tuple[list[Path], list[str]]:
    """The record files of the folder and the request files beside them that are regular
    files inside it; a line for each left out (a link, a FIFO, a device, a folder)."""
    folder = records.resolve()
    files: list[Path] = []
    skipped: list[str] = []
    with os.scandir(folder) as entries:
        found = {entry.name: entry for entry in entries}
    for name in sorted(found):
        if not name.endswith(".json") or name.startswith("."):
            continue
        for entry in (found[name], found.get(name[: -len(".json")] + ".requests.jsonl.gz")):
            if entry is None:
                continue
            path = folder / entry.name
            if entry.is_symlink():
                skipped.append(f"{path}: a link (to {os.path.realpath(path)}); only regular "
                               "files inside the folder are copied")
            elif not entry.is_file(follow_symlinks=False):
                skipped.append(f"{path}: {not_regular(path)}; not copied")
            elif not path.resolve().is_relative_to(folder):
                skipped.append(f"{path}: outside {folder}; not copied")
            else:
                files.append(path)
    return files, skipped


def restore(backup_path: Path, db_path: Path, wait_s: float = RESTORE_WAIT_S) -> int:
    """Puts the content of the backup at `backup_path` in place of the database at `db_path`,
    whole or not at all; returns its schema version. Refuses, changing nothing, a backup that
    is not a results database this plugin knows (not a regular file, empty, not SQLite,
    failing SQLite's integrity check, without the plugin's table, newer than this plugin),
    and a database another process holds for writing longer than `wait_s`.

    The database is written in place, through SQLite's backup API, in one write transaction
    (not a file renamed over it): a reader (Datasette) keeps its file and sees the restored
    database at its next read, a session's load waits for the restore as for any writer, and
    the database stays in WAL mode."""
    _refuse_unreadable(backup_path)
    if not db_path.parent.is_dir():
        raise BackupError(f"{db_path.parent}: no such folder")
    with scratch_database(db_path, "restore") as temp:
        version = _copy_checked(backup_path, temp)
        settle(temp)
        if not db_path.exists():
            _replace_whole(temp, db_path)
        else:
            _restore_into(temp, db_path, wait_s)
    return version


_SQLITE_HEADER = b"SQLite format 3\x00"


def _refuse_unreadable(backup_path: Path) -> None:
    """A backup that is not a regular file, is empty or is not SQLite's (SQLite would take an
    empty file for an empty database, and restore it)."""
    try:
        mode = os.stat(backup_path).st_mode
    except FileNotFoundError:
        raise BackupError(f"{backup_path}: no such backup") from None
    except OSError as error:
        raise BackupError(f"{backup_path}: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        raise BackupError(f"{backup_path}: {not_regular(backup_path, mode)}")
    try:
        with open(backup_path, "rb") as handle:
            head = handle.read(len(_SQLITE_HEADER))
    except OSError as error:
        raise BackupError(f"{backup_path}: {error.strerror or error}") from None
    if not head:
        raise BackupError(f"{backup_path}: empty (0 bytes): not a backup")
    if head != _SQLITE_HEADER:
        raise BackupError(f"{backup_path}: not an SQLite database")


def _copy_checked(backup_path: Path, temp: Path) -> int:
    """The backup checked (SQLite's integrity check, the schema version, the plugin's table)
    and copied to `temp`; its schema version."""
    try:
        with closing(
            sqlite3.connect(backup_path.resolve().as_uri() + "?mode=ro", uri=True)
        ) as source:
            version = refuse_newer(source, backup_path)
            try:
                problems = [row[0] for row in source.execute("PRAGMA integrity_check(5)")]
            except sqlite3.DatabaseError as error:  # a page so broken the check stops
                problems = [str(error)]
            if problems != ["ok"]:
                raise BackupError(f"{backup_path}: not a whole database: {problems[0]}")
            columns = {row[1] for row in source.execute(f"PRAGMA table_info([{TABLE}])")}
            if "run_id" not in columns:
                raise BackupError(
                    f"{backup_path}: not a results database: it has no table {TABLE}"
                )
            with closing(sqlite3.connect(temp)) as target:
                source.backup(target)
    except NewerSchema:
        raise
    except sqlite3.DatabaseError as error:
        raise BackupError(f"{backup_path}: {error}") from None
    return version


def _replace_whole(temp: Path, db_path: Path) -> None:
    """`temp`, set to WAL mode, renamed to `db_path`, where no database is (none, or a file
    that is not one: no process can be using it)."""
    # A log left without its database would be replayed into the restored one.
    for orphan in sidecars(db_path):
        with contextlib.suppress(FileNotFoundError):
            orphan.unlink()
    with closing(sqlite3.connect(temp, isolation_level=None)) as connection:
        connection.execute("PRAGMA journal_mode = WAL")
    # The last connection gone, the log is folded in and removed; the file says WAL.
    with open(temp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temp, db_path)


class _StillHeld(Exception):
    """Another process held the database's write lock past the restore's wait."""


def _restore_into(temp: Path, db_path: Path, wait_s: float) -> None:
    """The content of `temp` copied into the database at `db_path` in place, in one write
    transaction (SQLite's backup API), waiting up to `wait_s` for another writer."""
    held = (
        f"{db_path}: held by another process for over {wait_s:g} s (a session loading, "
        "or a reader in rollback-journal mode): restore again once it is done"
    )
    live = sqlite3.connect(db_path, timeout=wait_s, isolation_level=None)
    try:
        try:
            live.execute("SELECT count(*) FROM sqlite_master").fetchone()
            pages = live.execute("PRAGMA page_count").fetchone()[0]
            # A database left in rollback-journal mode (by an older restore, say) is set to
            # WAL mode, in which readers never block the restore, nor it them.
            if pages and live.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
                raise BackupError(held)
            page_size = live.execute("PRAGMA page_size").fetchone()[0]
        except sqlite3.OperationalError as error:
            if _busy(error):
                raise BackupError(held) from None
            raise BackupError(f"{db_path}: {error}") from None
        except sqlite3.DatabaseError:
            # Not a database: no process can be using it; it is replaced whole.
            live.close()
            _replace_whole(temp, db_path)
            return
        if pages:
            # In WAL mode the backup API cannot change the page size: the copy takes the
            # database's.
            _page_size(temp, page_size)
        deadline = time.monotonic() + wait_s

        def waiting(status: int, remaining: int, total: int) -> None:
            if status in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) and (
                time.monotonic() > deadline
            ):
                raise _StillHeld

        try:
            with closing(sqlite3.connect(temp)) as source:
                # One step: the whole copy is one write transaction of the database.
                source.backup(live, progress=waiting)
            if not pages:
                live.execute("PRAGMA journal_mode = WAL")
            live.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except _StillHeld:
            raise BackupError(held) from None
        except sqlite3.OperationalError as error:
            if _busy(error):
                raise BackupError(held) from None
            raise BackupError(f"{db_path}: {error}") from None
        except sqlite3.DatabaseError as error:
            raise BackupError(f"{db_path}: {error}") from None
    finally:
        live.close()


def _busy(error: sqlite3.Error) -> bool:
    return "locked" in str(error) or "busy" in str(error)


def _page_size(path: Path, page_size: int) -> None:
    """The database at `path` (in rollback-journal mode) rewritten with pages of `page_size`."""
    with closing(sqlite3.connect(path, isolation_level=None)) as connection:
        if connection.execute("PRAGMA page_size").fetchone()[0] != page_size:
            connection.execute(f"PRAGMA page_size = {int(page_size)}")
            connection.execute("VACUUM")
