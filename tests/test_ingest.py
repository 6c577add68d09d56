"""`profllm ingest`: every good file loaded, every bad one refused whole with its reason, a
report of new, unchanged and refused records, `profllm bench --save-result` files taken as
records of their own suite; and record files that are never left half-written."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_store import make_record, table_rows

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.results import ingest as ingest_module
from pytest_profllm.results import store
from pytest_profllm.results.ingest import BENCH_SUITE, ingest, record_files
from pytest_profllm.results.record_files import write_record, write_requests
from pytest_profllm.results.store import load_records
from pytest_profllm.results.table import TABLE


def run_ingest(
    capsys: pytest.CaptureFixture[str], db_path: Path, *paths: Path
) -> tuple[int, str, list[str]]:
    status = cli_main(["ingest", str(db_path), *map(str, paths)])
    captured = capsys.readouterr()
    return status, captured.out.strip(), captured.err.splitlines()


def records_folder(tmp_path: Path, *run_ids: str) -> Path:
    folder = tmp_path / "records"
    for run_id in run_ids:
        write_record(folder, make_record(run_id))
        write_requests(folder, run_id, [{"index": 0, "success": True}])
    return folder


def test_ingest_loads_a_folder_and_again_adds_nothing_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a", "run-b")
    db_path = tmp_path / "results.db"
    status, out, err = run_ingest(capsys, db_path, folder)
    assert (status, err) == (0, [])
    assert out == f"{db_path} (table benchmark_runs): 2 new, 0 unchanged, 0 refused"
    before = table_rows(db_path)
    assert [row["run_id"] for row in before] == ["run-a", "run-b"]
    # Again, the same file also named on its own: nothing new, each record counted once.
    status, out, err = run_ingest(capsys, db_path, folder / "run-a.json", folder)
    assert (status, err) == (0, [])
    assert out == f"{db_path} (table benchmark_runs): 0 new, 2 unchanged, 0 refused"
    assert table_rows(db_path) == before


def test_records_loaded_by_their_session_are_unchanged_when_ingested(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The session loads its records from memory, ingest reads their files: both digest the
    # same bytes.
    records = [make_record("run-a"), make_record("run-b", status="failed")]
    db_path = tmp_path / "results.db"
    load_records(db_path, records)
    folder = tmp_path / "records"
    for record in records:
        write_record(folder, record)
    status, out, err = run_ingest(capsys, db_path, folder)
    assert (status, err) == (0, [])
    assert out == f"{db_path} (table benchmark_runs): 0 new, 2 unchanged, 0 refused"


def test_a_changed_file_updates_its_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a", "run-b")
    db_path = tmp_path / "results.db"
    run_ingest(capsys, db_path, folder)
    write_record(folder, make_record("run-b", status="failed"))
    status, out, _ = run_ingest(capsys, db_path, folder)
    assert status == 0
    assert out == f"{db_path} (table benchmark_runs): 0 new, 1 unchanged, 1 updated, 0 refused"
    assert [row["status"] for row in table_rows(db_path)] == ["passed", "failed"]


def test_many_files_are_read_by_other_processes_with_the_same_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From _PARALLEL_FROM files on, worker processes read and stage batches of files while
    # this one writes: lowered here, so that a few files take that path.
    folder = records_folder(tmp_path, *(f"run-{n:02d}" for n in range(12)))
    reasons = malformed_files(folder)
    (folder / "copy.json").write_bytes((folder / "run-03.json").read_bytes())
    files = record_files([folder])
    sequential = ingest(tmp_path / "one.db", files)
    monkeypatch.setattr(ingest_module, "_PARALLEL_FROM", 1)
    monkeypatch.setattr(ingest_module, "_FILES_PER_BATCH", 4)
    parallel = ingest(tmp_path / "many.db", files)
    for report in (sequential, parallel):
        assert (report.load.new, report.duplicates) == (12, 1)
        assert sorted(path.name for path, _ in report.refused) == sorted(reasons)
    assert table_rows(tmp_path / "many.db") == table_rows(tmp_path / "one.db")
    # Again, with a file changed: the workers skip the files stored as they are.
    write_record(folder, make_record("run-07", status="failed"))
    again = ingest(tmp_path / "many.db", files)
    assert (again.load.new, again.load.updated, again.load.unchanged) == (0, 1, 11)
    assert again.duplicates == 1


def test_a_locked_database_is_one_line_and_loads_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "BUSY_TIMEOUT_MS", 300)
    folder = records_folder(tmp_path, "run-a")
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-0")])
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("begin exclusive")
        status, out, err = run_ingest(capsys, db_path, folder)
    finally:
        holder.close()
    assert (status, out) == (2, "")
    assert err == [f"profllm ingest: {db_path}: still locked by another process after 0.3 s: "
                   "nothing loaded"]
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-0"]


def _die(paths: list[Path]) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_reading_process_killed_is_one_line_and_loads_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = records_folder(tmp_path, "run-a", "run-b", "run-c")
    db_path = tmp_path / "results.db"
    load_records(db_path, [make_record("run-0")])
    monkeypatch.setattr(ingest_module, "_PARALLEL_FROM", 1)
    monkeypatch.setattr(ingest_module, "_read_batch_in_worker", _die)
    status, out, err = run_ingest(capsys, db_path, folder)
    assert (status, out) == (2, "")
    assert err == ["profllm ingest: a process reading the record files died (killed, or out "
                   "of memory): nothing loaded"]
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-0"]


def test_an_integer_too_large_for_sqlite_is_stored_as_a_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # JSON readers take integers up to 2**64; SQLite's INTEGER ends at 2**63.
    folder = records_folder(tmp_path, "run-a", "run-c")
    big = make_record("run-b")
    big["config"]["server"]["seed"] = 2**63 + 5
    big["results"]["completed"] = 2**64 - 1
    write_record(folder, big)
    db_path = tmp_path / "results.db"
    status, out, _ = run_ingest(capsys, db_path, folder)
    assert (status, out) == (0, f"{db_path} (table benchmark_runs): 3 new, 0 unchanged, "
                                "0 refused")
    rows = {row["run_id"]: row for row in table_rows(db_path)}
    assert (rows["run-b"]["server_seed"], rows["run-b"]["completed"]) == (2.0**63, 2.0**64)
    assert rows["run-a"]["completed"] == 10


def test_a_copy_of_a_record_is_counted_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a")
    (folder / "copy-of-run-a.json").write_bytes((folder / "run-a.json").read_bytes())
    status, out, _ = run_ingest(capsys, tmp_path / "results.db", folder)
    assert status == 0
    assert "1 new, 0 unchanged, 0 refused, 1 duplicate(s) counted once" in out
    assert len(table_rows(tmp_path / "results.db")) == 1


def malformed_files(folder: Path) -> dict[str, str]:
    """Bad files, each with the reason ingest must give."""
    bad_status = make_record("bad-status")
    bad_status["status"] = "maybe"
    nan_metric = make_record("nan-metric")
    nan_metric["results"]["median_ttft_ms"] = float("nan")
    deep = make_record("bad-threshold-result")
    deep["threshold_results"][0]["passed"] = "perhaps"
    files = {
        "not-json.json": ("{not json", "not JSON"),
        "wrong-version.json": (json.dumps({**make_record("v2"), "schema_version": 2}),
                               "schema_version 2"),
        "bad-status.json": (json.dumps(bad_status), "status"),
        "bad-threshold-result.json": (json.dumps(deep), "threshold_results.0.passed"),
        "nan-metric.json": (json.dumps(nan_metric), "results.median_ttft_ms is nan"),
        "a-list.json": ("[1, 2]", "not a profllm record"),
    }
    for name, (content, _) in files.items():
        (folder / name).write_text(content)
    return {name: reason for name, (_, reason) in files.items()}


def test_ingest_loads_every_good_file_and_refuses_every_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a", "run-b")
    reasons = malformed_files(folder)
    db_path = tmp_path / "results.db"
    status, out, err = run_ingest(capsys, db_path, folder)
    assert status == 1
    assert out == f"{db_path} (table benchmark_runs): 2 new, 0 unchanged, 6 refused"
    # One line per refused file, naming it and why.
    assert len(err) == len(reasons)
    for name, reason in reasons.items():
        (line,) = [line for line in err if f"/{name}:" in line]
        assert line.startswith(f"profllm ingest: refused {folder.resolve() / name}: "), line
        assert reason in line, (name, line)
    # Nothing of a refused file is stored, not even the valid parts of a malformed record.
    assert [row["run_id"] for row in table_rows(db_path)] == ["run-a", "run-b"]


def test_only_bad_files_create_no_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "records"
    folder.mkdir()
    malformed_files(folder)
    status, out, _ = run_ingest(capsys, tmp_path / "results.db", folder)
    assert status == 1
    assert out.endswith("0 new, 0 unchanged, 6 refused")
    assert not (tmp_path / "results.db").exists()


def test_ingest_missing_path_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.json"
    status, out, err = run_ingest(capsys, tmp_path / "results.db", missing)
    assert (status, out) == (2, "")
    assert err == [f"profllm ingest: no such file: {missing}"]
    assert not (tmp_path / "results.db").exists()


def test_progress_counts_every_file(tmp_path: Path) -> None:
    folder = records_folder(tmp_path, "run-a", "run-b", "run-c")
    malformed_files(folder)
    (folder / "copy.json").write_bytes((folder / "run-a.json").read_bytes())
    files = record_files([folder])
    seen: list[int] = []
    report = ingest(tmp_path / "results.db", files, seen.append)
    assert sum(seen) == len(files) == 10
    assert (report.load.new, len(report.refused), report.duplicates) == (3, 6, 1)


def bench_result(rate: float | str = 4.0) -> dict[str, Any]:
    """What `profllm bench --save-result` writes (vLLM's keys, then the client's)."""
    return {
        "date": "20260105-101500", "endpoint_type": "openai", "backend": "openai",
        "label": None, "model_id": "Qwen/Qwen3-8B", "tokenizer_id": "Qwen/Qwen3-8B",
        "num_prompts": 50, "request_rate": rate, "burstiness": 1.0, "max_concurrency": None,
        "duration": 12.5, "completed": 50, "failed": 0, "total_input_tokens": 51200,
        "total_output_tokens": 6400, "request_throughput": 4.0, "request_goodput": None,
        "output_throughput": 512.0, "total_token_throughput": 4608.0, "rtfx": 0.0,
        "max_output_tokens_per_s": 600.0, "max_concurrent_requests": 7,
        "mean_ttft_ms": 20.0, "median_ttft_ms": 18.0, "p99_ttft_ms": 40.0,
        "mean_tpot_ms": 5.0, "median_tpot_ms": 5.0, "p99_tpot_ms": 7.0,
        "p99_schedule_lag_ms": 0.4, "achieved_request_rate": 4.0, "client_cpu_percent": 20.0,
        "verdict": "valid", "invalid_reason": None,
    }


def test_bench_save_result_files_are_records_of_their_own_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a")
    (folder / "openai-4.0qps-Qwen3-8B-20260105-101500.json").write_text(
        json.dumps(bench_result()))
    (folder / "openai-infqps-Qwen3-8B-20260105-101500.json").write_text(
        json.dumps({**bench_result("inf"), "date": "20260105-102000"}))
    db_path = tmp_path / "results.db"
    status, out, err = run_ingest(capsys, db_path, folder)
    assert (status, err) == (0, [])
    assert out.endswith("3 new, 0 unchanged, 0 refused")
    with sqlite3.connect(db_path) as connection:
        rows = connection.execute(
            f"select suite, server_model, bench_request_rate, output_throughput, p99_ttft_ms, "
            f"status from {TABLE} where suite = ? order by bench_request_rate", (BENCH_SUITE,)
        ).fetchall()
    assert rows == [("bench", "Qwen/Qwen3-8B", 4.0, 512.0, 40.0, "passed"),
                    ("bench", "Qwen/Qwen3-8B", float("inf"), 512.0, 40.0, "passed")]
    status, out, _ = run_ingest(capsys, db_path, folder)
    assert out.endswith("0 new, 3 unchanged, 0 refused")


# A process that writes a large record slowly, through `write_record`, and says where it is.
_SLOW_WRITER = """
import json, os, sys, time
from pathlib import Path
from pytest_profllm.hosts import files
from pytest_profllm.results import record_files
real_fdopen = os.fdopen
class Slow:
    def __init__(self, handle): self.handle = handle
    def __enter__(self): return self
    def __exit__(self, *exc): return self.handle.__exit__(*exc)
    def write(self, data):
        for start in range(0, len(data), 4096):
            self.handle.write(data[start:start + 4096]); self.handle.flush()
            print("writing", flush=True); time.sleep(0.05)
