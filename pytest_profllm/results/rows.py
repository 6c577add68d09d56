"""Records to rows of `benchmark_runs`: a record's blocks flattened to one value per column
(results/table.py), each of its column's type (lists and mappings as JSON text, a request
rate of "inf" as a number), plus the derived columns (configuration, workload, device) and the
digest of the record's file, which tells a record already stored as it is.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pytest_profllm.results.record import is_valid, sim_device
from pytest_profllm.results.record_files import record_bytes
from pytest_profllm.results.table import FIXED_COLUMNS, column_types


def record_digest(content: bytes) -> str:
    """The digest of a record file's bytes: the same file loaded again is unchanged."""
    return hashlib.blake2b(content, digest_size=12).hexdigest()


# Names a results key (the one block without a prefix) cannot take as its column: SQLite's
# names of a row's id, which a column so named hides (a load selects staged rows by it), and
# the staging table's own column (results/staging.py).
RESERVED_COLUMNS = frozenset({"rowid", "oid", "_rowid_", "profllm_server"})
# The blocks whose keys become columns, as a record names them.
_BLOCK_NAMES = ("config.server", "config.benchmark", "results", "system", "runtime", "cost")


def column_problem(record: dict[str, Any]) -> str | None:
    """Why a record's keys cannot all be column names (None: they can): a NUL character,
    which SQLite's statements cannot hold, or a reserved name."""
    for name, block in zip(_BLOCK_NAMES, _blocks(record), strict=True):
        if not isinstance(block, dict):
            continue
        # One search of all the keys joined (an ingest checks 400 keys of 100,000 records),
        # then the key that holds it.
        try:
            joined = "".join(block)
        except TypeError:  # a key that is not text (a record made in Python)
            joined = "".join(map(str, block))
        if "\x00" in joined:
            key = next(key for key in block if "\x00" in str(key))
            return f"{name} has a key with a NUL character ({key!r}): no column name holds one"
        if name == "results" and isinstance(block, dict):
            for key in block:
                if str(key).lower() in RESERVED_COLUMNS:
                    return (f"results.{key}: a name the table keeps for itself (SQLite's "
                            "row id, or the load's own column); rename the metric")
    return None


def _blocks(record: dict[str, Any]) -> tuple[Any, ...]:
    config = record.get("config") or {}
    return (config.get("server") or {}, config.get("benchmark") or {},
            record.get("results") or {}, record.get("system") or {},
            record.get("runtime") or {}, record.get("cost") or {})


def record_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record flattened to one table row, each value of its column's type."""
    rows = RowBuilder()
    rows.add(record)
    (batch,) = rows.batches()
    return dict(zip(batch.columns, batch.values[0], strict=True))


# The record's blocks, in row order, with the prefix of their columns.
_BLOCK_PREFIXES = ("server_", "bench_", "", "system_", "runtime_", "cost_")
_FIXED = tuple(FIXED_COLUMNS)
_CONTAINERS = frozenset((dict, list))
_EMPTY_JSON = {dict: "{}", list: "[]"}
_REPEAT_SUFFIX = re.compile(r"-r\d+$")


@dataclass
class RowBatch:
    """Rows as one column list and a tuple of values per row."""

    columns: list[str]
    values: list[tuple[Any, ...]]

    def column(self, name: str) -> list[Any]:
        if not self.values:
            return []
        at = self.columns.index(name)
        return [row[at] for row in self.values]

    def run_ids(self) -> list[str]:
        return self.column("run_id")


class RowBuilder:
    """Records to rows, grouped in batches by shape (the keys of their blocks).

    An ingest builds 100,000 rows of 400+ values. Records of one database share a few
    shapes, so the column names, the positions of numeric values and the handling of a key
    two blocks share are worked out once per shape; a row is then the record's block values
    in one tuple, with only the JSON cells and text in numeric columns converted.
    """

    def __init__(self) -> None:
        self._shapes: dict[tuple[tuple[str, ...], ...], _Shape] = {}

    def add(self, record: dict[str, Any], digest: str | None = None) -> None:
        """Adds a record's row. `digest` is its file's `record_digest`; without it, that of
        the bytes its file is written with."""
        if digest is None:
            digest = record_digest(record_bytes(record))
        blocks = _blocks(record)
        key = tuple(map(tuple, blocks))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape.of(key)
        values = list(_fixed_values(record, digest))
        for block in blocks:
            values += block.values()
        # SQLite has no lists or mappings: they are stored as JSON text.
        for at in itertools.compress(range(len(values)),
                                     map(_CONTAINERS.__contains__, map(type, values))):
            value = values[at]
            values[at] = _json_text(value) if value else _EMPTY_JSON[value.__class__]
        # JSON has no infinity: records carry an infinite request rate as "inf".
        for at in shape.numeric:
            if values[at].__class__ is str:
                values[at] = _number(values[at])
        shape.rows.append(tuple(values) if shape.keep is None else shape.keep(values))

    def batches(self) -> list[RowBatch]:
        return [RowBatch(shape.columns, shape.rows) for shape in self._shapes.values()]


