"""Record files uploaded on the web page (`/{database}/-/upload`), one file per POST (the page
sends a batch one by one, with progress), loaded as `profllm ingest` loads them.

Each file is checked as ingest checks it (results/ingest.py `parse_record`: JSON, a record of
our schema or a `profllm bench` result, finite numbers, a sane width), kept in the results
folder's `uploads/` under a name made from its run id (never from the client's file name), and
loaded by ingest itself, in its own transaction: so the landing table, the gate's tables and
the run's series are filled as for any record, and a duplicate is told apart from an update.
Only an actor allowed to write may upload (browse/plugin.py's `permission_allowed`).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pytest_profllm.browse.pages import one_line
from pytest_profllm.hosts.files import write_atomic
from pytest_profllm.limits import MAX_UPLOAD_BYTES
from pytest_profllm.results.ingest import ingest, parse_record

UPLOADS = "uploads"
Outcome = Literal["loaded", "updated", "duplicate", "refused"]
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class UploadResult:
    """What became of one file: its outcome and, in words, why."""

    file: str
    outcome: Outcome
    reason: str
    run_id: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return {"file": self.file, "outcome": self.outcome, "reason": self.reason,
                "run_id": self.run_id}


def stored_name(run_id: str) -> str:
    """The file name a run's upload is kept under: its run id where that is a safe name, else
    the safe characters of it and a digest (two run ids never share a name)."""
    safe = _UNSAFE.sub("_", run_id).strip("._") or "record"
    if safe != run_id:
        safe = f"{safe[:80]}-{hashlib.blake2b(run_id.encode(), digest_size=6).hexdigest()}"
    return f"{safe[:120]}.json"


def upload(db_path: Path, filename: str, content: bytes) -> UploadResult:
    """Checks, keeps and loads one uploaded file; never raises for what the file holds."""
    shown = filename[-200:] or "(no name)"
    if len(content) > MAX_UPLOAD_BYTES:
        return UploadResult(shown, "refused",
                            f"{len(content):,} bytes: over the {MAX_UPLOAD_BYTES >> 20} MiB limit")
    try:
        record = parse_record(content, Path(Path(filename).name or "upload.json"))
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        return UploadResult(shown, "refused", str(error) or type(error).__name__)
    run_id = str(record["run_id"])
    path = db_path.parent / UPLOADS / stored_name(run_id)
    existed = path.exists()
    previous = path.read_bytes() if existed else None
    try:
        write_atomic(path, content)
    except OSError as error:
        return UploadResult(shown, "refused", f"could not keep the file: {error.strerror}",
                            run_id)
    try:
        report = ingest(db_path, [path])
    except sqlite3.OperationalError as error:
        _restore(path, previous)
        return UploadResult(shown, "refused", f"the database is busy or locked ({error}): "
                            "nothing was loaded, try again", run_id)
    except Exception as error:  # whatever stopped the load, the file goes
        # Ingest loads in one transaction: what failed left nothing in the database, so
        # nothing of it stays in the folder either, and the client reads why in one line.
        _restore(path, previous)
        return UploadResult(shown, "refused", one_line(
            f"could not be loaded ({type(error).__name__}: {error}): nothing was loaded"),
            run_id)
    if report.refused:
        _restore(path, previous)
        return UploadResult(shown, "refused", report.refused[0][1], run_id)
    load = report.load
    if load.new:
        return UploadResult(shown, "loaded", f"run {run_id} loaded", run_id)
    if load.updated:
        return UploadResult(shown, "updated",
                            f"run {run_id} was already loaded from other content: replaced",
                            run_id)
    _restore(path, previous)  # nothing new: the folder stays as it was
    return UploadResult(shown, "duplicate", f"run {run_id} is already loaded, as it is: "
                        "nothing changed", run_id)


def _restore(path: Path, previous: bytes | None) -> None:
    """Puts back what the folder held before a refused upload."""
    if previous is None:
        path.unlink(missing_ok=True)
    else:
        write_atomic(path, previous)
