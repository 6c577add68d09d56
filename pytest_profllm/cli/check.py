"""`profllm check DB`: whether a results database is whole and holds what its records say
(results/check.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.results.check import CheckError, check
from pytest_profllm.results.schema_version import NewerSchema


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check_ = commands.add_parser(
        "check",
        help="check a results database: whole, of this schema, and as its records say",
        description="Check DB: SQLite's integrity check, its schema version, every table a "
        "session or profllm ingest writes (with its columns), and that every run has its row "
        "in each per-run table. With --records, also every row against its record file "
        "(present, the same status, validity, fingerprint and figures, its request samples) "
        "and every record file against its row. Prints the problems, one a line, then a "
        "summary; exit status 1 on any problem (the summary names the runs), 2 when DB "
        "cannot be read at all. Read-only: it runs beside a session.",
    )
    check_.add_argument("db", type=Path, metavar="DB", help="a results.db")
    check_.add_argument(
        "--records",
        type=Path,
        metavar="DIR",
        help="the folder of its JSON records (default: the tables only)",
    )
    check_.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    refuse_newer_database(args.db)
    if args.records is not None and not args.records.is_dir():
        raise CliError(f"--records {args.records}: no such folder")
    try:
        report = check(args.db, args.records)
    except (CheckError, NewerSchema) as error:
        raise CliError(str(error)) from None
    for line in report.lines():
        print(line)
    return 1 if report.problems else 0
