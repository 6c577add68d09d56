"""One past case, reproduced from its record as a suite, and run again gated against the run
it came from (`profllm rerun RUN_ID`, rerun.py, is the command over it)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import pytest_profllm
from pytest_profllm.engine.registry import bundled
from pytest_profllm.engine.secrets import ENV_SECRETS, REDACTED
from pytest_profllm.hosts.nvml import discover
from pytest_profllm.plan.regression import (
    BRACKETED_METRICS,
    PER_REPEAT_METRICS,
    default_tolerance,
)
from pytest_profllm.plan.suite import BENCHMARK_KINDS, load_suite_file
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.gate_tables import RUNS as GATE_RUNS
from pytest_profllm.results.record import SIM_DEFAULT_DEVICE, normalize, sim_device
from pytest_profllm.results.table import TABLE

# A run id as the plugin writes it (`20261128T104529-3f5965-7a0aaf4aa8`): never a path.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The kinds a suite can describe, and what `profllm bench` records are not (no suite ran them).
REPRODUCIBLE_KINDS = ("serve", "capacity", "throughput", "latency", "accuracy")
# Gated where the record's case had no `regression:` block: the per-request latencies (an
# offline latency run's per-iteration ones), which one run judges; a capacity by its brackets;
# an offline throughput per repeat, where the record's session ran the case twice or more.
_DEFAULT_GATES = {
    "serve": ("median_ttft_ms", "median_e2el_ms"),
    "capacity": ("capacity",),
    "accuracy": ("acc", "exact_match"),
    "latency": ("p50_latency_ms", "avg_latency_ms"),
    "throughput": ("tokens_per_second", "requests_per_second"),
}
# The options a secret can come from, besides its environment variable.
SECRET_OPTION = "--secret NAME=VALUE"


class RerunError(Exception):
    """Why a run cannot be re-run: one line."""


@dataclass
class Rerun:
    """A record turned into the suite and the pytest command that reproduce its case."""

    record: dict[str, Any]
    suite: dict[str, Any]
    pytest_options: list[str]
    differences: list[str] = field(default_factory=list)
    # What the re-run does not gate, and why (one line each).
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.record["config"]["benchmark"].get("kind") or "serve")


def find_record(run_id: str, db: Path | None, records: Path | None) -> dict[str, Any]:
    """The record of `run_id`: its file in `records` (default: the database's folder), the
    database saying the run exists where one is given. RerunError in one line otherwise."""
    if "/" in run_id or "\\" in run_id or run_id.endswith(".json") or not _RUN_ID.match(run_id):
        raise RerunError(
            f"{run_id!r} is not a run id (a path or a file name?): give the run_id column of "
            "benchmark_runs, e.g. 20261128T104529-3f5965-7a0aaf4aa8"
        )
    if db is not None:
        if not db.is_file():
            raise RerunError(f"{db}: no such database")
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
                row = connection.execute(
                    f"SELECT run_id FROM [{TABLE}] WHERE run_id = ?", (run_id,)
                ).fetchone()
        except sqlite3.DatabaseError as error:
            raise RerunError(f"{db}: not a results database ({error})") from None
        if row is None:
            raise RerunError(f"{db}: no run {run_id!r} in {TABLE}")
    folder = records if records is not None else db.parent if db is not None else None
    if folder is None:
        raise RerunError("say where the run is: --db DB or --records DIR")
    if not folder.is_dir():
        raise RerunError(f"{folder}: no such folder of records")
    path = folder / f"{run_id}.json"
    if not path.is_file():
        where = "its record file" if db is not None else "no run"
        raise RerunError(f"{folder}: {where} {path.name} is missing; give --records DIR")
    try:
        return normalize(json.loads(path.read_text())).model_dump(mode="json")
    except (OSError, ValueError) as error:
        raise RerunError(f"{path}: not a record: {error}") from None


def _axis_safe(value: Any) -> Any:
    # A list in a suite's block is an axis: one value that is a list is an axis of one.
    return [value] if isinstance(value, list) else value


def _number(value: Any) -> Any:
    # The record writes an infinite rate as "inf" (JSON has none); YAML has `.inf`.
    if value in ("inf", "Infinity"):
        return math.inf
    return value


def server_block(record: dict[str, Any], secrets: dict[str, str]) -> dict[str, Any]:
    """The record's engine arguments that differ from the registry's defaults (the record
    holds every one), with each redacted secret supplied from `secrets` or refused."""
    server = dict(record["config"]["server"])
    for name, value in server.items():
        hidden = value == REDACTED or (isinstance(value, list) and REDACTED in value)
        if not hidden:
            continue
        supplied = secrets.get(name) or os.environ.get(ENV_SECRETS.get(name, ""), "")
        if not supplied:
            variable = ENV_SECRETS.get(name)
            also = f" or the environment variable {variable}" if variable else ""
            raise RerunError(
                f"server.{name} was redacted ({REDACTED}) in the record and cannot be "
                f"reproduced: supply it with {SECRET_OPTION.replace('NAME', name)}{also}"
            )
        server[name] = supplied
    defaults = bundled().defaults()
    block = {
        name: _axis_safe(value)
        for name, value in server.items()
        if name == "model" or name not in defaults or defaults[name] != value
    }
    return block


def benchmark_block(record: dict[str, Any]) -> dict[str, Any]:
    """The workload as a suite writes it: its kind, what differs from the kind's defaults
    (a key of another dataset given at its default is refused by the suite), and the seed the
    case's prompts were drawn from (derived or not)."""
    bench = record["config"]["benchmark"]
    kind = str(bench.get("kind") or "serve")
    model = BENCHMARK_KINDS[kind]
    defaults = model.model_construct().model_dump(mode="json")
    block: dict[str, Any] = {"kind": kind}
    for key, value in bench.items():
        if key == "seed" or key not in defaults or defaults[key] != value:
            block[key] = _axis_safe(_number(value))
    return block


def _per_repeat(name: str) -> bool:
    return name in PER_REPEAT_METRICS and name not in BRACKETED_METRICS


def gated_metrics(record: dict[str, Any], kind: str) -> dict[str, float]:
    """The record's gated metrics at their tolerances; where it gated none, the default
    gates of its kind that it measured."""
    gated = {item["metric"]: item["tolerance"] for item in record.get("regression") or []}
    if gated:
        return gated
    results = record.get("results") or {}
    defaults = _DEFAULT_GATES.get(kind, ())
    return {name: default_tolerance(name) for name in defaults if results.get(name) is not None}


def regression_block(record: dict[str, Any], kind: str, repeats: int = 1) -> dict[str, float]:
    """The metrics the re-run gates (`gated_metrics`): with one repeat, not those judged on
    one value per repeat (a throughput needs two a side); where none of the record's own is
    left, the default gates of its kind that one run can judge."""
    gated = gated_metrics(record, kind)
    if repeats >= 2:
        return gated
    kept = {name: tolerance for name, tolerance in gated.items() if not _per_repeat(name)}
    if kept or not record.get("regression"):
        return kept
    return {name: tolerance for name, tolerance in gated_metrics({**record, "regression": []},
                                                                 kind).items()
            if not _per_repeat(name)}


def dropped_note(record: dict[str, Any], kind: str, repeats: int) -> str | None:
    """One line on the per-repeat metrics a one-repeat re-run does not gate; None where none."""
    if repeats >= 2:
        return None
    dropped = [name for name in gated_metrics(record, kind) if _per_repeat(name)]
    if not dropped:
        return None
    return (f"not gated: {', '.join(dropped)}: judged on one value per repeat, and the "
            "record's session ran this case once (a verdict needs two repeats a side)")


def session_repeats(record: dict[str, Any], db: Path | None, folder: Path | None) -> int:
    """How many repeats the record's session ran of its case: its runs of the record's
    fingerprint in that session (the database's gate_runs, or the folder's records), at least
    the record's own repeat index + 1."""
    known = int(record.get("repeat_index") or 0) + 1
    session = record.get("session_id")
    if not session:
        return known
    if db is not None:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
                row = connection.execute(
                    f"SELECT max(repeat_index) + 1 FROM [{GATE_RUNS}] WHERE session_id = ? "
                    f"AND fingerprint = (SELECT fingerprint FROM [{GATE_RUNS}] WHERE run_id = ?)",
                    (session, record["run_id"]),
                ).fetchone()
        except sqlite3.DatabaseError:
            row = None  # a database without the gate's tables: the record alone says
        return max(known, int(row[0])) if row and row[0] is not None else known
    if folder is None or not folder.is_dir():
        return known
    key = digests(record)[0]
    for path in folder.glob("*.json"):
        try:
            other = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(other, dict) or other.get("session_id") != session:
            continue
        try:
            same = digests(other)[0] == key
        except (KeyError, TypeError, ValueError):
            continue
        if same and isinstance(other.get("repeat_index"), int):
            known = max(known, other["repeat_index"] + 1)
    return known


def check_reproducible(record: dict[str, Any]) -> str:
    kind = str(record["config"]["benchmark"].get("kind") or "serve")
    engine = record["engine"]["name"]
    if engine not in ("sim", "vllm"):
        raise RerunError(
            f"run {record['run_id']} is a `profllm bench` result of a server profllm did not "
            f"start (engine {engine}): no suite reproduces it"
        )
    if kind not in REPRODUCIBLE_KINDS:
        raise RerunError(f"run {record['run_id']}: cannot reproduce a case of kind {kind!r}")
    return kind


def plan_rerun(
    record: dict[str, Any], secrets: dict[str, str] | None = None, repeats: int = 1
) -> Rerun:
    """The suite and pytest options that reproduce `record`'s case, and how this host
    differs from the one that ran it. `repeats`: how many its session ran (session_repeats);
    with two or more the suite repeats the case as often, and keeps its per-repeat gates
    (the baseline is all the record's session's runs of its fingerprint)."""
    kind = check_reproducible(record)
    bench = record["config"]["benchmark"]
    path = bench.get("dataset_path")
    if isinstance(path, str) and path and not Path(path).exists():
        raise RerunError(f"run {record['run_id']}: its dataset_path {path} no longer exists")
    suite: dict[str, Any] = {
        "name": record["suite"],
        "description": f"re-run of {record['run_id']} ({record['case_id']})",
        "server": server_block(record, secrets or {}),
        "benchmark": benchmark_block(record),
    }
    if record.get("thresholds"):
        suite["thresholds"] = {
            metric: {bound: limit for bound, limit in bounds.items() if limit is not None}
            for metric, bounds in record["thresholds"].items()
        }
    if repeats >= 2:
        suite["repeat"] = repeats
    regression = regression_block(record, kind, repeats)
    if regression:
        suite["regression"] = {
            name: f"{tolerance * 100:g}%" for name, tolerance in regression.items()
        }
    note = dropped_note(record, kind, repeats)
    return Rerun(record, suite, engine_options(record["engine"]), differences(record),
                 [note] if note else [])


def engine_options(engine: dict[str, Any]) -> list[str]:
    """The pytest options that pick the record's engine, clock and simulated device."""
    options = [f"--profllm-engine={engine['name']}"]
    if engine["name"] != "sim":
        return options
    options.append(f"--profllm-sim-clock={engine.get('clock') or 'real'}")
    profile = engine.get("sim_profile")
    if isinstance(profile, dict):
        options.append(f"--profllm-sim-profile={profile['path']}")
    elif (device := sim_device(engine)) not in (None, SIM_DEFAULT_DEVICE):
        options.append(f"--profllm-sim-device={device}")
    return options


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def differences(record: dict[str, Any]) -> list[str]:
    """One line for each way this host differs from the record's: vLLM's version, the GPUs,
    the driver, the plugin's version, a profile file whose bytes changed."""
    lines: list[str] = []
    system = record.get("system") or {}
    engine = record.get("engine") or {}

    def differ(what: str, then: Any, now: Any) -> None:
        if then != now:
            lines.append(f"{what}: {then or 'none'} in the record, {now or 'none'} here")

    if engine.get("name") == "vllm" or system.get("vllm_version"):
        differ("vLLM", engine.get("version") or system.get("vllm_version"), _vllm_version())
    gpus = discover()
    differ("GPU", ", ".join(system.get("gpu_names") or []),
           ", ".join(gpu.name for gpu in gpus.gpus))
    differ("driver", system.get("driver_version"), gpus.driver_version)
    registry = (record.get("config") or {}).get("engine_args") or {}
    if engine.get("name") == "sim" and registry.get("vllm_version"):
        # The simulator's arguments are the bundled registry's (vLLM serves its own).
        differ("engine-argument registry (vLLM)", registry.get("vllm_version"),
               bundled().vllm_version)
    if engine.get("name") == "sim":  # the simulator's version is the plugin's
        differ("pytest-profllm", engine.get("version"), pytest_profllm.__version__)
    profile = engine.get("sim_profile")
    if isinstance(profile, dict):
        path = Path(str(profile.get("path")))
        try:
            now: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            now = None
        if now is None:
            lines.append(f"profile file {path}: gone (the record's sha256 {profile.get('sha256')})")
        elif now != profile.get("sha256"):
            lines.append(
                f"profile file {path}: sha256 {str(profile.get('sha256'))[:12]} in the record, "
                f"{now[:12]} now"
            )
    return lines


def suite_text(rerun: Rerun) -> str:
    head = (
        f"# Re-runs {rerun.record['run_id']} ({rerun.record['case_id']}), written by profllm "
        "rerun.\n# Run it with: pytest THIS_FILE " + " ".join(rerun.pytest_options) + "\n"
    )
    return head + yaml.safe_dump(rerun.suite, sort_keys=False, default_flow_style=False)


def write_suite(rerun: Rerun, path: Path) -> Path:
    """Writes the suite, its owner's alone, and checks it reads back as a suite (SuiteError
    otherwise). A file already there is replaced whole (the caller decides whether it may be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A supplied secret is in the file: readable by its owner alone. mkstemp makes the file
    # 0600, beside the target, and the rename gives the target that file: an existing file's
    # mode (0644, say) is never kept, and no reader sees a part.
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(suite_text(rerun))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    load_suite_file(path)
    return path


def rerun_command(
    rerun: Rerun, suite: Path, out: Path, baseline: Path, extra: list[str] | None = None
) -> list[str]:
    return [
        sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
        f"--profllm-out={out}", f"--profllm-baseline={baseline}", *rerun.pytest_options,
        *(extra or []),
    ]


@dataclass
class Outcome:
    """What the re-run gave: its record, whether its fingerprint is the old one, the
    regression gate's decision on each gated metric."""

    record: dict[str, Any] | None
    same_fingerprint: bool
    decisions: dict[str, str]
    returncode: int
    runs: int = 1  # the records written (one per repeat)


def run(
    rerun: Rerun, suite: Path, out: Path, baseline: Path, extra: list[str] | None = None
) -> Outcome:
    """Runs the suite under pytest (a child process) and reads the record it wrote."""
    before = set(out.glob("*.json")) if out.is_dir() else set()
    command = rerun_command(rerun, suite, out, baseline, extra)
    process = subprocess.run(command, check=False)
    written = sorted(set(out.glob("*.json")) - before)
    if not written:
        return Outcome(None, False, {}, process.returncode)
    records = [json.loads(path.read_text()) for path in written]
    # With repeats, the last one holds the regression decisions (over all of them); run ids
    # of one second do not sort by time.
    new = max(records, key=lambda r: (r.get("repeat_index") or 0, r.get("timestamp") or ""))
    same = all(digests(r)[0] == digests(rerun.record)[0] for r in records)
    decisions = {item["metric"]: item["decision"] for item in new.get("regression") or []}
    invalid = [r for r in records if (r.get("validity") or "valid") != "valid"]
    if invalid:
        new = {**new, "validity": invalid[0]["validity"]}
    return Outcome(new, same, decisions, process.returncode, len(records))


def fingerprint_of(record: dict[str, Any]) -> str:
    return digests(record)[0]
