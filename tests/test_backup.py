"""`profllm backup` and `profllm restore`: a backup taken while another process writes is the
database at the backup's moment and passes `profllm check`, and the writer loses nothing; the
records go beside it; a restore is whole or nothing, written in place, so that a reader sees
it and a session's load waits for it; every refusal is one line."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
from helpers import pytest_argv
from test_ingest import records_folder

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.results.backup import BackupError, backup, restore
from pytest_profllm.results.check import check
from pytest_profllm.results.schema_version import SCHEMA_VERSION
from pytest_profllm.results.table import TABLE

TESTS = Path(__file__).parent

# A session's loads, one record each, until the file STOP exists; prints how many it loaded.
_WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_store import make_record
from pytest_profllm.results.store import load_records

db, stop = Path(sys.argv[1]), Path(sys.argv[2])
written = 0
while not stop.exists():
    run_id = f"w-{written:05d}"
    load_records(db, [make_record(run_id)], requests={run_id: [{"index": 0, "success": True}]})
    written += 1
print(written)
"""

# Holds the database's write lock until stdin closes, as a session's load does.
_HOLDER = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.read()
"""


def rows(db: Path) -> int:
    with sqlite3.connect(db) as connection:
        count: int = connection.execute(f"SELECT count(*) FROM [{TABLE}]").fetchone()[0]
    return count


@pytest.fixture
def db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "results.db"
    folder = records_folder(tmp_path, *(f"run-{at:02d}" for at in range(20)))
    assert cli_main(["ingest", str(path), str(folder)]) == 0
    capsys.readouterr()
    return path


@pytest.fixture
def process() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, killed and reaped whatever the test's end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=60)


def wait_for(condition: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_backup_while_a_session_writes_is_the_database_at_its_moment(
    db: Path, tmp_path: Path, process: list[subprocess.Popen[str]]
) -> None:
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db), str(stop), str(TESTS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    process.append(writer)
    wait_for(lambda: rows(db) > 20, "the writer's first load")
    at_start: list[int] = []

    def progress(copied: int, total: int) -> None:
        if not at_start:
            # The backup has begun: the writer commits more before it ends.
            at_start.append(rows(db))
            wait_for(lambda: rows(db) > at_start[0], "a load during the backup")

    dest = tmp_path / "backup.db"
    report = backup(db, dest, progress, pages_per_step=1)
    stop.touch()
    written = int(writer.communicate(timeout=120)[0])
    assert writer.returncode == 0
    assert at_start and report.pages > 1
    # The backup is whole, and is the database as it was when it began.
    assert not check(dest).problems
    assert rows(dest) == report.runs <= at_start[0] < rows(db)
    # The session lost nothing.
    assert rows(db) == 20 + written
    assert not check(db).problems


@pytest.mark.parametrize("records_as", ["tar", "folder"])
def test_the_records_go_beside_the_backup(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], records_as: str
) -> None:
    dest = tmp_path / "keep" / "backup.db"
    dest.parent.mkdir()
    assert (
        cli_main(
            [
                "backup",
                str(db),
                str(dest),
                "--with-records",
                str(tmp_path / "records"),
                "--records-as",
                records_as,
            ]
        )
        == 0
    )
    beside = dest.with_name("backup.db.records" + (".tar" if records_as == "tar" else ""))
    assert capsys.readouterr().out == (
        f"{dest}: 20 run(s), schema version {SCHEMA_VERSION}, {_pages(dest)} page(s); "
        f"40 record and request file(s) in {beside}\n"
    )
    if records_as == "tar":
        with tarfile.open(beside) as tar:
            names = tar.getnames()
    else:
        names = [path.name for path in beside.iterdir()]
    assert sorted(names) == sorted(path.name for path in (tmp_path / "records").iterdir())
    unpacked = tmp_path / "unpacked"
    if records_as == "tar":
        with tarfile.open(beside) as tar:
            tar.extractall(unpacked, filter="data")
    else:
        unpacked = beside
    assert not check(dest, unpacked).problems


@pytest.mark.parametrize("records_as", ["tar", "folder"])
def test_a_link_out_of_the_records_folder_is_left_out_with_a_line(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], records_as: str
) -> None:
    # Before: `notes.json -> /etc/passwd` went into the tar, as `passwd`.
    records = tmp_path / "records"
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not for the backup")
    (records / "notes.json").symlink_to(secret)
    (records / "run-00.requests.jsonl.gz").rename(tmp_path / "moved.gz")
    (records / "run-00.requests.jsonl.gz").symlink_to(tmp_path / "moved.gz")
    os.mkfifo(records / "pipe.json")
    dest = tmp_path / "backup.db"
    argv = ["backup", str(db), str(dest), "--with-records", str(records), "--records-as",
            records_as]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    where = records.resolve()
    assert captured.err.splitlines() == [
        f"profllm backup: skipped {where / 'notes.json'}: a link (to {secret.resolve()}); only "
        "regular files inside the folder are copied",
        f"profllm backup: skipped {where / 'pipe.json'}: a FIFO, not a regular file: only "
        "regular files are read; not copied",
        f"profllm backup: skipped {where / 'run-00.requests.jsonl.gz'}: a link (to "
        f"{(tmp_path / 'moved.gz').resolve()}); only regular files inside the folder are copied",
    ]
    assert "; 39 record and request file(s) in " in captured.out
    beside = dest.with_name("backup.db.records" + (".tar" if records_as == "tar" else ""))
    if records_as == "tar":
        with tarfile.open(beside) as tar:
            members = tar.getmembers()
        assert all(member.isfile() for member in members)
        names = [member.name for member in members]
    else:
        names = [path.name for path in beside.iterdir()]
    assert len(names) == 39 and "notes.json" not in names and "pipe.json" not in names
    assert "run-00.requests.jsonl.gz" not in names and "secret.txt" not in names


def _pages(path: Path) -> int:
    with sqlite3.connect(path) as connection:
        count: int = connection.execute("PRAGMA page_count").fetchone()[0]
    return count


def test_what_cannot_be_backed_up_is_one_line(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken.db"
    taken.touch()
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    cases: list[tuple[list[Path | str], str]] = [
        ([db, taken], f"{taken}: exists; name a new file for the backup"),
        ([tmp_path / "none.db", tmp_path / "b.db"], f"{tmp_path / 'none.db'}: no such database"),
        ([db, tmp_path / "no" / "b.db"], f"{tmp_path / 'no'}: no such folder"),
        (
            [db, tmp_path / "b.db", "--with-records", tmp_path / "none"],
            f"--with-records {tmp_path / 'none'}: no such folder",
        ),
        (
            [newer, tmp_path / "b.db"],
            f"{newer}: schema version {SCHEMA_VERSION + 1} is newer "
            f"than this plugin's {SCHEMA_VERSION}: upgrade pytest-profllm to read or write it",
        ),
    ]
    for args, line in cases:
        assert cli_main(["backup", *map(str, args)]) == 2
        assert capsys.readouterr().err == f"profllm backup: {line}\n"
    assert not (tmp_path / "b.db").exists()


def journal_mode(db: Path) -> str:
    with closing(sqlite3.connect(db)) as connection:
        mode: str = connection.execute("PRAGMA journal_mode").fetchone()[0]
    return mode


def test_a_restore_puts_the_backup_in_place_and_leaves_no_log(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "backup.db"
    backup(db, dest)
    # The database moves on after the backup; the restore takes it back.
    assert cli_main(["ingest", str(db), str(records_folder(tmp_path / "later", "run-z"))]) == 0
    assert rows(db) == 21
    capsys.readouterr()
    inode = db.stat().st_ino
    assert cli_main(["restore", str(dest), str(db)]) == 0
    assert capsys.readouterr().out == (
        f"{db}: restored from {dest} (schema version {SCHEMA_VERSION})\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir() if "results.db" in path.name) == [
        "results.db"
    ]
    # Written in place, and left in WAL mode (before: renamed over, in rollback-journal mode).
    assert db.stat().st_ino == inode and journal_mode(db) == "wal"
    assert rows(db) == 20
    assert not check(db, tmp_path / "records").problems
    # Into a new file too, where a log of another database was left without it.
    fresh = tmp_path / "fresh.db"
    (tmp_path / "fresh.db-wal").write_bytes(
        Path(str(db) + "-wal").read_bytes() if Path(str(db) + "-wal").exists() else b"x" * 64
    )
    assert cli_main(["restore", str(dest), str(fresh)]) == 0
    assert not (tmp_path / "fresh.db-wal").exists()
    assert journal_mode(fresh) == "wal"
    assert rows(fresh) == 20 and not check(fresh).problems


# A reader as Datasette is one: a read-only connection, holding a read transaction open; each
# line on stdin ends it and reads again. Prints each count.
_READER = """
import sqlite3, sys
from pathlib import Path
connection = sqlite3.connect(Path(sys.argv[1]).resolve().as_uri() + "?mode=ro", uri=True,
                             isolation_level=None)
