"""`profllm restore BACKUP DB`: a backup written into a results database in place, whole or not
at all (results/backup.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pytest_profllm.cli.errors import CliError
from pytest_profllm.results.backup import BackupError, restore
from pytest_profllm.results.schema_version import NewerSchema


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    restore_ = commands.add_parser(
        "restore",
        help="put a backup in place of a results database, whole or not at all",
        description="Check BACKUP (a regular file, an SQLite database that passes its "
        "integrity check, with the plugin's tables, of a schema this plugin knows), then write "
        "it into DB in place through SQLite's backup API, in one write transaction: DB is the "
        "old database or the backup, never a mix; readers (Datasette) see the backup at their "
        "next query, a session's load waits for it, and DB stays in WAL mode. Waits up to 30 s "
        "for a load under way. Refuses in one line, exit status 2, changing nothing.",
    )
    restore_.add_argument(
        "backup",
        type=Path,
        metavar="BACKUP",
        help="a file profllm backup wrote (or any results database)",
    )
    restore_.add_argument("db", type=Path, metavar="DB", help="the database to replace or make")
    restore_.set_defaults(handler=_restore)


def _restore(args: argparse.Namespace) -> int:
    try:
        version = restore(args.backup, args.db)
    except (BackupError, NewerSchema) as error:
        raise CliError(str(error)) from None
    except OSError as error:
        raise CliError(f"{args.db}: {error.strerror or error}") from None
    print(f"{args.db}: restored from {args.backup} (schema version {version})")
    return 0
