"""`--profllm-resume`: the cases an earlier session already measured are not run again.

The controller reads the records in `--profllm-out` once; a record counts when it is a valid
measurement that ran to its end (`passed`, or `failed` on a threshold): an `error`, `invalid`
or `skipped` record, or none at all (a case cut short by SIGKILL), runs again. A case matches
a record by its suite (name and file: another suite's record of the same workload stands for
none of its cases), the regression gate's fingerprint (results/fingerprint.py: the effective
server configuration, the workload, the engine and its version, the device count), its whole
workload (the seed included) and its repeat; the device model, known only once a server
holds its GPUs, must be one this host has. An accuracy case always runs again: what its
task is (lm-eval's digest of its configuration and data) is known only once lm-eval has loaded
it, and a task changed under the same name must not stand for the old one. A matching case
is judged again by the suite as
it is now: its earlier figures against the current thresholds (a case whose figures now miss
one fails, its record `failed` with the reason), and a case the regression gate judges
against a baseline runs again (the gate compares per-request samples of every repeat). Each
worker marks the other matching cases skipped; the controller adds their earlier records to
this session's, so its database and summary hold the whole campaign.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.limits import MAX_RECORD_BYTES, load_json
from pytest_profllm.plan.case import Case
from pytest_profllm.results.fingerprint import digest, fingerprint
from pytest_profllm.results.record import normalize
from pytest_profllm.run.outcome import check_thresholds, describe_missed

# A skipped case's user property: the run id whose record stands for it.
RESUMED_PROPERTY = "profllm_resumed"
# ... and, where the current thresholds fail it, what its record says now (status, message,
# thresholds and threshold results).
REJUDGED_PROPERTY = "profllm_rejudged"
# A resumed case whose earlier figures miss a current threshold: why it fails.
RESUMED_FAILURE_KEY = pytest.StashKey[str]()
WORKERINPUT = "profllm_resume"
# In every process, with --profllm-resume: the earlier records (the controller's has them all).
RESUME_INDEX_KEY = pytest.StashKey["ResumeIndex"]()
_MEASURED = ("passed", "failed")


def resume_key(record: dict[str, Any]) -> str:
    """What a case and its earlier record share: the suite (its name and file), the
    fingerprint less the device model, the whole workload and the repeat."""
    parts = fingerprint(record)
    parts.pop("device_model", None)
    workload = (record.get("config") or {}).get("benchmark") or {}
    repeat = record.get("repeat_index")
    suite = [record.get("suite"), record.get("source")]
    return digest({"suite": suite, "fingerprint": parts, "workload": workload, "repeat": repeat})


def device_model(record: dict[str, Any]) -> list[str]:
    return sorted(set((record.get("system") or {}).get("gpu_names") or []))


@dataclass(frozen=True)
class Earlier:
    """A measured record a case may resume from: what a worker needs to decide."""

    run_id: str
    timestamp: str
    gpu_names: tuple[str, ...]  # the device model it ran on (none: virtual or CPU)
    # The achieved rate where its load saturated (session/saturation.py), else None: a resumed
    # sweep still stops above it.
    saturated: float | None = None
    # Its figures (the record's `results`): judged again by the suite's current thresholds.
    results: dict[str, Any] = field(default_factory=dict)

    def as_input(self) -> list[Any]:
        return [self.run_id, self.timestamp, list(self.gpu_names), self.saturated, self.results]

    @classmethod
    def from_input(cls, value: list[Any]) -> Earlier:
        run_id, timestamp, names, saturated, results = value
        return cls(str(run_id), str(timestamp), tuple(names), saturated, dict(results))


@dataclass
class ResumeIndex:
    """Earlier measured records by resume key (on the controller, also the records)."""

    by_key: dict[str, list[Earlier]] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # run id -> record

    def match(self, planned: dict[str, Any], host_gpu_names: set[str] | None) -> Earlier | None:
        """The newest earlier record of this planned case, on a device model this host has
        (`host_gpu_names` None: any)."""
        found = [
            earlier
            for earlier in self.by_key.get(resume_key(planned), [])
            if host_gpu_names is None or set(earlier.gpu_names) <= host_gpu_names
        ]
        return max(found, key=lambda earlier: earlier.timestamp) if found else None

    def to_input(self) -> dict[str, list[list[Any]]]:
        """What a worker gets (xdist's workerinput): the index without the records."""
        return {
            key: [earlier.as_input() for earlier in found] for key, found in self.by_key.items()
        }

    @classmethod
    def from_input(cls, value: dict[str, list[list[Any]]]) -> ResumeIndex:
        by_key = {key: [Earlier.from_input(item) for item in found] for key, found in value.items()}
        return cls(by_key)


def read_index(
    out_dir: Path, saturated_at: Callable[[dict[str, Any]], float | None] | None = None
) -> ResumeIndex:
    """The measured records in `out_dir` (its top level, where sessions write them).
    `saturated_at(record)` gives a record's achieved rate if its load saturated."""
    index = ResumeIndex()
    for path in sorted(out_dir.glob("*.json")):
        try:
            raw = load_json(path.read_bytes(), what=str(path), max_bytes=MAX_RECORD_BYTES)
            record = normalize(raw)
        except (OSError, ValueError):
            continue  # not a record (a summary), or a damaged one: its case runs again
        if record.status not in _MEASURED or record.validity != "valid":
            continue
        if record.accuracy is not None:
            # Its task is known by lm-eval's digest of it only once lm-eval has loaded it
            # (results/fingerprint.py): a task changed since could not be told from the same.
            continue
        earlier = Earlier(
            record.run_id,
            record.timestamp,
            tuple(device_model(raw)),
            saturated_at(raw) if saturated_at is not None else None,
            dict(record.results),
        )
        index.by_key.setdefault(resume_key(raw), []).append(earlier)
        index.records[record.run_id] = raw
    return index


def describe(earlier: Earlier) -> str:
    return f"already measured in {earlier.run_id}"


def rejudged(case: Case, earlier: Earlier) -> dict[str, Any] | None:
    """What the earlier record of `case` says when judged by the case's current thresholds,
    where they now fail it (None: they pass)."""
    checked = check_thresholds(case, earlier.results)
    missed = [result for result in checked if not result.passed]
    if not missed:
        return None
    return {
        "status": "failed",
        "message": f"{describe_missed(missed)}, judged by the suite's current thresholds",
        "thresholds": {name: t.model_dump() for name, t in case.thresholds.items()},
        "threshold_results": [result.model_dump(mode="json") for result in checked],
    }


def skip_resumed(
    items: list[Any],
    case_of: Callable[[Any], Case | None],
    index: ResumeIndex,
    planned_record: Callable[[Case, str], dict[str, Any]],
    host_gpu_names: set[str] | None,
    runs_again: Callable[[Case], bool] = lambda case: False,
) -> list[tuple[Case, Earlier]]:
    """Mark each case with an earlier measured record skipped, its run id in a user property
    for the controller; returns those cases. A case whose earlier figures now miss a threshold
    is not skipped: it fails without running (RESUMED_FAILURE_KEY), its record re-judged. A
    case `runs_again` says must be measured anew is left to run. Cases skipped already keep
    their reason."""
    resumed = []
    for item in items:
        case = case_of(item)
        if case is None or item.get_closest_marker("skip") is not None or runs_again(case):
            continue
        earlier = index.match(planned_record(case, item.nodeid), host_gpu_names)
        if earlier is None:
            continue
        item.user_properties.append((RESUMED_PROPERTY, earlier.run_id))
        now = rejudged(case, earlier)
        if now is None:
            item.add_marker(pytest.mark.skip(reason=describe(earlier)))
        else:
            item.stash[RESUMED_FAILURE_KEY] = f"{describe(earlier)}: {now['message']}"
            item.user_properties.append((REJUDGED_PROPERTY, now))
        resumed.append((case, earlier))
    return resumed
