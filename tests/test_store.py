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
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results.ingest import read_record
from pytest_profllm.results.landing import LANDING, SweptAxes, swept_axes
from pytest_profllm.results.record import json_schema, normalize
from pytest_profllm.results.record_files import write_record, write_requests
from pytest_profllm.results.rows import RowBuilder, record_row
from pytest_profllm.results.staging import stage
from pytest_profllm.results.store import Load, LoadReport, load_records
from pytest_profllm.results.table import TABLE

MODEL = "Qwen/Qwen3-8B"


def make_record(
    run_id: str = "20260101T000000-aaaaaa-0123456789",
    *,
    session_id: str = "20260101T000000-aaaaaa",
    status: str = "passed",
    server: dict[str, Any] | None = None,
    threshold_results: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A record as the runner builds it (validity included): validated by the model, dumped
    as JSON data."""
    results: dict[str, float | int | None] = {
        name: float(index) + 0.5
        for index, name in enumerate(metric_names.result_names(metric_names.LATENCY_METRICS,
                                                          [50, 90, 95, 99]))
    }
    results.update(completed=10, failed=0, duration=3.25, request_goodput=None)
    default_server = {
        "model": MODEL,
        "max_num_seqs": 8,
        "served_model_name": ["qwen", "q"],
        "hf_overrides": {"rope_scaling": {"type": "yarn"}},
    }
    default_threshold_results = [
        {"metric": "median_ttft_ms", "bound": "max", "limit": 100.0, "value": 7.5,
         "passed": True},
        {"metric": "output_throughput", "bound": "min", "limit": 5.0, "value": 1.5,
         "passed": False},
    ]
    return normalize({
        "schema_version": 1,
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
        "threshold_results": (threshold_results if threshold_results is not None
                              else default_threshold_results),
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
    # JSON's "inf" is a number in its REAL column.
    assert row["bench_request_rate"] == float("inf")
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
    assert not {"config", "results", "engine_name", "system", "runtime"} & set(row)


def test_record_row_stores_dicts_and_lists_as_json_text() -> None:
    record = make_record()
    row = record_row(record)
    for column, value in (
        ("server_served_model_name", ["qwen", "q"]),
        ("server_hf_overrides", {"rope_scaling": {"type": "yarn"}}),
        ("system_gpu_names", ["NVIDIA H100"]),
        ("runtime_gpus", ["0"]),
        ("thresholds", record["thresholds"]),
        # The column keeps the store's first name for the threshold results.
        ("verdicts", record["threshold_results"]),
    ):
        assert isinstance(row[column], str), column
        assert json.loads(row[column]) == value, column
    assert row["profiling"] is None
    # Every value is one SQLite can hold.
    assert all(value is None or isinstance(value, str | int | float) for value in row.values())


def test_failed_verdicts_lists_the_metrics_that_missed_their_threshold() -> None:
    def result(metric: str, passed: bool) -> dict[str, Any]:
        return {"metric": metric, "bound": "max", "limit": 1.0, "value": 2.0, "passed": passed}

    assert record_row(make_record())["failed_verdicts"] == "output_throughput"
    missed = make_record(threshold_results=[
        result("median_ttft_ms", False), result("p99_itl_ms", True),
        result("median_tpot_ms", False)])
    assert record_row(missed)["failed_verdicts"] == "median_ttft_ms,median_tpot_ms"
    assert record_row(make_record(threshold_results=[result("median_ttft_ms", True)]))[
        "failed_verdicts"] is None
    assert record_row(make_record(threshold_results=[]))["failed_verdicts"] is None
    # A record written before `threshold_results` (as a session holds an earlier one it
    # resumes): its `verdicts` fill the same columns.
    older = make_record()
    older["verdicts"] = older.pop("threshold_results")
    assert record_row(older)["failed_verdicts"] == "output_throughput"
    assert json.loads(record_row(older)["verdicts"]) == older["verdicts"]


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


def test_every_registry_argument_has_a_typed_column(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a", server={"model": MODEL})])
    types = table_types(db_path)
    assert types["server_enable_prefix_caching"] == "INTEGER"
    assert types["server_max_num_seqs"] == "INTEGER"
    assert types["server_gpu_memory_utilization"] == "REAL"
    assert types["server_model"] == "TEXT"
    assert types["bench_request_rate"] == "REAL"
    assert types["bench_num_prompts"] == "INTEGER"
    assert types["median_ttft_ms"] == "REAL"


def test_an_argument_the_registry_does_not_know_adds_a_column(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a", server={"model": MODEL})])
    assert "server_from_a_newer_vllm" not in table_columns(db_path)
    load_records(db_path, [make_record("run-b", server={"model": MODEL,
                                                        "from_a_newer_vllm": 3})])
    assert table_types(db_path)["server_from_a_newer_vllm"] == "INTEGER"
    rows = {row["run_id"]: row for row in table_rows(db_path)}
    assert rows["run-a"]["server_from_a_newer_vllm"] is None
    assert rows["run-b"]["server_from_a_newer_vllm"] == 3


def rate_record(run_id: str, rate: float | str) -> dict[str, Any]:
    record = make_record(run_id)
    record["config"]["benchmark"]["request_rate"] = rate
    return record


def test_an_infinite_rate_first_keeps_the_rate_column_numeric(tmp_path: Path) -> None:
    # The record writes an infinite rate as "inf": it used to make the column TEXT, and 8.0
    # then became the text '8.0', so filters and sorts on the rate were wrong.
    db_path = tmp_path / "results.db"
    load_records(db_path, [rate_record("run-inf", "inf"), rate_record("run-8", 8.0)])
    assert table_types(db_path)["bench_request_rate"] == "REAL"
    with sqlite3.connect(db_path) as connection:
        stored = connection.execute(
            f"select run_id, typeof(bench_request_rate), bench_request_rate from {TABLE} "
            "order by bench_request_rate"
        ).fetchall()
        above = connection.execute(
            f"select run_id from {TABLE} where bench_request_rate > 5 order by 1"
        ).fetchall()
    assert stored == [("run-8", "real", 8.0), ("run-inf", "real", float("inf"))]
    assert above == [("run-8",), ("run-inf",)]


def test_a_table_typed_by_its_first_row_is_retyped(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    with sqlite3.connect(db_path) as connection:
        connection.execute(f"create table {TABLE} (run_id text primary key, "
                           "bench_request_rate text)")
        connection.executemany(f"insert into {TABLE} values (?, ?)",
                               [("old-inf", "inf"), ("old-8", "8.0")])
    load_records(db_path, [rate_record("new-4", 4.0)])
    assert table_types(db_path)["bench_request_rate"] == "REAL"
    with sqlite3.connect(db_path) as connection:
        rows = connection.execute(
            f"select run_id, bench_request_rate from {TABLE} order by bench_request_rate"
        ).fetchall()
    assert rows == [("new-4", 4.0), ("old-8", 8.0), ("old-inf", float("inf"))]


def test_loading_counts_new_updated_and_unchanged(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"

    def load(*records: dict[str, Any]) -> LoadReport:
        rows = RowBuilder()
        for record in records:
            rows.add(record)
        staged = stage(rows.batches())
        assert staged is not None
        with Load(db_path) as loading:
            loading.add(staged)
        return loading.report

    first = load(make_record("run-a"), make_record("run-b"))
    assert (first.new, first.updated, first.unchanged) == (2, 0, 0)
    again = load(make_record("run-a"), make_record("run-b", status="failed"))
    assert (again.new, again.updated, again.unchanged) == (0, 1, 1)


def test_records_sharing_a_server_block_each_get_all_its_values(tmp_path: Path) -> None:
    # A load stores each distinct server block once on its way into the table; every row
    # still has its own values, and values Python holds equal (1 and 1.0) stay apart in a
    # TEXT column.
    db_path = tmp_path / "results.db"
    server = {"model": MODEL, "max_num_seqs": 8, "hf_overrides": {"a": [1, 2]}}
    records = [make_record(f"run-{n}", server=dict(server)) for n in range(3)]
    records.append(make_record("run-float", server={**server, "model": 1.0}))
    records.append(make_record("run-int", server={**server, "model": 1}))
    records.append(make_record("run-other", server={**server, "max_num_seqs": 64}))
    load_records(db_path, records)
    rows = {row["run_id"]: row for row in table_rows(db_path)}
    for record in records[:3] + records[-1:]:
        row = record_row(record)
        assert {key: rows[record["run_id"]][key] for key in row} == row, record["run_id"]
    assert [rows[f"run-{n}"]["server_max_num_seqs"] for n in range(3)] == [8, 8, 8]
    assert (rows["run-float"]["server_model"], rows["run-int"]["server_model"]) == ("1.0", "1")
    assert rows["run-other"]["server_max_num_seqs"] == 64
    assert rows["run-0"]["server_hf_overrides"] == '{"a":[1,2]}'


def test_a_new_database_is_left_in_wal_mode(tmp_path: Path) -> None:
    # Written with a rollback journal while new, then switched: readers (Datasette) read
    # while the next run writes.
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a")])
    with sqlite3.connect(db_path) as connection:
        assert connection.execute("pragma journal_mode").fetchone() == ("wal",)
        assert connection.execute("pragma integrity_check").fetchall() == [("ok",)]
    assert not db_path.with_name("results.db-journal").exists()
    load_records(db_path, [make_record("run-b")])
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-a", "run-b"]


def test_swept_axes_make_the_landing_view(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-a")])
    assert landing_columns(db_path)[:4] == ["run_id", "status", "gate", "validity"]
    assert "server_max_num_seqs" not in landing_columns(db_path)
    load_records(db_path, [make_record("run-b", server={"model": MODEL, "max_num_seqs": 64}),
                           rate_record("run-c", 4.0)])
    columns = landing_columns(db_path)
    assert {"server_max_num_seqs", "bench_request_rate"} <= set(columns)
    assert len(columns) <= 32
    assert {"output_tok_per_s", "median_ttft_ms", "p99_tpot_ms"} <= set(columns)
    with sqlite3.connect(db_path) as connection:
        newest_first = [row[0] for row in connection.execute(f"select run_id from {LANDING}")]
        indexed = {row[0] for row in connection.execute(
            f"select i.name from pragma_index_list('{LANDING}') as l, "
            "pragma_index_info(l.name) as i")}
    assert len(newest_first) == 3
    assert {"server_max_num_seqs", "bench_request_rate"} <= indexed


def landing_columns(db_path: Path) -> list[str]:
    with sqlite3.connect(db_path) as connection:
        return [row[1] for row in connection.execute(f"pragma table_info({LANDING})")]


def table_types(db_path: Path) -> dict[str, str]:
    with sqlite3.connect(db_path) as connection:
        return {row[1]: row[2] for row in connection.execute(f"pragma table_info({TABLE})")}


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

    monkeypatch.setattr("pytest_profllm.hosts.files.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_record(tmp_path, {**record, "status": "failed"})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_write_record_writes_a_figure_that_is_not_finite_as_null(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # JSON has no NaN: the record is still written (a server's NaN once lost the record),
    # with the figure null and the path named in the log.
    record = make_record()
    record["results"]["mean_ttft_ms"] = float("nan")
    path = write_record(tmp_path, record)
    assert json.loads(path.read_text())["results"]["mean_ttft_ms"] is None
    assert "results.mean_ttft_ms" in caplog.text


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


def test_read_record_round_trips(tmp_path: Path) -> None:
    records = [make_record("run-a"), make_record("run-b")]
    paths = [write_record(tmp_path, record) for record in records]
    assert [read_record(path) for path in paths] == records


def test_normalize_round_trips() -> None:
    record = make_record()
    assert normalize(copy.deepcopy(record)).model_dump(mode="json") == record


def _older(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as records were written before `threshold_results` and `decision`."""
    older = copy.deepcopy(record)
    older["verdicts"] = older.pop("threshold_results")
    for item in older["regression"]:
        item["verdict"] = item.pop("decision")
    return older


def test_an_older_record_reads_under_the_current_names(tmp_path: Path) -> None:
    record = make_record("old-keys")
    record["regression"] = [
        {"metric": "p99_ttft_ms", "decision": "regressed", "tolerance": 0.1,
         "higher_is_better": False, "baseline": 100.0, "value": 120.0, "change": 0.2,
         "ci_low": 0.15, "ci_high": 0.25, "confidence": 0.99}]
    record = normalize(record).model_dump(mode="json")  # every field of the item
    older = _older(record)
    kept = copy.deepcopy(older)
    # The model: the same record, schema version 1 still; what was read is left as it was.
    assert normalize(older).model_dump(mode="json") == record
    assert older == kept
    # A file: read (as ingest reads it) under the current names.
    path = tmp_path / "records" / "old-keys.json"
    path.parent.mkdir()
    path.write_text(json.dumps(older))
    assert read_record(path) == record
    # Stored as it is: the store's names, the landing table's regression, the gate's table.
    db_path = tmp_path / "results.db"
    load_records(db_path, [older], requests={"old-keys": None})
    with sqlite3.connect(db_path) as connection:
        row = connection.execute(f"SELECT failed_verdicts, verdicts FROM [{TABLE}]").fetchone()
        gate = connection.execute(f"SELECT gate, gate_changes FROM {LANDING}").fetchone()
        stored = connection.execute("SELECT metric, verdict FROM regression_verdicts").fetchall()
    assert row[0] == "output_throughput"
    assert json.loads(row[1]) == record["threshold_results"]
    assert gate == ("regressed", "p99_ttft_ms +20.0%")
    assert stored == [("p99_ttft_ms", "regressed")]


def test_normalize_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="surprise"):
        normalize({**make_record(), "surprise": 1})


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"hello": 1}', "not a profllm record"),
        (json.dumps({**make_record(), "schema_version": 2}), "schema_version 2"),
        ("{not json", "not JSON"),
        ("[1, 2]", "not a profllm record"),
    ],
    ids=["not-a-record", "wrong-schema-version", "not-json", "json-array"],
)
def test_read_record_says_what_is_wrong(tmp_path: Path, content: str, expected: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=expected):
        read_record(bad)


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




