"""Ingest refuses a bad record alone: a column name with any character loads, an
over-wide record is refused with its reason, and generated hostile records never stop the
good ones beside them from loading."""

from __future__ import annotations

import gzip
import json
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import make_record

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.limits import InputLimitError
from pytest_profllm.results.files import read_regular
from pytest_profllm.results.ingest import ingest, record_files
from pytest_profllm.results.record import iter_requests


def _write(folder: Path, records: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for record in records:
        # allow_nan: a hostile file may hold NaN; ingest must refuse it, not crash.
        (folder / f"{record['run_id']}.json").write_text(json.dumps(record, allow_nan=True))


def _loaded(db: Path) -> set[str]:
    with sqlite3.connect(db) as connection:
        return {row[0] for row in connection.execute("SELECT run_id FROM benchmark_runs")}


def test_a_bracket_in_a_swept_key_loads_with_the_rest(tmp_path: Path) -> None:
    good = [make_record(f"run-{n}", server={"model": "m", "max_num_seqs": n}) for n in range(8)]
    odd = make_record("run-odd", server={"model": "m", "weird]key": 1, 'q"uote': 2})
    _write(tmp_path / "records", [*good, odd])
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    # Before: "unrecognized token", nothing loaded, a 0-byte database left.
    assert report.refused == []
    assert _loaded(tmp_path / "x.db") == {f"run-{n}" for n in range(8)} | {"run-odd"}


def test_an_over_wide_record_is_refused_alone(tmp_path: Path) -> None:
    wide = make_record("run-wide")
    wide["results"].update({f"metric_{n}": float(n) for n in range(2100)})
    _write(tmp_path / "records", [make_record("run-a"), wide])
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    assert [(path.name, reason) for path, reason in report.refused] == [
        ("run-wide.json", "results has 2,139 keys, more than the 1,000 a table holds")
    ]
    assert _loaded(tmp_path / "x.db") == {"run-a"}


names = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1, max_size=12,
)
hostile = st.fixed_dictionaries({
    "server_extra": st.dictionaries(names, st.one_of(st.integers(), st.text(max_size=4)),
                                    max_size=3),
    "result_extra": st.dictionaries(names, st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**20),
        st.text(max_size=3)), max_size=3),
    "drop": st.sampled_from([None, "run_id", "status", "results", "engine", "timestamp"]),
})


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(changes=st.lists(hostile, min_size=1, max_size=4))
def test_good_records_always_load_and_bad_ones_say_why(
    tmp_path_factory: Any, changes: list[dict[str, Any]]
) -> None:
    folder = tmp_path_factory.mktemp("hostile")
    records = [make_record("run-good-a"), make_record("run-good-b")]
    for n, change in enumerate(changes):
        record = make_record(f"run-hostile-{n}")
        record["config"]["server"].update(change["server_extra"])
        record["results"].update(change["result_extra"])
        if change["drop"] is not None:
            record.pop(change["drop"])
            record.setdefault("run_id", f"run-hostile-{n}")
        records.append(record)
    _write(folder / "records", records)
    report = ingest(folder / "x.db", record_files([folder / "records"]))
    loaded = _loaded(folder / "x.db")
    assert {"run-good-a", "run-good-b"} <= loaded
    refused = {path.name for path, _ in report.refused}
    for _, reason in report.refused:
        assert reason and "Traceback" not in reason
    assert len(loaded) + len(refused) == len(records)