def count():
    connection.execute("BEGIN")
    print(connection.execute("SELECT count(*) FROM benchmark_runs").fetchone()[0], flush=True)
count()
for _ in sys.stdin:
    connection.execute("COMMIT")
    count()
"""


def test_a_reader_reading_through_restores_sees_each_restored_database(
    db: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    process: list[subprocess.Popen[str]],
) -> None:
    # Before: the second restore renamed a file over the one the reader had open, and the
    # reader went on serving the deleted file (2 runs where the file held 4).
    dest = tmp_path / "backup.db"
    backup(db, dest)
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    process.append(reader)
    assert reader.stdin is not None and reader.stdout is not None

    def read_again() -> int:
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.write("\n")
        reader.stdin.flush()
        return int(reader.stdout.readline())

    assert int(reader.stdout.readline()) == 20
    for turn in range(2):
        later = records_folder(tmp_path / f"later-{turn}", "run-y", "run-z")
        assert cli_main(["ingest", str(db), str(later)]) == 0
        assert read_again() == 22
        # The reader's read transaction is open while the restore writes.
        assert cli_main(["restore", str(dest), str(db)]) == 0
        assert read_again() == 20 == rows(db)
    capsys.readouterr()
    assert journal_mode(db) == "wal"


def test_a_restore_waits_for_a_sessions_load_and_refuses_past_its_wait(
    db: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    process: list[subprocess.Popen[str]],
) -> None:
    dest = tmp_path / "backup.db"
    backup(db, dest)
    assert cli_main(["ingest", str(db), str(records_folder(tmp_path / "later", "run-z"))]) == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    process.append(holder)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(BackupError) as refused:
        restore(dest, db, wait_s=0.2)
    assert str(refused.value) == (
        f"{db}: held by another process for over 0.2 s (a session loading, or a reader in "
        "rollback-journal mode): restore again once it is done"
    )
    assert rows(db) == 21
    # The load ends while the restore waits: the restore goes on.
    threading.Timer(0.5, lambda: holder.communicate("", timeout=60)).start()
    assert cli_main(["restore", str(dest), str(db)]) == 0
    assert rows(db) == 20


# Loads of one record each, as a session's are, counting those that fail (with why).
_LOADS = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_store import make_record
from pytest_profllm.results.store import load_records

db, loads = Path(sys.argv[1]), int(sys.argv[2])
failed = []
for at in range(loads):
    run_id = f"w-{at:05d}"
    try:
        load_records(db, [make_record(run_id)], requests={run_id: [{"index": 0, "success": True}]})
    except Exception as error:
        failed.append(repr(error))
print(len(failed), failed[:3])
"""


