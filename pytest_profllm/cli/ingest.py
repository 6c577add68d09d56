"""`profllm ingest DB PATH...`: record files (and `profllm bench --save-result` files) loaded
into a results database (results/ingest.py)."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.results import store
from pytest_profllm.results.ingest import IngestError, ingest, record_files
from pytest_profllm.results.schema_version import NewerSchema


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ingest_ = commands.add_parser(
        "ingest",
        help="load record files into a results database",
        description="Load JSON records (files, or folders of them), and `profllm bench "
        "--save-result` files (as records of suite `bench`), into the benchmark_runs table. "
        "Every good file is loaded and every bad one refused whole, named with its reason; "
        "a record already there is counted as unchanged. Exit status 1 when a file was "
        "refused, 2 when a path does not exist or the database cannot be written (locked by "
        "another process, a full disk): then nothing is loaded.",
    )
    ingest_.add_argument("db", type=Path, metavar="DB", help="SQLite file (created if missing)")
    ingest_.add_argument(
        "paths", nargs="+", type=Path, metavar="PATH", help="record files or folders holding them"
    )
    ingest_.set_defaults(handler=_ingest)


def _ingest(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for ingest's progress bar.
    from tqdm import tqdm

    refuse_newer_database(args.db)
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}")
    files = record_files(args.paths)
    # A bar on a terminal only (tqdm's disable=None), for loads long enough to need one.
    with tqdm(total=len(files), unit="file", disable=None if len(files) > 200 else True,
              leave=False) as bar:

        def advance(count: int) -> None:
            bar.update(count)

        try:
            report = ingest(args.db, files, advance)
        except IngestError as error:
            raise CliError(f"{error}: nothing loaded") from None
        except NewerSchema as error:
            raise CliError(str(error)) from None
        except (sqlite3.Error, OSError) as error:
            what = (f"still locked by another process after {store.BUSY_TIMEOUT_MS / 1000:g} s"
                    if "locked" in str(error)
                    else getattr(error, "strerror", None) or str(error))
            raise CliError(f"{args.db}: {what}: nothing loaded") from None
    for path, reason in report.refused:
        print(f"profllm ingest: refused {path}: {reason}", file=sys.stderr)
    print(report.summary(args.db))
    return 1 if report.refused else 0
