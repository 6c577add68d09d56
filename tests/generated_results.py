"""A large results database of realistic shape, generated: several suites, each run in many
sessions, each sweeping a batch limit and a load; the latest session of one suite is slowed
and its gate called that regressed. For the browser test at 100,000 records (and anyone who
wants to look at a big database: `python tests/generated_results.py OUT.db 100000`)."""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from test_datasette import make_record

from pytest_profllm.results.gate_tables import gate_rows
from pytest_profllm.results.rows import RowBuilder, record_digest
from pytest_profllm.results.staging import stage
from pytest_profllm.results.store import Load

SUITES = ("smoke", "long-context", "chat", "batch", "tp-scaling", "prefix", "spec", "nightly")
LOADS: tuple[float | str, ...] = (2.0, 8.0, 32.0, "inf")
BATCH_LIMITS = (16, 64, 256)
CASES_PER_SESSION = len(LOADS) * len(BATCH_LIMITS)  # 12
SLOWED = 0.7  # the last session's throughput against the one before


def records(count: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    """`count` records; sessions of 12 cases each, suites taking turns; the last session is
    slowed, with the regression gate's decision on its output throughput."""
    rng = random.Random(seed)
    # One record validated per batch limit and load; the others are it with their own names,
    # times and throughput (validating each took a quarter of a large database's time).
    made: dict[tuple[int, float | str], dict[str, Any]] = {}
    sessions = -(-count // CASES_PER_SESSION)
    # The first session is the one cut short, so the last (slowed) one is whole.
    skip = sessions * CASES_PER_SESSION - count
    for session in range(sessions):
        suite = SUITES[session % len(SUITES)]
        last = session == sessions - 1
        day, minute = divmod(session, 24 * 60)
        stamp = f"2026-{1 + day // 28:02d}-{1 + day % 28:02d}T{minute // 60:02d}:{minute % 60:02d}"
        session_id = f"s{session:06d}"
        for index, (seqs, rate) in enumerate(itertools.product(BATCH_LIMITS, LOADS)):
            if skip:
                skip -= 1
                continue
            load = 64.0 if rate == "inf" else float(rate)
            capacity = seqs * 0.5  # requests per second the batch limit carries
            throughput = min(load, capacity) * rng.uniform(0.95, 1.05) * (SLOWED if last else 1)
            if (seqs, rate) not in made:
                made[seqs, rate] = make_record(
                    "", "", "", "", max_num_seqs=seqs, request_rate=rate,
                    p99_ttft=20.0 * load / min(1.0, capacity / load))
            template = made[seqs, rate]
            case_id = f"bench_{suite}.yaml::model-seqs{seqs}::random-rate{rate}"
            # Loading reads a record and never changes it: the parts they share are shared.
            record = {
                **template,
                "run_id": f"{session_id}-{index:02d}", "session_id": session_id,
                "case_id": case_id, "nodeid": f"benchmarks/{case_id}",
                "timestamp": f"{stamp}:{index:02d}+00:00", "suite": suite,
                "results": {**template["results"], "request_throughput": throughput,
                            "output_throughput": throughput * 10},
            }
            if last:
                record["regression"] = [{
                    "metric": "output_throughput", "decision": "regressed", "tolerance": 0.05,
                    "higher_is_better": True, "baseline": 1.0, "value": SLOWED,
                    "change": SLOWED - 1, "confidence": 0.99,
                    "baseline_session": f"s{session - len(SUITES):06d}"}]
            yield record


def generate(path: Path, count: int, seed: int = 7, batch: int = 5000) -> int:
    """Loads `count` generated records into the database at `path`, a batch at a time, with
    their rows of the gate's tables (as `profllm ingest` loads record files, but for the
    record digest: see `_load`)."""
    loaded = 0
    chunk: list[dict[str, Any]] = []
    for record in records(count, seed):
        chunk.append(record)
        if len(chunk) == batch:
            loaded += _load(path, chunk)
            chunk = []
    if chunk:
        loaded += _load(path, chunk)
    return loaded


def _load(path: Path, chunk: list[dict[str, Any]]) -> int:
    rows = RowBuilder()
    shared: dict[Any, str] = {}
    gates = [gate_rows(record, None, shared) for record in chunk]
    for record in chunk:
        # These records have no files: the digest is that of their compact JSON. The file's
        # form (record_bytes, indented) goes through json's pure-Python encoder, which took
        # three fifths of the time of a 100,000-record database.
        rows.add(record, record_digest(orjson.dumps(record)))
    staged = stage(rows.batches())
    assert staged is not None
    with Load(path) as load:
        load.add(staged)
        load.add_gates(gates)
    return len(chunk)


if __name__ == "__main__":
    print(generate(Path(sys.argv[1]), int(sys.argv[2])), "records loaded")