def test_restores_beside_a_sessions_loads_fail_none_of_them(
    db: Path, tmp_path: Path, process: list[subprocess.Popen[str]]
) -> None:
    # Before: 1-11 of 1,000 loads failed (attempt to write a readonly database, database disk
    # image is malformed) while restores renamed files over the database.
    dest = tmp_path / "backup.db"
    backup(db, dest)
    writer = subprocess.Popen([sys.executable, "-c", _LOADS, str(db), "50", str(TESTS)],
                              stdout=subprocess.PIPE, text=True)
    process.append(writer)
    restores = 0
    while writer.poll() is None and restores < 500:
        restore(dest, db)
        restores += 1
    out = writer.communicate(timeout=120)[0]
    assert writer.returncode == 0 and out.startswith("0 "), out
    assert restores >= 1, restores
    assert not check(db).problems and journal_mode(db) == "wal"


def test_what_cannot_be_restored_is_one_line(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "notes.db"
    text.write_text("not a database, but long enough to have a header of sorts " * 10)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as connection:
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    empty = tmp_path / "empty.db"
    empty.touch()  # a copy that failed
    other = tmp_path / "other.db"
    with closing(sqlite3.connect(other)) as connection:
        connection.execute("CREATE TABLE notes (text)")
    broken = tmp_path / "broken.db"
    backup(db, broken)
    with closing(sqlite3.connect(broken)) as connection:
        page_size = connection.execute("PRAGMA page_size").fetchone()[0]
        root = connection.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'gate_runs'"
        ).fetchone()[0]
    with broken.open("r+b") as handle:  # the table's root page: a b-tree page no more
        handle.seek((root - 1) * page_size)
        handle.write(b"\x0d" + b"\xff" * 64)
    fifo = tmp_path / "fifo.db"
    os.mkfifo(fifo)
    before = rows(db)
    for args, line in [
        ([tmp_path / "none.db", db], f"{tmp_path / 'none.db'}: no such backup"),
        ([text, db], f"{text}: not an SQLite database"),
        ([empty, db], f"{empty}: empty (0 bytes): not a backup"),
        ([other, db], f"{other}: not a results database: it has no table benchmark_runs"),
        ([fifo, db], f"{fifo}: a FIFO, not a regular file: only regular files are read"),
        (
            [newer, db],
            f"{newer}: schema version {SCHEMA_VERSION + 1} is newer than this "
            f"plugin's {SCHEMA_VERSION}: upgrade pytest-profllm to read or write it",
        ),
        ([db, tmp_path / "no" / "x.db"], f"{tmp_path / 'no'}: no such folder"),
    ]:
        assert cli_main(["restore", *map(str, args)]) == 2
        assert capsys.readouterr().err == f"profllm restore: {line}\n"
    assert cli_main(["restore", str(broken), str(db)]) == 2
    assert capsys.readouterr().err == (
        f"profllm restore: {broken}: not a whole database: database disk image is malformed\n"
    )
    assert rows(db) == before
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