def test_keys_differing_only_in_case_never_stop_a_load(tmp_path: Path) -> None:
    # SQLite's column names ignore case. Before: "duplicate column name", nothing loaded.
    records = [
        make_record("run-both", server={"model": "m", "Xy": 1, "xy": 2}),
        make_record("run-upper", server={"model": "m", "XY": 3}),
        make_record("run-lower", server={"model": "m", "xy": 4}),
    ]
    _write(tmp_path / "records", records)
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    assert [(path.name, reason) for path, reason in report.refused] == [(
        "run-both.json",
        "config.server has keys 'Xy' and 'xy', which differ only in case: a table's column "
        "names do not",
    )]
    with sqlite3.connect(tmp_path / "x.db") as connection:
        rows = connection.execute("SELECT run_id, server_xy FROM benchmark_runs ORDER BY 1")
        assert rows.fetchall() == [("run-lower", 4), ("run-upper", 3)]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deep_nesting_nul_keys_and_rowid_refuse_their_file_alone(tmp_path: Path) -> None:
    # Deeper than limits.py allows. Once: a 100,000-deep file stopped the ingest with a
    # RecursionError (no database); a NUL in a key loaded nothing at all (exit 2).
    folder = tmp_path / "records"
    _write(folder, [make_record("run-a"), make_record("run-b")])
    (folder / "deep.json").write_text(_deep(100_000))
    text = json.dumps(make_record("run-deep-value"))
    (folder / "deep-value.json").write_text(text[:-1] + ', "extra": ' + _deep(100_000) + "}")
    nul = make_record("run-nul")
    nul["results"]["a\x00b"] = 1.0
    (folder / "nul.json").write_text(json.dumps(nul))
    report = ingest(tmp_path / "x.db", record_files([folder]))
    assert sorted((path.name, reason) for path, reason in report.refused) == [
        ("deep-value.json", "the file nests JSON deeper than 64 levels"),
        ("deep.json", "the file nests JSON deeper than 64 levels"),
        ("nul.json", "results has a key with a NUL character ('a\\x00b'): no column name "
                     "holds one"),
    ]
    assert _loaded(tmp_path / "x.db") == {"run-a", "run-b"}


def test_a_metric_named_rowid_is_refused_and_never_hides_another_run(tmp_path: Path) -> None:
    # Before: with a run given twice, the load picked staged rows by `rowid`, which the
    # metric's column hid: "2 new" reported and run-a silently not stored (or KeyError:
    # 'rowid' where the metric added a column).
    with_rowid = make_record("run-rowid")
    with_rowid["results"]["rowid"] = 1.0
    folder = tmp_path / "records"
    folder.mkdir()
    for name in ("first.json", "copy.json"):
        (folder / name).write_text(json.dumps(with_rowid))
    _write(folder, [make_record("run-a")])
    report = ingest(tmp_path / "x.db", [folder / "first.json", folder / "copy.json",
                                        folder / "run-a.json"])
    reason = ("results.rowid: a name the table keeps for itself (SQLite's row id, or the "
              "load's own column); rename the metric")
    assert [(path.name, why) for path, why in report.refused] == [
        ("first.json", reason), ("copy.json", reason)
    ]
    assert _loaded(tmp_path / "x.db") == {"run-a"}


keys = st.one_of(names, st.sampled_from(["rowid", "ROWID", "oid", "_rowid_", "profllm_server",
                                         "a\x00b", "\x00"]))
# A value nested so many levels (up to 3,000: past orjson's own limit of 1,024), written in
# place of its marker.
deep = st.integers(1, 3000).map(lambda depth: f"@@deep{depth}@@")
values = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=3), deep)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.fixed_dictionaries({
    "block": st.sampled_from(["results", "server", "system"]),
    "extra": st.dictionaries(keys, values, max_size=3),
    "nest": st.one_of(st.none(), st.integers(1, 100_000)),
    "copies": st.integers(1, 2),
}), min_size=1, max_size=4))
def test_hostile_record_files_never_stop_the_good_ones(
    tmp_path_factory: Any, files: list[dict[str, Any]]
) -> None:
    folder = tmp_path_factory.mktemp("hostile") / "records"
    _write(folder, [make_record("run-good-a"), make_record("run-good-b")])
    for n, change in enumerate(files):
        record = make_record(f"run-hostile-{n}")
        block = (record["config"]["server"] if change["block"] == "server"
                 else record[change["block"]])
        block.update(change["extra"])
        text = re.sub(r'"@@deep(\d+)@@"', lambda found: _deep(int(found[1])),
                      json.dumps(record, allow_nan=True))
        if change["nest"] is not None:
            text = text[:-1] + ', "user": ' + _deep(change["nest"]) + "}"
        for copy in range(change["copies"]):
            (folder / f"hostile-{n}-{copy}.json").write_text(text)
    report = ingest(folder.parent / "x.db", record_files([folder]))
    loaded = _loaded(folder.parent / "x.db")
    assert {"run-good-a", "run-good-b"} <= loaded
    for _, reason in report.refused:
        assert reason and "\n" not in reason
    refused_runs = {path.name.rsplit("-", 1)[0] for path, _ in report.refused}
    assert len(loaded) + len(refused_runs) == 2 + len(files)