def suite_record(run_id: str, suite: str, server: dict[str, Any],
                 axes: list[str] | None = None) -> dict[str, Any]:
    record = make_record(run_id, server={"model": MODEL, **server})
    record["suite"] = suite
    if axes is not None:
        record["config"]["axes"] = axes
    return record


def test_axes_are_what_a_suite_sweeps_not_what_differs_between_suites(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [
        # One suite's single configuration sets arguments the others leave alone.
        suite_record("a1", "args", {"block_size": 32, "api_key": "***",
                                    "compilation_config": {"mode": 3}}),
        # A suite file's declared axis.
        suite_record("b1", "sweep", {"max_num_seqs": 8}, ["server.max_num_seqs"]),
        suite_record("b2", "sweep", {"max_num_seqs": 16}, ["server.max_num_seqs"]),
        # A value that changed within a suite (between sessions), never declared; and a
        # JSON-valued one that changed too.
        suite_record("c1", "nightly", {"gpu_memory_utilization": 0.8,
                                       "compilation_config": {"mode": 1}}),
        suite_record("c2", "nightly", {"gpu_memory_utilization": 0.9,
                                       "compilation_config": {"mode": 3}}),
    ])
    with sqlite3.connect(db_path) as connection:
        assert swept_axes(connection) == ["server_max_num_seqs",
                                          "server_gpu_memory_utilization"]
    columns = landing_columns(db_path)
    assert {"server_max_num_seqs", "server_gpu_memory_utilization"} <= set(columns)
    assert not {"server_block_size", "server_api_key", "server_compilation_config"} & set(columns)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["s1", "s2", "s3"]),
    st.lists(st.fixed_dictionaries({"max_num_seqs": st.sampled_from([8, 16]),
                                    "block_size": st.sampled_from([16, 32]),
                                    "enforce_eager": st.booleans()}),
             min_size=1, max_size=3),
    min_size=1))
