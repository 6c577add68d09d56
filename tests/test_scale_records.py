"""The records `benchmarks/perf/results_scale.py` times the pages on: measured on the simulator's
virtual clock, they keep the record's rules (ordered percentiles, statuses that agree with
thresholds and the gate, verdicts that agree with their figures) and validate as records."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pytest_profllm.results.record import normalize

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "perf" / "scale_records.py"


@pytest.fixture(scope="module")
def scale_records() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_records", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_records"] = module  # its dataclasses look themselves up by module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(scale_records: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scale") / "records"
    axes = scale_records.Axes(models=("Qwen/Qwen3-8B",), devices=("NVIDIA H100 80GB HBM3",),
                              max_num_seqs=(64, 256), tensor_parallel_sizes=(1,),
                              rates=(4.0, math.inf), concurrencies=(32,))
    counts, violations = scale_records.generate(folder, 300, axes, processes=1)
    assert violations == dict.fromkeys(violations, 0)
    assert sum(counts[s] for s in ("passed", "failed", "error", "invalid") if s in counts) == 300
    return folder


def _records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def test_records_keep_the_rules_and_validate(generated: Path) -> None:
    records = _records(generated)
    assert len(records) == 300
    for record in records:
        normalize(record)
    statuses = {record["status"] for record in records}
    assert {"passed", "failed"} <= statuses
    verdicts = [v for record in records for v in record["regression"]]
    assert {"unchanged", "regressed"} <= {v["decision"] for v in verdicts}
    for record in records:
        results = record["results"]
        if not results:
            continue
        assert results["median_ttft_ms"] <= results["p99_ttft_ms"]
        if any(v["decision"] == "regressed" for v in record["regression"]):
            assert record["status"] == "failed"
            assert "regression: " in record["message"]
    # The regressed runs were slowed against the session before, by 15 to 30 %.
    regressed = [v for v in verdicts if v["decision"] == "regressed"]
    assert all(0.10 < v["change"] < 0.45 for v in regressed)
    assert all(v["baseline_session"] for v in regressed)


def test_the_last_sessions_carry_series_and_request_samples(generated: Path) -> None:
    records = _records(generated)
    detailed = [r for r in records if r["series"]]
    assert detailed
    # The runs a reader opens from the landing table sorted by TTFT: the slowest first.
    slowest = max((r for r in records if r["results"]),
                  key=lambda r: r["results"]["p99_ttft_ms"])
    assert slowest["series"]
    first_session = records[0]["session_id"]  # run ids begin with their session's time
    assert any(r["series"] for r in records if r["session_id"] == first_session)
    for record in detailed:
        assert (generated / f"{record['run_id']}.requests.jsonl.gz").is_file()
        kv = [point["kv_cache_usage"] for point in record["series"]]
        assert max(kv) <= record["system"]["peak_kv_cache_usage"] + 1e-9


def test_check_counts_what_breaks_the_rules(scale_records: ModuleType, generated: Path) -> None:
    record = next(r for r in _records(generated) if r["status"] == "passed")
    record["results"]["p99_ttft_ms"] = record["results"]["p50_ttft_ms"] / 2
    record["regression"][0].update(decision="regressed")
    violations = scale_records.check([record])
    assert violations["percentiles out of order"] == 1
    assert violations["passed but regressed"] == 1
    assert violations["regression decision disagrees with its change"] == 1
