"""Files on this host written so that a reader never sees a part: a record, a cache entry, a
registry dump (written beside, then renamed over)."""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a part (rename is atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; a record is an ordinary output file, as open() makes them.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    # Linux shows the umask in /proc; elsewhere it is read by setting it and back.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_only_uri(path: Path | str) -> str:
    """SQLite's URI for opening `path` read-only. The path is quoted: a `#` or `?` in a file
    name would otherwise end it, and SQLite would open (and make) another file."""
    return f"file:{urllib.parse.quote(str(path))}?mode=ro"
