"""`profllm ingest`: record files from anywhere (other hosts, CI artifacts, `profllm bench
--save-result` files) into a results database, saying what it did.

Each file is read and checked whole before any of it is stored: a file that is not JSON, not
a record, or carries a non-finite metric (NaN, infinity: no measurement produces one, and
SQLite and JSON readers would show it as a number) is refused, named with its reason, and
nothing of it is stored; the good files are loaded all the same. A run id given twice (the
same file named twice, or a copy) is loaded once. A `profllm bench --save-result` file
becomes a record of suite `bench`, its run id derived from its content, so loading it again
changes nothing either.

From 2,000 files on, two other processes read, check and stage the files batch by batch
while this one copies the staged rows into the database; a file whose bytes are those of a
stored record is counted unchanged without being parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from pytest_profllm.limits import (
    MAX_RECORD_BYTES,
    MAX_RESULTS,
    MAX_SERVER_ARGUMENTS,
    InputLimitError,
    load_json,
)
from pytest_profllm.results.files import not_regular, read_regular
from pytest_profllm.results.gate_tables import GateRows, gate_rows
from pytest_profllm.results.record import (
    expected_requests,
    normalize,
    read_requests,
    upgrade_keys,
)
from pytest_profllm.results.rows import RowBuilder, column_problem, record_digest
from pytest_profllm.results.staging import BATCH, StagedRows, batched, stage
from pytest_profllm.results.store import Load, LoadReport

BENCH_SUITE = "bench"


class IngestError(Exception):
    """An ingest that cannot go on (a process reading the files died)."""


@dataclass
class IngestReport:
    files: int = 0
    duplicates: int = 0
    refused: list[tuple[Path, str]] = field(default_factory=list)
    load: LoadReport = field(default_factory=LoadReport)

    def summary(self, db_path: Path) -> str:
        load = self.load
        parts = [f"{load.new} new", f"{load.unchanged} unchanged"]
        if load.updated:
            parts.append(f"{load.updated} updated")
        parts.append(f"{len(self.refused)} refused")
        if self.duplicates:
            parts.append(f"{self.duplicates} duplicate(s) counted once")
        return f"{db_path} (table benchmark_runs): " + ", ".join(parts)


def record_files(paths: Iterable[Path]) -> list[Path]:
    """The files named, or the record files found in the folders named (per-request files,
    hidden and temporary files left out); each file once. A link to a regular file is that
    file; a link to anything else keeps its own name, which its refusal then gives."""
    found: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            # One scandir, not a glob and a resolve per file: at 100,000 files those took
            # longer than reading the records. Only links are resolved (a link to a file
            # named as well is that file).
            folder = path.resolve()
            with os.scandir(folder) as entries:
                names = sorted((entry.name, entry.is_symlink()) for entry in entries
                               if entry.name.endswith(".json")
                               and not entry.name.startswith("."))
            for name, is_link in names:
                child = folder / name
                found.setdefault(_target(child) if is_link else child, None)
        else:
            found.setdefault(_target(path), None)
    return list(found)


def _target(path: Path) -> Path:
    """The file a link names, where that is a regular file; else the path as given."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return path
    return path.resolve() if regular else path


def read_record(path: Path) -> dict[str, Any]:
    """One file as a record (JSON data of the current schema); ValueError with the reason."""
    return parse_record(_read(path), path)


def _read(path: Path) -> bytes:
    # A regular file only, and no more than the limit + 1 bytes of it: a FIFO would hang the
    # read, /dev/zero fill memory, and a 1.5 GB file cost its size before being refused.
    return read_regular(path, MAX_RECORD_BYTES)


