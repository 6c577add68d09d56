"""How a case's files are written: its JSON record and its gzipped request lines.

Both are written atomically, and a figure that is not finite (JSON has no NaN or Infinity) as
null, logged. Reading them back: `results/record.py` (`normalize`, `read_requests`).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from pathlib import Path
from typing import Any

from pytest_profllm.hosts.files import write_atomic

log = logging.getLogger("profllm.results")


def record_bytes(record: dict[str, Any]) -> bytes:
    """A record file's content. The store digests these bytes: a record loaded at the end of
    a session and its file ingested later are the same record. A figure that is not finite
    (JSON has no NaN or Infinity) is written as null, and logged: the record is written
    whatever a figure came to (a server's NaN stopped pytest with an INTERNALERROR)."""
    return _json(record, f"record {record.get('run_id')}", indent=2).encode() + b"\n"


def _json(value: Any, what: str, indent: int | None = None) -> str:
    """`value` as JSON, a float that is not finite as null (logged, naming `what`)."""
    try:
        return json.dumps(value, indent=indent, allow_nan=False)
    except ValueError:
        paths: list[str] = []
        finite = _finite(value, "", paths, set())
        text = json.dumps(finite, indent=indent, allow_nan=False)  # a cycle still raises
        more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
        log.warning("%s: %s%s not finite, written as null", what, ", ".join(paths[:10]), more)
        return text


def _finite(value: Any, path: str, paths: list[str], seen: set[int]) -> Any:
    """`value` with every float that is not finite replaced by None (their paths in
    `paths`); a list or mapping met twice on one path is left as it is."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        paths.append(path or "(the record)")
        return None
    if isinstance(value, dict | list | tuple):
        if id(value) in seen:
            return value
        seen = seen | {id(value)}
        if isinstance(value, dict):
            return {key: _finite(item, f"{path}.{key}" if path else str(key), paths, seen)
                    for key, item in value.items()}
        return [_finite(item, f"{path}[{index}]", paths, seen)
                for index, item in enumerate(value)]
    return value


def write_record(out_dir: Path, record: dict[str, Any]) -> Path:
    path = out_dir / f"{record['run_id']}.json"
    write_atomic(path, record_bytes(record))
    return path


def write_requests(out_dir: Path, run_id: str, requests: list[dict[str, Any]]) -> Path:
    """Per-request records as gzipped JSON lines, beside the case record."""
    lines = "".join(_json(request, f"{run_id} request {index}") + "\n"
                    for index, request in enumerate(requests))
    path = out_dir / f"{run_id}.requests.jsonl.gz"
    write_atomic(path, gzip.compress(lines.encode(), mtime=0))
    return path