def test_the_axes_are_exactly_the_keys_that_vary_within_a_suite(
    suites: dict[str, list[dict[str, Any]]],
) -> None:
    expected = {f"server_{key}" for configs in suites.values()
                for key in configs[0] if len({str(c[key]) for c in configs}) > 1}
    axes = SweptAxes({}, set(), set())
    columns = ["server_max_num_seqs", "server_block_size", "server_enforce_eager"]
    axes.see(columns, [(suite, None, c["max_num_seqs"], c["block_size"], c["enforce_eager"])
                       for suite, configs in suites.items() for c in configs])
    assert set(axes.swept()) == expected


# `verdict`: a regression item as records wrote it before `decision` (and as a database loaded
# then still holds it in `benchmark_runs.regression`).
@pytest.mark.parametrize("key", ["decision", "verdict"])
def test_a_regression_shows_on_the_landing_table(tmp_path: Path, key: str) -> None:
    db_path = tmp_path / "results.db"
    regressed = make_record("r1")
    regressed["regression"] = [
        {"metric": "p99_ttft_ms", key: "regressed", "tolerance": 0.1,
         "higher_is_better": False, "baseline": 100.0, "value": 120.0, "change": 0.2,
         "confidence": 0.99},
        {"metric": "median_tpot_ms", key: "unchanged", "tolerance": 0.1,
         "higher_is_better": False, "baseline": 10.0, "value": 10.1, "change": 0.01,
         "confidence": 0.99}]
    fine = make_record("r2")
    fine["regression"] = [{**regressed["regression"][1]}]
    nothing = make_record("r3")
    unknown = make_record("r4")
    unknown["regression"] = [{**regressed["regression"][1], key: "no-baseline"}]
    load_records(db_path, [regressed, fine, nothing, unknown])
    with sqlite3.connect(db_path) as connection:
        rows = dict(connection.execute(
            f"SELECT run_id, gate || ' | ' || coalesce(gate_changes, '') FROM {LANDING} "
            "WHERE gate IS NOT NULL").fetchall())
    assert rows == {"r1": "regressed | p99_ttft_ms +20.0%", "r2": "ok | ",
                    "r4": "no baseline | "}


def test_an_older_axes_table_is_read_again_per_suite(tmp_path: Path) -> None:
    db_path = tmp_path / "results.db"
    load_records(db_path, [suite_record("b1", "sweep", {"max_num_seqs": 8}),
                           suite_record("b2", "sweep", {"max_num_seqs": 16}),
                           suite_record("a1", "other", {"block_size": 32})])
    with sqlite3.connect(db_path) as connection:  # as an older store left it
        connection.execute("DROP TABLE benchmark_axes")
        connection.execute("CREATE TABLE benchmark_axes ([column] TEXT PRIMARY KEY, "
                           "first_value, swept INTEGER NOT NULL)")
        connection.executemany("INSERT INTO benchmark_axes VALUES (?, ?, 1)",
                               [("server_max_num_seqs", 8), ("server_block_size", 16)])
        assert swept_axes(connection) == []  # Datasette on it before the next load: no axes
    load_records(db_path, [suite_record("b3", "sweep", {"max_num_seqs": 8})])
    with sqlite3.connect(db_path) as connection:
        assert swept_axes(connection) == ["server_max_num_seqs"]