def parse_record(content: bytes, path: Path) -> dict[str, Any]:
    """A record file's bytes as a checked record (or a `profllm bench` result as one); a
    ValueError says why not."""
    try:
        data = load_json(content, what="the file", max_bytes=MAX_RECORD_BYTES)
    except InputLimitError:
        raise
    except ValueError as error:
        raise ValueError(f"not JSON: {error}") from None
    if isinstance(data, dict) and "schema_version" not in data and _is_bench_result(data):
        data = bench_record(data, path)
    # orjson refuses NaN and Infinity; load_json reads them, so that the refusal can name
    # the metric.
    _check_finite(data)
    try:
        normalize(data)
    except ValueError as error:
        raise ValueError(f"not a profllm record: {error}") from None
    _check_width(data)
    if (problem := column_problem(data)) is not None:
        raise ValueError(problem)
    # Checked against the schema; stored as read (a dump of the model would cost as much
    # again, at 100,000 records), with the keys an older record wrote under their current
    # names (`verdicts` is `threshold_results`, a regression item's `verdict` its `decision`).
    result: dict[str, Any] = upgrade_keys(data)
    return result


def _check_width(data: dict[str, Any]) -> None:
    """A record too wide for the table is refused alone, before it reaches the load."""
    results = data.get("results") or {}
    server = (data.get("config") or {}).get("server") or {}
    for what, block, limit in (("results", results, MAX_RESULTS),
                               ("config.server", server, MAX_SERVER_ARGUMENTS)):
        if len(block) > limit:
            raise ValueError(
                f"{what} has {len(block):,} keys, more than the {limit:,} a table holds"
            )
        # All lower case (the usual): no two can differ in case alone.
        if not "".join(block).islower() and len(set(map(str.lower, block))) < len(block):
            seen: dict[str, str] = {}
            for key in block:
                if (other := seen.setdefault(str(key).lower(), key)) != key:
                    raise ValueError(f"{what} has keys {other!r} and {key!r}, which differ only "
                                     "in case: a table's column names do not")


def _check_finite(data: Any) -> None:
    results = data.get("results") if isinstance(data, dict) else None
    for name, value in (results.items() if isinstance(results, dict) else ()):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"results.{name} is {value}: metrics must be finite numbers")
        if isinstance(value, str) and not _finite_text(value):
            # The record's model reads "NaN" and "Infinity" as numbers, and the table would
            # store them as NULL and Infinity.
            raise ValueError(f"results.{name} is {value!r}, not a finite number: metrics "
                             "must be finite numbers")


