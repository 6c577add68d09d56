"""The commands that keep a results database: `profllm check`, `rebuild`, `backup`, `restore`
(thin wrappers over results/check.py, rebuild.py and backup.py)."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path
from typing import Any

from pytest_profllm.results.backup import BackupError, backup, restore
from pytest_profllm.results.check import CheckError, check
from pytest_profllm.results.ingest import IngestError
from pytest_profllm.results.rebuild import RebuildError, rebuild
from pytest_profllm.results.schema_version import NewerSchema


class KeepingError(Exception):
    """One line to report, with the exit status (2: the command could not do its work)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def add_commands(commands: Any) -> None:
    """The four commands, on `profllm`'s subparsers."""
    check_ = commands.add_parser(
        "check",
        help="check a results database: whole, of this schema, and as its records say",
        description="Check DB: SQLite's integrity check, its schema version, every table a "
        "session or profllm ingest writes (with its columns), and that every run has its row "
        "in each per-run table. With --records, also every row against its record file "
        "(present, the same fingerprint and figures, its request samples) and every record "
        "file against its row. Prints the problems, one a line, then a summary; exit status "
        "1 on any problem (the summary names the runs), 2 when DB cannot be read at all. "
        "Read-only: it runs beside a session.",
    )
    check_.add_argument("db", type=Path, metavar="DB", help="a results.db")
    check_.add_argument(
        "--records",
        type=Path,
        metavar="DIR",
        help="the folder of its JSON records (default: the tables only)",
    )
    check_.set_defaults(handler=_check)

    rebuild_ = commands.add_parser(
        "rebuild",
        help="make a results database again from its JSON records",
        description="Load every JSON record in DIR (with the request files beside them) into "
        "a new database at DB, as profllm ingest does; DB gets its name only when whole. "
        "Refuses an existing DB. Exit status 1 when a file was refused (named, with its "
        "reason; the rest are loaded), 2 when nothing could be written.",
    )
    rebuild_.add_argument("records", type=Path, metavar="DIR", help="the folder of records")
    rebuild_.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        metavar="DB",
        help="the database to write (must not exist)",
    )
    rebuild_.set_defaults(handler=_rebuild)

    backup_ = commands.add_parser(
        "backup",
        help="copy a results database while sessions write to it (SQLite's backup API)",
        description="Copy DB to DEST (a new file) through SQLite's online backup API, inside "
        "one read transaction: sessions go on writing, and DEST is the database as it was "
        "when the backup began. Progress on a terminal. With --with-records, the record files "
        "and their request files go beside it (DEST.records.tar, or the folder "
        "DEST.records/ with --records-as folder).",
    )
    backup_.add_argument("db", type=Path, metavar="DB", help="a results.db")
    backup_.add_argument("dest", type=Path, metavar="DEST", help="the backup file to write")
    backup_.add_argument(
        "--with-records",
        type=Path,
        metavar="DIR",
        help="the folder of DB's records, copied beside the backup (default: the database only)",
    )
    backup_.add_argument(
        "--records-as",
        choices=("tar", "folder"),
        default="tar",
        help="how the records go beside it (default: tar)",
    )
    backup_.set_defaults(handler=_backup)

    restore_ = commands.add_parser(
        "restore",
        help="put a backup in place of a results database, whole or not at all",
        description="Check BACKUP (a whole database, of a schema this plugin knows), copy it "
        "beside DB and rename it over DB while holding DB's exclusive lock: DB is the old "
        "database or the backup, never a mix, and no write-ahead log of the old one is left. "
        "Refuses, in one line, while another process holds DB (a session loading, Datasette "
        "reading).",
    )
    restore_.add_argument(
        "backup",
        type=Path,
        metavar="BACKUP",
        help="a file profllm backup wrote (or any results database)",
    )
    restore_.add_argument("db", type=Path, metavar="DB", help="the database to replace or make")
    restore_.set_defaults(handler=_restore)


def _check(args: argparse.Namespace) -> int:
    if args.records is not None and not args.records.is_dir():
        raise KeepingError(f"--records {args.records}: no such folder")
    try:
        report = check(args.db, args.records)
    except (CheckError, NewerSchema) as error:
        raise KeepingError(str(error)) from None
    for line in report.lines():
        print(line)
    return 1 if report.problems else 0


def _rebuild(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for the progress bar.
    from tqdm import tqdm

    with tqdm(unit="file", disable=None, leave=False) as bar:

        def advance(count: int) -> None:
            bar.update(count)

        try:
            report = rebuild(args.records, args.output, advance)
        except (RebuildError, IngestError) as error:
            raise KeepingError(str(error)) from None
        except (sqlite3.Error, OSError) as error:
            what = getattr(error, "strerror", None) or str(error)
            raise KeepingError(f"{args.output}: {what}: nothing written") from None
    for path, reason in report.refused:
        print(f"profllm rebuild: refused {path}: {reason}", file=sys.stderr)
    print(report.summary(args.output))
    return 1 if report.refused else 0


def _backup(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for the progress bar.
    from tqdm import tqdm

    with tqdm(unit="page", disable=None, leave=False) as bar:

        def progress(copied: int, total: int) -> None:
            bar.total = total
            bar.update(copied - bar.n)

        try:
            report = backup(args.db, args.dest, progress, args.with_records, args.records_as)
        except (BackupError, NewerSchema) as error:
            raise KeepingError(str(error)) from None
        except OSError as error:
            raise KeepingError(f"{args.dest}: {error.strerror or error}") from None
    line = (
        f"{report.path}: {report.runs} run(s), schema version {report.version}, "
        f"{report.pages} page(s)"
    )
    if report.records is not None:
        line += f"; {report.record_files} record and request file(s) in {report.records}"
    print(line)
    return 0


def _restore(args: argparse.Namespace) -> int:
    try:
        version = restore(args.backup, args.db)
    except (BackupError, NewerSchema) as error:
        raise KeepingError(str(error)) from None
    except OSError as error:
        raise KeepingError(f"{args.db}: {error.strerror or error}") from None
    print(f"{args.db}: restored from {args.backup} (schema version {version})")
    return 0