@dataclass
class _Shape:
    columns: list[str]
    # The positions of text that may be a number: workload parameters and metrics.
    numeric: tuple[int, ...]
    # Where two blocks share a column name, the first value (the record's top level first)
    # is kept: a metric named like a fixed column never overwrites it.
    keep: Callable[[list[Any]], tuple[Any, ...]] | None
    rows: list[tuple[Any, ...]] = field(default_factory=list)

    @classmethod
    def of(cls, key: tuple[tuple[str, ...], ...]) -> _Shape:
        names = list(_FIXED)
        numeric_columns = _numeric_columns()
        numeric = []
        for prefix, keys in zip(_BLOCK_PREFIXES, key, strict=True):
            # SQLite's column names ignore case: one spelling per name, whatever a record's.
            for name in (prefix + key.lower() for key in keys):
                if prefix in ("bench_", "") and name in numeric_columns:
                    numeric.append(len(names))
                names.append(name)
        first = {name: at for at, name in reversed(list(enumerate(names)))}
        if len(first) == len(names):
            return cls(names, tuple(numeric), None)
        kept = sorted(first.values())
        return cls([names[at] for at in kept], tuple(numeric),
                   lambda values: tuple(values[at] for at in kept))


def _fixed_values(record: dict[str, Any], digest: str) -> tuple[Any, ...]:
    """The values of `FIXED_COLUMNS`, in their order."""
    engine = record.get("engine") or {}
    engine_args = (record.get("config") or {}).get("engine_args") or {}
    case_id = str(record.get("case_id") or "")
    configuration, _, workload = case_id.rpartition("::")
    # The column keeps its first name, `verdicts` (docs/reference/record.md); an older
    # record as written (not read by ingest) may still say `verdicts` itself.
    threshold_results = record.get("threshold_results", record.get("verdicts"))
    capacity = record.get("capacity") or {}
    accuracy = record.get("accuracy") or {}
    until = record.get("until") or {}
    failed = ",".join(result["metric"] for result in threshold_results or ()
                      if not result["passed"])
    return (
        record.get("run_id"),
        record.get("session_id"),
        record.get("suite"),
        record.get("source"),
        record.get("case_id"),
        record.get("nodeid"),
        record.get("repeat_index"),
        record.get("timestamp"),
        record.get("status"),
        record.get("message"),
        "valid" if is_valid(record) else "invalid",
        record.get("validity_reasons"),
        # `duration` is the metric (vLLM's: the benchmark's requests); the whole case apart.
        record.get("duration"),
        engine.get("name"),
        engine.get("version"),
        engine.get("reason"),
        engine.get("distribution"),
        engine_args.get("vllm_version"),
        engine_args.get("source"),
        engine.get("clock") or ("real" if engine.get("name") in ("sim", "vllm") else None),
        _sim_profile(engine.get("sim_profile")),
        # For grouping: the case without its workload, the workload without its repeat
        # number, the devices it ran on.
        configuration or case_id,
        _REPEAT_SUFFIX.sub("", workload),
        _device(record.get("system") or {}, engine),
        record.get("thresholds"),
        threshold_results,
        record.get("profiling"),
        record.get("regression"),
        failed or None,
        _axes_columns((record.get("config") or {}).get("axes")),
        capacity.get("limit"),
        capacity or None,
        record.get("attempts") or None,
        (record.get("server_view") or {}).get("problem"),
        record.get("server_view") or None,
        accuracy.get("task"),
        accuracy.get("plumbing_check"),
        accuracy.get("lm_eval_version"),
        accuracy.get("task_hash"),
        accuracy or None,
        record.get("by_adapter") or None,
        until.get("stopped_by"),
        until or None,
        digest,
    )


def _axes_columns(axes: Any) -> str | None:
    """The record's declared axes (`server.max_num_seqs`) as the columns that hold them."""
    if not isinstance(axes, list) or not axes:
        return None
    prefixes = {"server": "server_", "benchmark": "bench_"}
    columns = [prefixes[block] + key for block, _, key in (str(a).partition(".") for a in axes)
               if block in prefixes and key]
    return json.dumps(columns) if columns else None


@functools.cache
def _numeric_columns() -> frozenset[str]:
    return frozenset(name for name, kind in column_types().items() if kind in ("REAL", "INTEGER"))


def _device(system: dict[str, Any], engine: dict[str, Any]) -> str:
    if engine.get("clock") == "virtual":
        # A prediction, and of which GPU: never grouped (or compared, on the dashboards) with
        # the real-time simulator's rows, whose device is `virtual`.
        modelled = ((engine.get("sim") or {}).get("device") or {}).get("name")
        return f"virtual clock: {modelled}" if modelled else "virtual clock"
    names = system.get("gpu_names") or []
    if not names:
        # vLLM's CPU build on the host's cores, or the simulator on virtual GPUs (named by
        # the GPU it modelled, so runs simulated as two GPUs are never grouped as one).
        if system.get("device_kind") == "virtual":
            modelled = sim_device(engine)
            return f"virtual: {modelled}" if modelled else "virtual"
        if not system.get("device_kind") and not system.get("device_name"):
            return "unknown"  # a file that does not say (a profllm bench result)
        return f"cpu: {system['device_name']}" if system.get("device_name") else "cpu"
    distinct = sorted(set(names))
    return " + ".join(f"{names.count(name)}x {name}" for name in distinct)


def _sim_profile(profile: Any) -> str | None:
    if not isinstance(profile, dict) or not profile.get("sha256"):
        return None
    return f"{profile.get('name')} ({str(profile['sha256'])[:12]})"


def _json_text(value: dict[str, Any] | list[Any]) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()


def _number(text: str) -> Any:
    # JSON has no infinity: records carry an infinite request rate as "inf". SQLite's REAL
    # holds it (Infinity), so `bench_request_rate > 10` and sorting treat it as a number.
    try:
        return float(text)
    except ValueError:
        return text