def _finite_text(text: str) -> bool:
    """Whether a metric given as text is not one that reads as NaN or an infinity (text that
    is no number at all is the model's to refuse)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return True


def _is_bench_result(data: dict[str, Any]) -> bool:
    return {"date", "backend", "model_id", "request_throughput"} <= set(data)


# `profllm bench` result keys that are workload parameters (the rest are metrics or lists).
_BENCH_PARAMETERS = ("backend", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                     "ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps")
_BENCH_NOT_METRICS = {"date", "endpoint_type", "label", "model_id", "tokenizer_id", "validity",
                      "verdict", "invalid_reason", "engine", *_BENCH_PARAMETERS}


def bench_record(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """A `profllm bench --save-result` file as a record of suite `bench`.

    What the file does not say is left empty, never invented: the server's engine arguments
    other than the model, the host, the devices. Its run id is a digest of its content.
    """

    digest = hashlib.blake2b(orjson.dumps(result, option=orjson.OPT_SORT_KEYS),
                             digest_size=8).hexdigest()
    try:
        started = datetime.strptime(str(result["date"]), "%Y%m%d-%H%M%S").astimezone(UTC)
    except ValueError:
        raise ValueError(f"date {result['date']!r} is not YYYYMMDD-HHMMSS") from None
    label = result.get("label") or result.get("backend") or "bench"
    rate = result.get("request_rate")
    concurrency = result.get("max_concurrency")
    workload = f"rate-{rate}" + (f"-concurrency{concurrency}" if concurrency else "")
    model = str(result["model_id"])
    # `verdict` is what bench results written before `validity` called it.
    invalid = (result.get("validity") or result.get("verdict")) == "invalid"
    engine = _bench_engine(result.get("engine"))
    benchmark = {key: result[key] for key in _BENCH_PARAMETERS if result.get(key) is not None}
    metrics_ = {
        key: value
        for key, value in result.items()
        if key not in _BENCH_NOT_METRICS and isinstance(value, int | float)
        and not isinstance(value, bool)
    }
    return {
        "schema_version": 1,
        "run_id": f"bench-{digest}",
        "session_id": f"bench-{result['date']}",
        "suite": BENCH_SUITE,
        "source": str(path),
        "case_id": f"{label}::{model}::{workload}",
        "nodeid": str(path),
        "timestamp": started.isoformat(),
        "duration": float(result.get("duration") or 0.0),
        "status": "invalid" if invalid else "passed",
        "message": result.get("invalid_reason") if invalid else None,
        "engine": engine,
        "config": {"server": {"model": model}, "benchmark": benchmark},
        "results": metrics_,
        # The simulator's devices are virtual; what else served is not in the file.
        "system": {"host": "", "platform": "", "python": "",
                   "device_kind": "virtual" if engine["name"] == "sim" else None},
        "runtime": {"worker": "profllm bench", "server_key": ""},
    }


def _bench_engine(said: object) -> dict[str, Any]:
    """The engine a `profllm bench` file names (the server said it), else `unknown`."""
    if isinstance(said, dict) and said.get("name") in ("vllm", "sim"):
        return {"name": said["name"], "version": said.get("version"),
                "reason": "the server said so to profllm bench"}
    return {"name": "unknown", "reason": "profllm bench file: the server's engine is not "
            "recorded there"}


def ingest(
    db_path: Path,
    files: list[Path],
    progress: Callable[[int], None] | None = None,
) -> IngestReport:
    """Load every good file, refuse every bad one (with its reason), in one transaction.

    A file whose bytes are those of a stored record is unchanged without being parsed: it is
    read and digested only. A new database is made only when there is a record to load.
    """
    report = IngestReport(files=len(files))
    if not files:
        return report
    with ExitStack() as stack:
        load = stack.enter_context(Load(db_path)) if db_path.exists() else None
        stored = load.stored_digests() if load is not None else {}
        seen: dict[str, tuple[str, Path]] = {}  # run id: the digest and file first loaded
        for batch in _read_batches(files, frozenset(stored)):
            report.refused += batch.refused
            unchanged = _unseen(
                seen, [stored[digest] for digest in batch.stored], batch.stored, batch.paths,
                report,
            )
            if load is not None:
                load.add_unchanged(len(unchanged))
            staged = batch.staged
            if staged is not None:
                fresh = _unseen(seen, staged.run_ids, staged.digests, batch.paths, report)
                if fresh:
                    if load is None:
                        load = stack.enter_context(Load(db_path))
                    load.add(staged, fresh)
                    # The gate's tables too: any results database is a baseline and a history.
                    load.add_gates([batch.gates[staged.run_ids[at]] for at in fresh])
            if progress is not None:
                progress(batch.files)
    if load is not None:
        report.load = load.report
    return report


def _unseen(
    seen: dict[str, tuple[str, Path]],
    run_ids: list[str],
    digests: list[str],
    paths: dict[str, Path],
    report: IngestReport,
) -> list[int]:
    """The positions of the run ids not seen before (now seen). A run id given twice with the
    same bytes (the same file named twice, or a copy) is loaded once and counted a duplicate;
    given twice with other bytes, the first file is loaded and the second refused, naming both:
    which of the two is the run cannot be told, and keeping one silently hid the other."""
    fresh = []
    for at, (run_id, digest) in enumerate(zip(run_ids, digests, strict=True)):
        first = seen.get(run_id)
        if first is None:
            seen[run_id] = (digest, paths.get(digest, Path("?")))
            fresh.append(at)
        elif first[0] == digest:
            report.duplicates += 1
        else:
            report.refused.append((
                paths.get(digest, Path("?")),
                f"run {run_id!r} is also in {first[1]} with other content: that file was "
                "loaded; remove or rename one of the two",
            ))
    return fresh


@dataclass
class _Batch:
    """What reading a batch of files found: the rows of the records not stored as they are,
    the digests of files that are, and the files refused with their reason."""

    files: int
    staged: StagedRows | None
    stored: list[str]
    refused: list[tuple[Path, str]]
    gates: dict[str, GateRows] = field(default_factory=dict)  # by run id
    paths: dict[str, Path] = field(default_factory=dict)  # each file read, by its digest


# Reading, checking and staging a record costs ten times what copying it into the table
# does: other processes read the next batches while this one writes.
_PARALLEL_FROM = 2_000
_FILES_PER_BATCH = BATCH
_IN_FLIGHT = 4
_stored_in_worker: frozenset[str] = frozenset()


def _read_batches(files: list[Path], stored: frozenset[str]) -> Iterator[_Batch]:
    chunks = list(batched(files, _FILES_PER_BATCH))
    if len(files) < _PARALLEL_FROM:
        for chunk in chunks:
            yield _read_batch(chunk, stored)
        return

    workers = max(1, min(2, (os.cpu_count() or 1)))
    # The stored digests go to each worker once, not with every batch.
    with ProcessPoolExecutor(workers, initializer=_start_worker, initargs=(stored,)) as pool:
        pending: list[Future[_Batch]] = []
        try:
            for chunk in chunks:
                pending.append(pool.submit(_read_batch_in_worker, chunk))
                if len(pending) >= _IN_FLIGHT:
                    yield pending.pop(0).result()
            for future in pending:
                yield future.result()
        except BrokenProcessPool:
            raise IngestError("a process reading the record files died (killed, or out of "
                              "memory)") from None
        finally:
            for future in pending:
                future.cancel()


def _start_worker(stored: frozenset[str]) -> None:
    global _stored_in_worker
    _stored_in_worker = stored


def _read_batch_in_worker(paths: list[Path]) -> _Batch:
    return _read_batch(paths, _stored_in_worker)


def _read_batch(paths: list[Path], stored: frozenset[str]) -> _Batch:
    rows = RowBuilder()
    known, refused = [], []
    gates: dict[str, GateRows] = {}
    fingerprints: dict[Any, str] = {}  # what the batch's records share of their fingerprints
    read: dict[str, Path] = {}
    for path in paths:
        try:
            content = _read(path)
            digest = record_digest(content)
            read.setdefault(digest, path)
            if digest in stored:
                known.append(digest)
            else:
                record = parse_record(content, path)
                requests = _requests_beside(path, record)
                try:
                    gate = gate_rows(record, requests, fingerprints)
                except (TypeError, KeyError) as error:
                    raise ValueError(
                        f"its request file has a row that is not one: {error!r}"
                    ) from None
                rows.add(record, digest)
                gates[record["run_id"]] = gate
        except ValueError as error:
            # One line whatever the record holds: a key may itself carry a newline.
            refused.append((path, str(error).replace("\r", "\\r").replace("\n", "\\n")))
    return _Batch(len(paths), stage(rows.batches()), known, refused, gates, read)


def _requests_beside(path: Path, record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The record's per-request rows, where its `.requests.jsonl.gz` lies beside it: read a
    line at a time, no more rows than the record's own completed + failed (record.py)."""
    run_id = record["run_id"]
    if Path(run_id).name != run_id or run_id in ("", ".", ".."):
        # A run id that is a path would name a request file outside the record's folder.
        raise ValueError(f"run id {run_id!r} is not a file name: its request file could not "
                         "lie beside it")
    # A FIFO under its name would hang the read, a device feed it without end.
    beside = path.parent / f"{run_id}.requests.jsonl.gz"
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.stat(beside).st_mode):
            raise ValueError(f"its request file {beside.name}: " + not_regular(beside))
    return read_requests(path.parent, run_id, expected_requests(record))
