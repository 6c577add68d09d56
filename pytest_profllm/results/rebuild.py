"""`profllm rebuild`: a results database made again from its JSON records, which are the source
of truth. The records are loaded as `profllm ingest` loads them, into a new file beside the
target, which takes the target's name only once whole: a rebuild that fails or is killed leaves
no half-built database under that name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pytest_profllm.results.files import scratch_database, settle
from pytest_profllm.results.ingest import IngestReport, ingest, record_files


class RebuildError(Exception):
    """A rebuild that cannot be done (the target exists, no records); `refused`: the files
    refused on the way, each with its reason."""

    def __init__(self, message: str, refused: list[tuple[Path, str]] | None = None) -> None:
        super().__init__(message)
        self.refused = refused or []


def rebuild(
    records: Path, db_path: Path, progress: Callable[[int], None] | None = None
) -> IngestReport:
    """Loads every record file in the folder `records` into a new database at `db_path`."""
    if db_path.exists():
        raise RebuildError(
            f"{db_path}: exists; rebuild writes a new database: name another "
            "file, or move this one away first"
        )
    if not records.is_dir():
        raise RebuildError(f"{records}: no such folder")
    files = record_files([records])
    if not files:
        raise RebuildError(f"{records}: no record files (*.json) there")
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with scratch_database(db_path, "rebuild") as temp:
        report = ingest(temp, files, progress)
        if not report.load.stored:
            raise RebuildError(
                f"{records}: none of its {len(files)} file(s) is a record: nothing written",
                report.refused,
            )
        settle(temp)
        os.replace(temp, db_path)
    return report