def test_a_request_file_that_expands_past_the_limit_is_refused_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pytest_profllm.limits.MAX_REQUEST_FILE_BYTES", 1 << 20)
    _write(tmp_path / "records", [make_record("run-a"), make_record("run-bomb")])
    bomb = tmp_path / "records" / "run-bomb.requests.jsonl.gz"
    bomb.write_bytes(gzip.compress(b"{}\n" * (1 << 20)))
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    # Before: the file was decompressed whole into memory, and loaded.
    ((path, reason),) = report.refused
    assert path.name == "run-bomb.json" and "run-bomb.requests.jsonl.gz" in reason
    assert "\n" not in reason
    assert _loaded(tmp_path / "x.db") == {"run-a"}


def _sample(index: int) -> bytes:
    return json.dumps({"index": index, "success": True, "output_tokens": 2, "ttft_s": 0.1,
                       "latency_s": 0.2, "itl_s": [0.1]}).encode() + b"\n"


def test_a_request_file_of_lines_that_are_not_requests_is_refused_alone(
    tmp_path: Path,
) -> None:
    # Before: 3,145,728 `{}` lines were stored as empty rows of request_samples.
    _write(tmp_path / "records", [make_record("run-a"), make_record("run-empty")])
    (tmp_path / "records" / "run-empty.requests.jsonl.gz").write_bytes(
        gzip.compress(b"{}\n" * 1000))
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    ((path, reason),) = report.refused
    assert path.name == "run-empty.json"
    assert "run-empty.requests.jsonl.gz:1" in reason and "not a request sample" in reason
    assert _loaded(tmp_path / "x.db") == {"run-a"}


def test_a_request_file_with_more_rows_than_its_record_ran_is_refused_alone(
    tmp_path: Path,
) -> None:
    record = make_record("run-many")
    ran = record["results"]["completed"] + record["results"]["failed"]
    _write(tmp_path / "records", [make_record("run-a"), record])
    requests = tmp_path / "records" / "run-many.requests.jsonl.gz"
    requests.write_bytes(gzip.compress(b"".join(_sample(i) for i in range(ran))))
    assert ingest(tmp_path / "x.db", record_files([tmp_path / "records"])).refused == []
    requests.write_bytes(gzip.compress(b"".join(_sample(i) for i in range(ran + 5))))
    report = ingest(tmp_path / "y.db", record_files([tmp_path / "records"]))
    ((path, reason),) = report.refused
    assert path.name == "run-many.json"
    assert f"run-many.requests.jsonl.gz:{ran + 1}" in reason and f"{ran:,}" in reason


def test_an_offline_latency_runs_rows_are_request_samples(tmp_path: Path) -> None:
    # offline/results.py writes an index and a latency per iteration, no success flag.
    path = tmp_path / "run-lat.requests.jsonl.gz"
    lines = b'{"index": 0, "latency_s": 0.5}\n{"index": 1, "latency_s": 0.4}\n'
    path.write_bytes(gzip.compress(lines))
    assert [row["latency_s"] for row in iter_requests(path)] == [0.5, 0.4]


def test_a_refusal_is_one_line_when_the_record_names_a_metric_with_a_newline(
    tmp_path: Path,
) -> None:
    # Found by the property above: `results.\n is inf` read as two lines.
    record = make_record("run-nl")
    record["results"]["\n"] = float("inf")
    _write(tmp_path / "records", [make_record("run-a")])
    (tmp_path / "records" / "run-nl.json").write_text(json.dumps(record, allow_nan=True))
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    ((path, reason),) = report.refused
    assert path.name == "run-nl.json" and "inf" in reason and "\n" not in reason
    assert _loaded(tmp_path / "x.db") == {"run-a"}


@pytest.mark.parametrize(
    ("block", "fields"),
    [
        ("cost", {"gpu_hour_price_usd": 2.0, "usd": -1.0}),
        ("cost", {"gpu_hour_price_usd": 2.0, "usd_per_million_output_tokens": -1e6}),
        ("system", {"gpu_energy_j": -100.0}),
    ],
    ids=["usd", "usd-per-million", "energy"],
)
def test_a_cost_or_energy_that_cannot_be_is_refused_naming_its_field(
    tmp_path: Path, block: str, fields: dict[str, float]
) -> None:
    # Before: loaded, and the precision dashboard drew -499,999 USD per million tokens.
    record = make_record("run-neg")
    if block == "cost":
        record["cost"] = fields
    else:
        record["system"].update(fields)
    _write(tmp_path / "records", [make_record("run-a"), record])
    report = ingest(tmp_path / "x.db", record_files([tmp_path / "records"]))
    ((path, reason),) = report.refused
    (field,) = [name for name in fields if name != "gpu_hour_price_usd"]
    assert path.name == "run-neg.json" and f"{block}.{field}" in reason
    assert _loaded(tmp_path / "x.db") == {"run-a"}


