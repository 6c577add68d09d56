"""`profllm ingest`: record files from anywhere (other hosts, CI artifacts, `profllm bench
--save-result` files) into a results database, saying what it did.

Each file is read and checked whole before any of it is stored: a file that is not JSON, not
a record, or carries a non-finite metric (NaN, infinity: no measurement produces one, and
SQLite and JSON readers would show it as a number) is refused, named with its reason, and
nothing of it is stored; the good files are loaded all the same. A run id given twice (the
same file named twice, or a copy) is loaded once. A `profllm bench --save-result` file
becomes a record of suite `bench`, its run id derived from its content, so loading it again
changes nothing either.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_profllm.record import normalize
from pytest_profllm.store import LoadReport, RowBatch, batched, load_rows, record_row

BENCH_SUITE = "bench"


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
    hidden and temporary files left out); each file once."""
    found: dict[Path, None] = {}
    for path in paths:
        if path.is_dir():
            for child in sorted(path.glob("*.json")):
                if not child.name.startswith("."):
                    found.setdefault(child.resolve(), None)
        else:
            found.setdefault(path.resolve() if path.exists() else path, None)
    return list(found)


def read_record(path: Path) -> dict[str, Any]:
    """One file as a record (JSON data of the current schema); ValueError with the reason."""
    import orjson

    try:
        content = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read: {error.strerror or error}") from None
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError as error:
        # orjson refuses NaN and Infinity; Python's json reads them, so that the refusal can
        # name the metric.
        try:
            data = json.loads(content)
        except ValueError:
            raise ValueError(f"not JSON: {error}") from None
    if isinstance(data, dict) and "schema_version" not in data and _is_bench_result(data):
        data = bench_record(data, path)
    results = data.get("results") if isinstance(data, dict) else None
    for name, value in (results.items() if isinstance(results, dict) else ()):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"results.{name} is {value}: metrics must be finite numbers")
    try:
        normalize(data)
    except ValueError as error:
        raise ValueError(f"not a profllm record: {error}") from None
    # Checked against the schema; stored as read (a dump of the model would cost as much
    # again, at 100,000 records).
    result: dict[str, Any] = data
    return result


def _is_bench_result(data: dict[str, Any]) -> bool:
    return {"date", "backend", "model_id", "request_throughput"} <= set(data)


# `profllm bench` result keys that are workload parameters (the rest are metrics or lists).
_BENCH_PARAMETERS = ("backend", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                     "ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps")
_BENCH_NOT_METRICS = {"date", "endpoint_type", "label", "model_id", "tokenizer_id", "verdict",
                      "invalid_reason", *_BENCH_PARAMETERS}


def bench_record(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """A `profllm bench --save-result` file as a record of suite `bench`.

    What the file does not say is left empty, never invented: the server's engine arguments
    other than the model, the host, the devices. Its run id is a digest of its content.
    """
    import orjson

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
    invalid = result.get("verdict") == "invalid"
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
        "engine": {"name": "vllm", "reason": "profllm bench --save-result file: the server's "
                   "engine is not recorded there"},
        "config": {"server": {"model": model}, "benchmark": benchmark},
        "results": metrics_,
        "system": {"host": "", "platform": "", "python": ""},
        "runtime": {"worker": "profllm bench", "server_key": ""},
    }


def ingest(
    db_path: Path,
    files: list[Path],
    progress: Callable[[int], None] | None = None,
) -> IngestReport:
    """Load every good file, refuse every bad one (with its reason), in one transaction."""
    report = IngestReport(files=len(files))
    seen: set[str] = set()

    def rows() -> Iterator[RowBatch]:
        for read, refused in _read_batches(files):
            report.refused += refused
            fresh = []
            for run_id, row in zip(read.run_ids(), read.values, strict=True):
                if run_id in seen:
                    report.duplicates += 1
                else:
                    seen.add(run_id)
                    fresh.append(row)
            if progress is not None:
                progress(len(read.values) + len(refused) - len(fresh))
            if fresh:
                yield RowBatch(read.columns, fresh)

    batches = rows()
    first = next(batches, None)
    if first is None:
        return report
    report.load = load_rows(db_path, _chain(first, batches), progress)
    return report


Batch = tuple[RowBatch, list[tuple[Path, str]]]
# Reading and checking a record costs about as much as storing it: other processes read the
# next batches while this one writes.
_PARALLEL_FROM = 2_000
_IN_FLIGHT = 4


def _read_batches(files: list[Path]) -> Iterator[Batch]:
    chunks = list(batched(files))
    if len(files) < _PARALLEL_FROM:
        yield from map(_read_batch, chunks)
        return
    import os
    from concurrent.futures import Future, ProcessPoolExecutor

    workers = max(1, min(2, (os.cpu_count() or 1)))
    with ProcessPoolExecutor(workers) as pool:
        pending: list[Future[Batch]] = []
        for chunk in chunks:
            pending.append(pool.submit(_read_batch, chunk))
            if len(pending) >= _IN_FLIGHT:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


def _read_batch(paths: list[Path]) -> Batch:
    rows, refused = [], []
    for path in paths:
        try:
            rows.append(record_row(read_record(path)))
        except ValueError as error:
            refused.append((path, str(error)))
    return RowBatch.from_rows(rows), refused


def _chain(first: RowBatch, rest: Iterator[RowBatch]) -> Iterator[RowBatch]:
    yield first
    yield from rest
