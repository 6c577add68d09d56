"""`profllm backup DB DEST`: a results database copied while sessions write to it
(results/backup.py; `profllm restore` is restore.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.results.backup import BackupError, backup
from pytest_profllm.results.schema_version import NewerSchema


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _backup(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for the progress bar.
    from tqdm import tqdm

    refuse_newer_database(args.db)
    with tqdm(unit="page", disable=None, leave=False) as bar:

        def progress(copied: int, total: int) -> None:
            bar.total = total
            bar.update(copied - bar.n)

        try:
            report = backup(args.db, args.dest, progress, args.with_records, args.records_as)
        except (BackupError, NewerSchema) as error:
            raise CliError(str(error)) from None
        except OSError as error:
            raise CliError(f"{args.dest}: {error.strerror or error}") from None
    for skipped in report.skipped:
        print(f"profllm backup: skipped {skipped}", file=sys.stderr)
    line = (
        f"{report.path}: {report.runs} run(s), schema version {report.version}, "
        f"{report.pages} page(s)"
    )
    if report.records is not None:
        line += f"; {report.record_files} record and request file(s) in {report.records}"
    print(line)
    return 0
