"""Ingest refuses a bad record alone (issue 22): a column name with any character loads, an
over-wide record is refused with its reason, and generated hostile records never stop the
good ones beside them from loading."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store import make_record

from pytest_profllm.results.ingest import ingest, record_files


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