files.os.fdopen = lambda fd, mode: Slow(real_fdopen(fd, mode))
data = json.loads(sys.stdin.read())
record_files.write_record(Path(sys.argv[1]), data)
print("done", flush=True)
"""


def test_a_record_killed_mid_write_leaves_no_partial_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = records_folder(tmp_path, "run-a")
    big = make_record("run-killed")
    big["config"]["server"]["hf_overrides"] = {"padding": "x" * 200_000}
    writer = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(folder)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(json.dumps(big))
        writer.stdin.close()
        assert writer.stdout.readline().strip() == "writing"
        time.sleep(0.2)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    assert not (folder / "run-killed.json").exists()
    # What is left is a hidden temporary file, which ingest does not take for a record.
    leftovers = [p.name for p in folder.iterdir() if "run-killed" in p.name]
    assert leftovers and all(name.startswith(".run-killed.json.") for name in leftovers)
    status, out, err = run_ingest(capsys, tmp_path / "results.db", folder)
    assert (status, err) == (0, [])
    assert out.endswith("1 new, 0 unchanged, 0 refused")


def test_two_files_of_one_run_with_other_content_are_a_conflict_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: whichever came first was kept, "1 duplicate(s) counted once", exit 0.
    folder = records_folder(tmp_path, "run-a")
    other = make_record("run-a", status="failed")
    (folder / "z-other-run-a.json").write_text(json.dumps(other))
    status, out, err = run_ingest(capsys, tmp_path / "results.db", folder)
    assert status == 1
    assert "duplicate" not in out and "1 refused" in out
    (line,) = [line for line in err if "refused" in line]
    assert "z-other-run-a.json" in line and "run-a.json" in line.split("z-other-run-a.json")[1]
    assert [row["status"] for row in table_rows(tmp_path / "results.db")] == ["passed"]
    # Loaded again alone later, the changed record updates its row, as an upload says.
    (folder / "run-a.json").unlink()
    status, out, _ = run_ingest(capsys, tmp_path / "results.db", folder)
    assert status == 0 and "1 updated" in out
