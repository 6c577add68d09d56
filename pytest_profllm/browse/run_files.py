"""A run's files in its results folder, for its page's downloads (browse/run_views.py serves
them): its record, its request file, its server's log and its profiler traces, each only where
the plugin writes that kind of file, and nothing outside the folder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_profllm.browse.run_values import stored_json
from pytest_profllm.browse.upload import UPLOADS, stored_name
from pytest_profllm.limits import MAX_TRACE_FILES
from pytest_profllm.server.launch import safe_name


@dataclass(frozen=True)
class RunFile:
    """A file of a run, found in the results folder: what it is and where."""

    kind: str  # record, requests, log, trace
    name: str  # as the download URL names it
    path: Path
    size: int


# Where the plugin writes a run's profiler traces: the results folder's `profiles/`
# (session/worker.py), or `logs/profiles/` without one (server/workers.py).
TRACE_FOLDERS = ("profiles", "logs/profiles")
_SQLITE_HEADER = b"SQLite format 3\x00"


def run_files(results_dir: Path, row: Mapping[str, Any]) -> list[RunFile]:
    """The run's files that lie in `results_dir` (the folder of its database): its record,
    its request file, its server's log and its profiler traces, each only where the plugin
    writes that kind of file. A path that leads elsewhere (`..`, an absolute path, a symbolic
    link out, another folder of the results) is not one of them, and neither is a database
    or its journal: a record names its trace files itself, and may name `results.db`."""
    root = results_dir.resolve()
    run_id = str(row["run_id"])
    candidates: list[tuple[str, Path, Path]] = [
        ("record", root, results_dir / f"{run_id}.json"),
        ("record", root / UPLOADS, results_dir / UPLOADS / stored_name(run_id)),
        ("requests", root, results_dir / f"{run_id}.requests.jsonl.gz"),
    ]
    candidates += [(kind, root / "logs", path) for kind, path in _server_logs(results_dir, row)]
    traces = (stored_json(row.get("profiling"), {}) or {}).get("traces") or []
    for trace in traces[:MAX_TRACE_FILES] if isinstance(traces, list) else []:
        if isinstance(trace, dict) and isinstance(trace.get("path"), str):
            path = Path(trace["path"])
            path = path if path.is_absolute() else results_dir / path
            candidates += [("trace", root / folder, path) for folder in TRACE_FOLDERS]
    files: list[RunFile] = []
    for kind, folder, path in candidates:
        inside = within(folder, path)
        if inside is None or not inside.is_file() or _is_database(inside):
            continue
        name = inside.relative_to(root).as_posix()
        if all(f.name != name for f in files):
            files.append(RunFile(kind, name, inside, inside.stat().st_size))
    return files


def _server_logs(results_dir: Path, row: Mapping[str, Any]) -> list[tuple[str, Path]]:
    """The run's server log: the file its record names (one per server and session), else,
    for a record from before logs were named by session, the log of its suite's server with
    its key, which also holds the output of that server's other sessions (said in its kind).
    Never a log of another suite's server with the same key."""
    logs = results_dir / "logs"
    named = row.get("runtime_server_log")
    if isinstance(named, str) and named:
        return [("log", logs / named)] if "/" not in named and "\\" not in named else []
    server_key, suite = row.get("runtime_server_key"), row.get("suite")
    if not (isinstance(server_key, str) and server_key.isalnum() and isinstance(suite, str)):
        return []
    prefix = f"{safe_name(suite)}-"
    return [("log (every session of this server)", path) for path in sorted(
        logs.glob(f"*-{server_key}.log")) if path.name.startswith(prefix)]


def _is_database(path: Path) -> bool:
    """A SQLite database or one of its journals: never a file of a run."""
    if path.name.endswith(("-wal", "-shm", "-journal")):
        return True
    try:
        with path.open("rb") as file:
            return file.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return True


def within(root: Path, path: Path) -> Path | None:
    """`path` resolved (links followed), where it lies inside `root`; else None."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL in a record's path
        return None
    return resolved if resolved.is_relative_to(root) and resolved != root else None