def test_progress_counts_the_pages_up_to_all_of_them(db: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    report = backup(db, tmp_path / "b.db", lambda *told: seen.append(told), pages_per_step=4)
    assert len(seen) > 1
    assert [copied for copied, _ in seen] == sorted(copied for copied, _ in seen)
    assert seen[-1] == (report.pages, report.pages)


# A session's load that stops inside its transaction (its rows written, not committed) until
# the test says go: the moment a backup runs beside it.
_PAUSE_AT_LOAD = """
import os, time
from pathlib import Path
from pytest_profllm.results import store

if os.environ.get("PROFLLM_TEST_PAUSE_AT_LOAD"):
    signals = Path(os.environ["PROFLLM_TEST_PAUSE_AT_LOAD"])
    _add = store.Load.add

    def add(self, staged, positions=None):
        _add(self, staged, positions)
        (signals / "writing").touch()
        while not (signals / "go").exists():
            time.sleep(0.05)

    store.Load.add = add
"""

_SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [4, 16]
  max_model_len: 2048
benchmark:
  num_prompts: 10
  random_input_len: 50
  random_output_len: 5
  request_rate: [10, inf]
"""


def test_a_backup_while_an_xdist_session_loads_is_whole_and_the_session_loses_nothing(
    pytester: pytest.Pytester,
    ports: str,
    tmp_path: Path,
    process: list[subprocess.Popen[str]],
) -> None:
    pytester.makeconftest(_PAUSE_AT_LOAD)
    pytester.makefile(".yaml", bench_b=_SUITE)
    args = ("-n", "2", "--profllm-engine", "sim", "--profllm-sim-clock", "virtual")
    argv = pytest_argv(ports, *args, cache=False)
    subprocess.run(argv, cwd=pytester.path, check=True, capture_output=True, timeout=600)
    out = pytester.path / "results"
    db = out / "results.db"
    assert rows(db) == 4
    signals = tmp_path / "signals"
    signals.mkdir()
    session = subprocess.Popen(
        argv,
        cwd=pytester.path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PROFLLM_TEST_PAUSE_AT_LOAD": str(signals)},
    )
    process.append(session)
    wait_for(
        lambda: (signals / "writing").exists() or session.poll() is not None,
        "the session's load",
        timeout=600,
    )
    assert session.poll() is None, session.communicate()[0]
    dest = tmp_path / "backup.db"
    report = backup(db, dest)
    (signals / "go").touch()
    output = session.communicate(timeout=600)[0]
    assert session.returncode == 0, output
    # The backup is the database before the session's load: whole, its 4 runs.
    assert report.runs == rows(dest) == 4 and not check(dest).problems
    # The session lost nothing: its 4 runs went in, each row matching its record.
    assert rows(db) == 8
    assert not check(db, out).problems
