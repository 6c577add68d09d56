"""`profllm rebuild DIR -o DB`: a results database made again from its JSON records
(results/rebuild.py)."""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

from pytest_profllm.cli.errors import CliError
from pytest_profllm.results.ingest import IngestError
from pytest_profllm.results.rebuild import RebuildError, rebuild


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def _rebuild(args: argparse.Namespace) -> int:
    # Deferred: tqdm only for the progress bar.
    from tqdm import tqdm

    with tqdm(unit="file", disable=None, leave=False) as bar:

        def advance(count: int) -> None:
            bar.update(count)

        try:
            report = rebuild(args.records, args.output, advance)
        except RebuildError as error:
            _refused(error.refused)
            raise CliError(str(error)) from None
        except IngestError as error:
            raise CliError(str(error)) from None
        except (sqlite3.Error, OSError) as error:
            what = getattr(error, "strerror", None) or str(error)
            raise CliError(f"{args.output}: {what}: nothing written") from None
    _refused(report.refused)
    print(report.summary(args.output))
    return 1 if report.refused else 0


def _refused(refused: list[tuple[Path, str]]) -> None:
    for path, reason in refused:
        print(f"profllm rebuild: refused {path}: {reason}", file=sys.stderr)
