"""Records on disk and in SQLite: the row layout, idempotent loading, atomic files, reading
record files back, and the `profllm ingest` command."""

from __future__ import annotations

import copy
import gzip
import json
import sqlite3
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm import metrics
from pytest_profllm.cli import main as cli_main
from pytest_profllm.record import (
    BenchmarkRecord,
    json_schema,
    normalize,
    write_record,
    write_requests,
)
from pytest_profllm.ingest import read_record
from pytest_profllm.store import TABLE, load_records, record_row
from pytest_profllm.suite import BenchmarkConfig

MODEL = "Qwen/Qwen3-8B"


def make_record(
    run_id: str = "20260101T000000-aaaaaa-0123456789",
    *,
    session_id: str = "20260101T000000-aaaaaa",
    status: str = "passed",
    server: dict[str, Any] | None = None,
    verdicts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A record as the runner builds it: validated by the model, dumped as JSON data."""
    results: dict[str, float | int | None] = {
        name: float(index) + 0.5
        for index, name in enumerate(metrics.result_names(metrics.LATENCY_METRICS,
                                                          [50, 90, 95, 99]))
    }
    results.update(completed=10, failed=0, duration=3.25, request_goodput=None)
    default_server = {
        "model": MODEL,
        "max_num_seqs": 8,
        "served_model_name": ["qwen", "q"],
        "hf_overrides": {"rope_scaling": {"type": "yarn"}},
    }
    default_verdicts = [
        {"metric": "median_ttft_ms", "bound": "max", "limit": 100.0, "value": 7.5,
         "passed": True},
        {"metric": "output_throughput", "bound": "min", "limit": 5.0, "value": 1.5,
         "passed": False},
    ]
    return BenchmarkRecord.model_validate({
        "run_id": run_id,
        "session_id": session_id,
        "suite": "smoke",
        "source": "benchmarks/bench_smoke.yaml",
        "case_id": "bench_smoke.yaml::qwen3-8b-seqs8::random",
        "nodeid": "benchmarks/bench_smoke.yaml::qwen3-8b-seqs8::random",
        "timestamp": "2026-01-01T00:00:00+00:00",
        "duration": 42.0,
        "status": status,
        "message": None if status == "passed" else "threshold missed",
        "engine": {"name": "sim", "reason": "--profllm-engine sim", "version": "0.1.0"},
        "config": {
            "server": server if server is not None else default_server,
            "benchmark": BenchmarkConfig.model_validate({"num_prompts": 10}).model_dump(
                mode="json"),
        },
        "results": results,
        "system": {"host": "box", "platform": "Linux", "python": "3.11.9", "cpu_count": 2,
                   "gpu_names": ["NVIDIA H100"], "gpu_uuids": ["GPU-aaa"]},
        "runtime": {"worker": "gw0", "server_key": "0123456789ab", "gpus": ["0"],
                    "port": 24000, "server_started_at": 1.0, "server_ready_at": 2.0,
                    "lease_wait_s": 0.0},
        "thresholds": {"median_ttft_ms": {"min": None, "max": 100.0},
                       "output_throughput": {"min": 5.0, "max": None}},
        "verdicts": verdicts if verdicts is not None else default_verdicts,
    }).model_dump(mode="json")


def table_rows(db_path: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db_path) as connection:
        connection.row_factory = sqlite3.Row
        rows = connection.execute(f"select * from {TABLE} order by run_id").fetchall()
    return [dict(row) for row in rows]


def table_columns(db_path: Path) -> list[str]:
    with sqlite3.connect(db_path) as connection:
        return [row[1] for row in connection.execute(f"pragma table_info({TABLE})")]


# --- record_row ------------------------------------------------------------------------------


def test_record_row_flattens_every_block_with_its_prefix() -> None:
    record = make_record()
    row = record_row(record)
    assert row["run_id"] == record["run_id"]
    assert (row["suite"], row["status"], row["case_id"]) == ("smoke", "passed", record["case_id"])
    assert (row["engine"], row["engine_version"], row["engine_reason"]) == (
        "sim", "0.1.0", "--profllm-engine sim"
    )
    # config.server -> server_*, config.benchmark -> bench_*
    assert row["server_model"] == MODEL
    assert row["server_max_num_seqs"] == 8
    assert row["bench_num_prompts"] == 10
    assert row["bench_request_rate"] == "inf"
    assert row["bench_goodput"] is None
    # Metrics keep vLLM's names, unprefixed.
    assert row["median_ttft_ms"] == record["results"]["median_ttft_ms"]
    assert row["p99_e2el_ms"] == record["results"]["p99_e2el_ms"]
    assert row["completed"] == 10
    # `duration` is vLLM's metric (the benchmark's requests); the whole case has its own column.
    assert row["duration"] == 3.25
    assert row["case_duration"] == 42.0
    assert (row["system_host"], row["system_cpu_count"]) == ("box", 2)
    assert (row["runtime_worker"], row["runtime_port"]) == ("gw0", 24000)
    assert not any(key.startswith(("config", "results", "engine_name")) for key in row)


def test_record_row_stores_dicts_and_lists_as_json_text() -> None:
    record = make_record()
    row = record_row(record)
    for column, value in (
        ("server_served_model_name", ["qwen", "q"]),
        ("server_hf_overrides", {"rope_scaling": {"type": "yarn"}}),
        ("system_gpu_names", ["NVIDIA H100"]),
        ("runtime_gpus", ["0"]),
        ("thresholds", record["thresholds"]),
        ("verdicts", record["verdicts"]),
    ):
        assert isinstance(row[column], str), column
        assert json.loads(row[column]) == value, column
    assert row["profiling"] is None
    # Every value is one SQLite can hold.
    assert all(value is None or isinstance(value, str | int | float) for value in row.values())


def test_failed_verdicts_lists_the_failed_metrics() -> None:
    def verdict(metric: str, passed: bool) -> dict[str, Any]:
        return {"metric": metric, "bound": "max", "limit": 1.0, "value": 2.0, "passed": passed}

    assert record_row(make_record())["failed_verdicts"] == "output_throughput"
    missed = make_record(verdicts=[verdict("median_ttft_ms", False), verdict("p99_itl_ms", True),
                                   verdict("median_tpot_ms", False)])
    assert record_row(missed)["failed_verdicts"] == "median_ttft_ms,median_tpot_ms"
    assert record_row(make_record(verdicts=[verdict("median_ttft_ms", True)]))[
        "failed_verdicts"] is None
    assert record_row(make_record(verdicts=[]))["failed_verdicts"] is None


# --- load_records ----------------------------------------------------------------------------


def test_load_records_twice_is_idempotent(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    records = [make_record("run-a"), make_record("run-b", status="failed")]
    assert load_records(db_path, records) == 2
    first = table_rows(db_path)
    assert load_records(db_path, records) == 2
    assert table_rows(db_path) == first
    assert [row["run_id"] for row in first] == ["run-a", "run-b"]
    assert first[1]["status"] == "failed"
    with sqlite3.connect(db_path) as connection:
        indexed = {row[0] for row in connection.execute(
            f"select i.name from pragma_index_list('{TABLE}') as l, pragma_index_info(l.name) as i"
        )}
    assert {"suite", "case_id", "timestamp", "status", "engine"} <= indexed


def test_loading_a_run_id_again_replaces_its_row(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a", status="failed")])
    load_records(db_path, [make_record("run-a", status="passed")])
    rows = table_rows(db_path)
    assert [(row["run_id"], row["status"]) for row in rows] == [("run-a", "passed")]


def test_a_new_server_argument_adds_a_column(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a", server={"model": MODEL})])
    assert "server_enable_prefix_caching" not in table_columns(db_path)
    load_records(db_path, [make_record("run-b", server={"model": MODEL,
                                                        "enable_prefix_caching": True})])
    assert "server_enable_prefix_caching" in table_columns(db_path)
    rows = {row["run_id"]: row for row in table_rows(db_path)}
    assert rows["run-a"]["server_enable_prefix_caching"] is None
    assert rows["run-b"]["server_enable_prefix_caching"] == 1


def test_loading_nothing_writes_nothing(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    assert load_records(db_path, []) == 0
    assert not db_path.exists()


def test_load_records_waits_for_another_writer(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a")])
    other = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, other.execute, args=("COMMIT",))
    release.start()
    try:
        started = time.monotonic()
        # Waits on the busy timeout instead of failing with "database is locked".
        assert load_records(db_path, [make_record("run-b")]) == 1
        assert time.monotonic() - started >= 0.4
    finally:
        release.join()
        other.close()
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-a", "run-b"]


# --- record files ----------------------------------------------------------------------------


def test_write_record_is_atomic_and_valid_json(tmp_path: Path) -> None:
    record = make_record()
    path = write_record(tmp_path / "out", record)
    assert path == tmp_path / "out" / f"{record['run_id']}.json"
    assert json.loads(path.read_text()) == record
    # Writing again replaces the file; no temporary file is left beside it.
    changed = {**record, "status": "failed"}
    write_record(tmp_path / "out", changed)
    assert json.loads(path.read_text()) == changed
    assert [p.name for p in (tmp_path / "out").iterdir()] == [path.name]


def test_write_record_failing_midway_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = make_record()
    path = write_record(tmp_path, record)
    before = path.read_bytes()

    def broken_replace(source: str, target: Path) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("pytest_profllm.record.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_record(tmp_path, {**record, "status": "failed"})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_write_record_refuses_nan(tmp_path: Path) -> None:
    record = make_record()
    record["results"]["mean_ttft_ms"] = float("nan")
    with pytest.raises(ValueError):
        write_record(tmp_path, record)
    assert list(tmp_path.iterdir()) == []


def test_write_requests_writes_gzip_json_lines(tmp_path: Path) -> None:
    requests = [
        {"index": 0, "success": True, "ttft_s": 0.01, "itl_s": [0.002, 0.003], "error": None},
        {"index": 1, "success": False, "ttft_s": 0.0, "itl_s": [], "error": "HTTP 500"},
    ]
    path = write_requests(tmp_path, "run-a", requests)
    assert path == tmp_path / "run-a.requests.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    assert [json.loads(line) for line in lines] == requests
    # mtime 0 in the gzip header: the same requests give the same bytes.
    first = path.read_bytes()
    assert write_requests(tmp_path, "run-a", requests).read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_read_record_files_round_trips(tmp_path: Path) -> None:
    records = [make_record("run-a"), make_record("run-b")]
    paths = [write_record(tmp_path, record) for record in records]
    assert read_record_files(paths) == records


def test_normalize_round_trips() -> None:
    record = make_record()
    assert normalize(copy.deepcopy(record)).model_dump(mode="json") == record


def test_normalize_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="surprise"):
        normalize({**make_record(), "surprise": 1})


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"hello": 1}', "not a profllm record"),
        (json.dumps({**make_record(), "schema_version": 2}), "schema_version 2"),
        ("{not json", "not a profllm record"),
    ],
    ids=["not-a-record", "wrong-schema-version", "not-json"],
)
def test_read_record_files_rejects_bad_files_naming_them(
    tmp_path: Path, content: str, expected: str
) -> None:
    good = write_record(tmp_path, make_record())
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=expected) as raised:
        read_record_files([good, bad])
    assert str(bad) in str(raised.value)


def test_read_record_files_rejects_a_json_array(tmp_path: Path) -> None:
    bad = tmp_path / "list.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a profllm record"):
        read_record_files([bad])


def test_json_schema_validates_a_real_record() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json_schema()
    jsonschema.validate(make_record(), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**make_record(), "status": "maybe"}, schema)


def test_shipped_schema_file_matches_the_model() -> None:
    # The schema file in the package is for readers without Python; it must not go stale.
    shipped = resources.files("pytest_profllm") / "schema" / "record.schema.json"
    assert json.loads(shipped.read_text()) == json_schema()


# --- profllm ingest --------------------------------------------------------------------------


def test_ingest_loads_a_folder_of_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "records"
    for run_id in ("run-a", "run-b"):
        write_record(folder, make_record(run_id))
        write_requests(folder, run_id, [{"index": 0, "success": True}])
    db_path = tmp_path / "results.db"
    assert cli_main(["ingest", str(db_path), str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"loaded 2 record(s) into {db_path} (table benchmark_runs)"
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-a", "run-b"]
    # Ingesting again changes nothing.
    assert cli_main(["ingest", str(db_path), str(folder / "run-a.json"), str(folder)]) == 0
    assert len(table_rows(db_path)) == 2


def ingest_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], path: Path) -> str:
    db_path = tmp_path / "results.db"
    assert cli_main(["ingest", str(db_path), str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert not db_path.exists()
    return captured.err


def test_ingest_missing_path_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.json"
    err = ingest_error(tmp_path, capsys, missing)
    assert err.count("\n") == 1
    assert err.startswith("profllm ingest: no such file")
    assert str(missing) in err


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({**make_record(), "schema_version": 2})],
    ids=["not-json", "wrong-schema-version"],
)
def test_ingest_bad_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    folder = tmp_path / "records"
    write_record(folder, make_record())
    bad = folder / "bad.json"
    bad.write_text(content)
    err = ingest_error(tmp_path, capsys, folder)
    assert err.count("\n") == 1, err
    assert err.startswith(f"profllm ingest: {bad}: not a profllm record")


def test_ingest_record_missing_fields_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "partial.json"
    bad.write_text(json.dumps({"schema_version": 1, "run_id": "x"}))
    err = ingest_error(tmp_path, capsys, bad)
    assert err.count("\n") == 1, err
