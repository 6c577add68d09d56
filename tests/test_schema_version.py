"""The results database's schema version: databases written by earlier commits' code open and
migrate; a migration killed or failing half-way leaves the old database as it was; a database
newer than the plugin is refused in one line, by the command and by a session."""

from __future__ import annotations

import gzip
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_suites
from test_ingest import records_folder

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.results import schema_version, store
from pytest_profllm.results.schema_version import SCHEMA_VERSION

FIXTURES = Path(__file__).parent / "data" / "schema_versions"
OLD_VERSIONS = sorted(path.name for path in FIXTURES.glob("v*") if path.is_dir())


def old_database(name: str, folder: Path) -> Path:
    """The fixture database `name` (tests/data/schema_versions/NAME), as its commit wrote it."""
    db = folder / "results.db"
    with gzip.open(FIXTURES / name / "results.db.gz", "rb") as source, db.open("wb") as target:
        shutil.copyfileobj(source, target)
    return db


def contents(db: Path) -> dict[str, object]:
    """Everything a database holds: its version, its schema and every table's rows."""
    with sqlite3.connect(db) as connection:
        tables = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        found: dict[str, object] = {
            "user_version": schema_version.read(connection),
            "schema": sorted(connection.execute("SELECT type, name, sql FROM sqlite_master")),
        }
        for table in tables:
            found[table] = sorted(map(repr, connection.execute(f"SELECT * FROM [{table}]")))
    return found


def test_there_are_fixtures_of_three_earlier_versions_or_more() -> None:
    assert len(OLD_VERSIONS) >= 3
    for name in OLD_VERSIONS:
        version = int(name[1:].split("-")[0])
        assert version < SCHEMA_VERSION and name.split("-")[1] in schema_version.HISTORY[version]


@pytest.mark.parametrize("name", OLD_VERSIONS)
def test_a_database_of_an_earlier_version_migrates(name: str, tmp_path: Path) -> None:
    db = old_database(name, tmp_path)
    runs = contents(db)["benchmark_runs"]
    assert store.migrate(db) == (0, SCHEMA_VERSION)
    after = contents(db)
    assert after["user_version"] == SCHEMA_VERSION
    assert {"gate_runs", "request_samples", "runs", "facet_counts", "run_series"} <= set(after)
    assert len(after["benchmark_runs"]) == len(runs) == 3  # type: ignore[arg-type]
    # Its records, loaded again by this plugin, are the rows it holds.
    assert store.migrate(db) == (SCHEMA_VERSION, SCHEMA_VERSION)


_KILLED = """
import os, signal, sys
from pathlib import Path
from pytest_profllm.results import store

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

# After every migration step but the commit: the landing table is refreshed last.
store.refresh_landing = die
store.migrate(Path(sys.argv[1]))
"""


def test_a_migration_killed_half_way_leaves_the_old_database(tmp_path: Path) -> None:
    db = old_database(OLD_VERSIONS[0], tmp_path)
    before = contents(db)
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, str(db)], capture_output=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert contents(db) == before
    assert store.migrate(db) == (0, SCHEMA_VERSION)


def test_a_migration_failing_half_way_leaves_the_old_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = old_database(OLD_VERSIONS[0], tmp_path)
    before = contents(db)

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "refresh_landing", fail)
    with pytest.raises(OSError):
        store.migrate(db)
    assert contents(db) == before


def newer_database(folder: Path) -> Path:
    db = folder / "results.db"
    assert cli_main(["ingest", str(db), str(records_folder(folder, "run-a"))]) == 0
    with sqlite3.connect(db) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    return db


def test_a_newer_database_is_refused_by_ingest_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = newer_database(tmp_path)
    capsys.readouterr()
    before = contents(db)
    assert cli_main(["ingest", str(db), str(records_folder(tmp_path / "more", "run-b"))]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"profllm ingest: {db}: schema version {SCHEMA_VERSION + 1} is newer than this "
        f"plugin's {SCHEMA_VERSION}: upgrade pytest-profllm to read or write it"
    ]
    assert contents(db) == before


def test_a_newer_database_is_refused_by_a_session_before_any_case(
    pytester: pytest.Pytester, ports: str
) -> None:
    newer_database(pytester.path / "results")
    pytester.makefile(
        ".yaml", bench_x="server: {model: Qwen/Qwen3-8B}\nbenchmark: {num_prompts: 4}\n"
    )
    result = run_suites(
        pytester, ports, "--profllm-engine", "sim", "--profllm-sim-clock", "virtual", cache=False
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if "schema version" in line]
    assert lines == [
        f"ERROR: {pytester.path / 'results' / 'results.db'}: schema version "
        f"{SCHEMA_VERSION + 1} is newer than this plugin's {SCHEMA_VERSION}: "
        "upgrade pytest-profllm to read or write it"
    ]
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize("command", [["history"], ["calibrate"], ["check"], ["backup", "b.db"]])
def test_a_newer_database_is_refused_by_every_command_that_reads_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    db = newer_database(tmp_path)
    capsys.readouterr()
    name, *rest = command
    assert cli_main([name, str(db), *(str(tmp_path / arg) for arg in rest)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"profllm {name}: {db}: schema version {SCHEMA_VERSION + 1} is newer than this "
        f"plugin's {SCHEMA_VERSION}: upgrade pytest-profllm to read or write it"
    ]