# --- files that are not regular files, or far over the limit ---------------------------------


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each os.read returned, from now on."""
    counted: list[int] = []
    read = os.read

    def counting(fd: int, size: int) -> bytes:
        data = read(fd, size)
        counted.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counting)
    return counted


def test_a_fifo_a_device_a_folder_and_a_huge_file_are_refused_in_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: /dev/zero ended in MemoryError, the FIFO hung the read, and the 1.5 GB file was
    # read whole (1.6 GB of memory) before its size was refused.
    folder = tmp_path / "records"
    _write(folder, [make_record("run-a")])
    (folder / "zero.json").symlink_to("/dev/zero")
    (folder / "root.json").symlink_to("/")
    os.mkfifo(folder / "fifo.json")
    with open(folder / "big.json", "wb") as handle:
        handle.truncate(1_500_000_000)  # sparse: no disk
    counted = _count_reads(monkeypatch)
    assert cli_main(["ingest", str(tmp_path / "x.db"), str(folder)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"profllm ingest: refused {folder / 'big.json'}: the file is 1,500,000,000 bytes, "
        "more than the 67,108,864 read",
        f"profllm ingest: refused {folder / 'fifo.json'}: a FIFO, not a regular file: only "
        "regular files are read",
        f"profllm ingest: refused {folder / 'root.json'}: a link to a folder (/), not a regular "
        "file: only regular files are read",
        f"profllm ingest: refused {folder / 'zero.json'}: a link to a character device "
        "(/dev/zero), not a regular file: only regular files are read",
    ]
    assert captured.out.endswith(": 1 new, 0 unchanged, 4 refused\n")
    assert _loaded(tmp_path / "x.db") == {"run-a"}
    # Only the good record was read: the rest were refused by what fstat said.
    assert sum(counted) < 100_000


def test_no_more_than_the_limit_and_one_byte_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 10_000
    path = tmp_path / "grows.json"
    path.write_bytes(b" " * (50 * limit))
    counted = _count_reads(monkeypatch)
    with pytest.raises(InputLimitError, match="is 500,000 bytes, more than the 10,000 read"):
        read_regular(path, limit)
    assert counted == []
    # A file that grew after its size was taken (or says 0, as /proc's do) is read no
    # further than the limit and one byte.
    fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result(
        (*fstat(fd)[:6], 10, *fstat(fd)[7:])))
    with pytest.raises(InputLimitError, match="is more than the 10,000 bytes read"):
        read_regular(path, limit)
    assert sum(counted) == limit + 1
    counted.clear()
    path.write_bytes(b"{}")
    assert read_regular(path, limit) == b"{}" and sum(counted) == 2


def test_a_fifo_under_a_request_files_name_is_refused_with_its_record(tmp_path: Path) -> None:
    # gzip.open of a FIFO waits for a writer: the load would hang.
    folder = tmp_path / "records"
    _write(folder, [make_record("run-a"), make_record("run-b")])
    os.mkfifo(folder / "run-b.requests.jsonl.gz")
    report = ingest(tmp_path / "x.db", record_files([folder]))
    assert [(path.name, reason) for path, reason in report.refused] == [(
        "run-b.json",
        "its request file run-b.requests.jsonl.gz: a FIFO, not a regular file: only regular "
        "files are read",
    )]
    assert _loaded(tmp_path / "x.db") == {"run-a"}


def test_nan_and_infinity_written_as_strings_are_refused_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: stored, as NULL and as Infinity, and `profllm check` then called the row wrong.
    folder = tmp_path / "records"
    nan, inf = make_record("run-nan"), make_record("run-inf")
    nan["results"]["median_ttft_ms"] = "NaN"
    inf["results"]["output_throughput"] = "-Infinity"
    _write(folder, [make_record("run-a"), nan, inf])
    assert cli_main(["ingest", str(tmp_path / "x.db"), str(folder)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"profllm ingest: refused {folder / 'run-inf.json'}: results.output_throughput is "
        "'-Infinity', not a finite number: metrics must be finite numbers",
        f"profllm ingest: refused {folder / 'run-nan.json'}: results.median_ttft_ms is 'NaN', "
        "not a finite number: metrics must be finite numbers",
    ]
    assert _loaded(tmp_path / "x.db") == {"run-a"}
