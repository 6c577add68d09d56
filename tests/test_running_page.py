"""The "Running now" page of a results database: the cases a session runs into the
results folder, read from the live files beside the database, with their telemetry so far;
a case that ended links to its run page; the page and its JSON follow Datasette's
permissions; and a real `datasette serve` read in a loop while a session at -n 4 writes
sees whole answers only."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from datasette.app import Datasette
from helpers import run_suites
from test_browse_permissions import PRIVATE, results_db

from pytest_profllm.browse import running_page
from pytest_profllm.limits import MAX_LIVE_FILE_BYTES
from pytest_profllm.load import live_status
from pytest_profllm.load.metrics import RequestOutcome

CASE = "bench_x.yaml::qwen3-0.6b::random"
# Four servers at once, each case's load long enough (30 requests at 10/s) to be seen running.
FOUR_SERVERS = """
server:
  model: Qwen/Qwen3-0.6B
  seed: [0, 1, 2, 3]
benchmark:
  num_prompts: 30
  random_input_len: 16
  random_output_len: 8
  request_rate: 10
"""
POINT = {"t_s": 0.5, "request_throughput": 4.0, "output_throughput": 32.0, "running": 3.0,
         "waiting": 1.0, "kv_cache_usage": 0.25, "gpu_utilization": None}


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The live folder beside a results database with one run (r1), this process its writer."""
    results_db(tmp_path)
    folder = tmp_path / live_status.LIVE_FOLDER
    folder.mkdir()
    monkeypatch.setenv(live_status.DIR_ENV, str(folder))
    yield folder
    live_status.close()


def get(db: Path, path: str, actor: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        datasette = Datasette([str(db)], metadata=metadata or {})
        await datasette.invoke_startup()
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        response: httpx.Response = await datasette.client.get(path, cookies=cookies)
        return response

    return asyncio.run(run())


def test_a_running_case_shows_with_its_stage_progress_and_series(live: Path) -> None:
    with live_status.running(CASE, "gw0", "r1"):
        live_status.set_stage("loading")
        live_status.series_start(lambda: [POINT])
        progress = live_status.load_progress(10, 5.0)
        assert progress is not None
        progress.sent(RequestOutcome(16))
        progress.done(RequestOutcome(16, success=True, ttft=0.05, latency=0.2, output_tokens=8))
        live_status.reporter().write()  # type: ignore[union-attr]
        answer = get(live.parent / "results.db", "/results/-/running.json").json()
        ((row,),) = [answer["running"]]
        assert (row["case"], row["worker"], row["stage"]) == (CASE, "gw0", "loading")
        assert (row["done"], row["total"], row["failed"]) == (1, 10, 0)
        assert row["median_ttft_ms"] == pytest.approx(50.0)
        assert answer["data"]["throughput"] == [
            {"case": CASE, "series": CASE, "t_s": 0.5, "value": 32.0}]
        assert {r["series"]: r["value"] for r in answer["data"]["queue"]} == {
            f"{CASE} running": 3.0, f"{CASE} waiting": 1.0}
        assert answer["data"]["kv"][0]["value"] == 0.25
        assert answer["finished"] == []
    # Ended: no more running, and a link to its run page (r1 is in the database).
    answer = get(live.parent / "results.db", "/results/-/running.json").json()
    assert answer["running"] == []
    ((finished,),) = [answer["finished"]]
    assert (finished["case"], finished["run_id"], finished["loaded"]) == (CASE, "r1", True)
    assert finished["run_url"] == "/results/-/run/r1"


def test_the_page_draws_from_the_json_and_the_landing_page_links_it(live: Path) -> None:
    db = live.parent / "results.db"
    page = get(db, "/results/-/running")
    assert page.status_code == 200
    assert 'data-json-url="/results/-/running.json"' in page.text
    assert "running.js" in page.text
    for chart_id, *_ in running_page.CHARTS:
        assert f'id="{chart_id}"' in page.text
    assert 'href="/results/-/running"' in get(db, "/results/runs").text


def test_a_finished_case_leaves_after_a_minute(tmp_path: Path) -> None:
    nothing = running_page.running_now(None)
    assert nothing["running"] == [] and nothing["finished"] == []
    ended = {"case": CASE, "worker": "gw0", "stage": live_status.FINISHED, "run_id": "r1",
             "ended": 100.0, "history": []}
    (tmp_path / "1.json").write_text(json.dumps({"cases": [ended]}))

    def finished(now: float) -> list[str]:
        return [f["run_id"] for f in running_page.running_now(tmp_path, now)["finished"]]

    assert finished(100.0 + 59) == ["r1"]
    assert finished(100.0 + live_status.FINISHED_KEEP_S + 1) == []


@pytest.mark.parametrize("path", ["/results/-/running", "/results/-/running.json"])
def test_an_actor_without_permission_gets_403(live: Path, path: str) -> None:
    db = live.parent / "results.db"
    assert get(db, path, {"id": "alice"}, PRIVATE).status_code == 403
    assert get(db, path, None, PRIVATE).status_code == 403
    assert get(db, path, {"id": "root"}, PRIVATE).status_code == 200


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def datasette_serve(db: Path) -> Iterator[str]:
    """`datasette serve db` on loopback, stopped (and reaped) whatever happens."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "datasette", "serve", str(db), "--host", "127.0.0.1",
         "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/-/versions.json", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(process.stderr.read().decode()) from None  # type: ignore[union-attr]
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _consistent(answer: dict[str, Any]) -> None:
    running = {row["case"] for row in answer["running"]}
    ended = {f"{entry['case']} (ended)" for entry in answer["finished"]}
    for row in answer["running"]:
        assert 0 <= row["failed"] <= row["done"], row
        assert row["total"] == 0 or row["done"] <= row["total"], row
        assert row["stage"] and row["stage"] != live_status.FINISHED, row
    for rows in answer["data"].values():
        assert {point["case"] for point in rows} <= running | ended
    for entry in answer["finished"]:
        assert entry["run_id"] and entry["run_url"].endswith(entry["run_id"])


def test_reads_while_a_session_at_n4_writes_see_whole_answers(
    pytester: pytest.Pytester, ports: str
) -> None:
    results = pytester.path / "results"
    results.mkdir()
    results_db(results)  # an earlier session's database, served while the next one runs
    pytester.makefile(".yaml", bench_x=FOUR_SERVERS)
    answers: list[dict[str, Any]] = []
    stop = threading.Event()
    errors: list[BaseException] = []
    with datasette_serve(results / "results.db") as url:

        def fetch() -> None:
            try:
                while not stop.is_set():
                    with urllib.request.urlopen(url + "/results/-/running.json",
                                                timeout=30) as response:
                        assert response.status == 200
                        answers.append(json.loads(response.read()))
                    time.sleep(0.05)
            except BaseException as error:  # reported by the test's thread
                errors.append(error)

        reader = threading.Thread(target=fetch)
        reader.start()
        try:
            result = run_suites(pytester, ports, "-n", "4", "-q")
        finally:
            stop.set()
            reader.join()
        assert errors == []
        result.assert_outcomes(passed=4)
        for answer in answers:
            _consistent(answer)
        seen = {row["case"] for answer in answers for row in answer["running"]}
        assert len(seen) == 4, seen
        assert any(answer["data"]["throughput"] for answer in answers)
        finished = {e["run_id"]: e for answer in answers for e in answer["finished"]}
        assert finished
        # Once the session loaded its records, a finished case's link opens its run page.
        run_id = next(iter(finished))
        with urllib.request.urlopen(url + finished[run_id]["run_url"], timeout=30) as page:
            assert page.status == 200
    # The session's end removed its live folder: nothing shows as running any more.
    assert not (results / live_status.LIVE_FOLDER).exists()


def test_the_run_page_series_is_the_samples_the_live_page_showed(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "live"
    folder.mkdir()
    monkeypatch.setenv(live_status.DIR_ENV, str(folder))  # given: kept after the session
    pytester.makefile(".yaml", bench_x=FOUR_SERVERS.replace("[0, 1, 2, 3]", "0"))
    run_suites(pytester, ports, "-n", "0", "-q", gpus=1).assert_outcomes(passed=1)
    ((status,),) = [[s for s in live_status.read_folder(folder) if s["worker"]]]
    ((record,),) = [[json.loads(p.read_text()) for p in (pytester.path / "results").glob("*.json")]]
    assert status["run_id"] == record["run_id"]
    # The same samples, on the same axis (seconds from the load's start).
    kept = [{name: point[name] for name in live_status.POINT_FIELDS} for point in record["series"]]
    assert len(kept) > 3 and status["series"] == kept


def test_a_session_run_inside_another_keeps_out_of_its_live_folder(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A session that runs pytest (this project's own tests, under CI's `pytest -n 2`) leaves
    # its live folder in the environment; the inner session wrote its cases there, so its own
    # "Running now" page saw nothing and the outer view drew the inner cases.
    outer = tmp_path / "outer-live"
    outer.mkdir()
    monkeypatch.setenv(live_status.DIR_ENV, str(outer))
    monkeypatch.setenv("PROFLLM_LIVE_DIR_OF_SESSION", str(outer))
    pytester.makefile(".yaml", bench_x=FOUR_SERVERS.replace("[0, 1, 2, 3]", "0"))
    run_suites(pytester, ports, "-n", "0", "-q", gpus=1).assert_outcomes(passed=1)
    assert list(outer.iterdir()) == []


def _running_case(**fields: Any) -> dict[str, Any]:
    return {"case": CASE, "worker": "gw0", "stage": "loading", "stage_since": time.time() - 5,
            "history": ["loading"], "total": 10, "done": 3, **fields}


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_files_numbers_that_are_not_finite_read_as_null(live: Path) -> None:
    # The server's KV gauge, NaN before its first step, was copied into the file, and
    # running.json carried it as NaN: not JSON, and the page's refresh failed.
    (live / "1.json").write_text(json.dumps({"cases": [_running_case(
        kv_cache_usage=float("nan"), running=float("inf"), median_ttft_ms=1e308,
        series=[{"t_s": 0.5, "output_throughput": float("nan"), "kv_cache_usage": 0.5}])]}))
    (live / "2.json").write_text(json.dumps({"cases": [_running_case(
        worker="", median_ttft_ms=1e308)]}))
    response = get(live.parent / "results.db", "/results/-/running.json")
    answer = _strict(response.text)
    ((row,),) = [answer["running"]]
    assert (row["kv_cache_usage"], row["running"], row["done"]) == (None, None, 6)
    assert row["median_ttft_ms"] is None  # the two medians' mean overflows: null, not inf
    assert answer["data"]["throughput"] == [] and answer["data"]["kv"][0]["value"] == 0.5
    assert answer["notes"] == []
    # The writer keeps its own files JSON too.
    with live_status.running(CASE, "gw0", "r1"):
        live_status.server_state(float("nan"), 2.0, float("nan"))
        live_status.reporter().write()  # type: ignore[union-attr]
        written = _strict(live_status.reporter().path.read_text())  # type: ignore[union-attr]
        assert written["cases"][0]["kv_cache_usage"] is None


def test_a_bad_live_file_is_skipped_with_a_note_and_the_page_stands(live: Path) -> None:
    good = live / "1.json"
    good.write_text(json.dumps({"cases": [_running_case()]}))
    # A string stage_since gave a 500 and a traceback; the others each a check of their own.
    (live / "2.json").write_text(json.dumps({"cases": [_running_case(
        case="other", stage_since="yesterday")]}))
    (live / "3.json").write_text(json.dumps({"cases": [_running_case(case="c3", done=True)]}))
    (live / "4.json").write_text(json.dumps({"cases": [{"stage": "loading"}]}))
    (live / "5.json").write_text("[1, 2")
    (live / "6.json").write_text(json.dumps({"pid": "1", "cases": []}))
    (live / "7.json").write_text(json.dumps({"cases": [_running_case(
        case="c7", history=[1], total=10**30)]}))
    (live / "8.json").write_text(json.dumps({"cases": [_running_case(
        case="\x1b[2J", series=[{"t_s": "0"}])]}))
    for response in (get(live.parent / "results.db", "/results/-/running.json"),
                     get(live.parent / "results.db", "/results/-/running")):
        assert response.status_code == 200
    answer = get(live.parent / "results.db", "/results/-/running.json").json()
    assert [row["case"] for row in answer["running"]] == [CASE]
    notes = answer["notes"]
    assert [note.split(":")[0] for note in notes] == [f"{n}.json" for n in range(2, 9)]
    assert "cases[0].stage_since is a str, not a number" in notes[0]
    assert "cases[0].done is a bool, not a count" in notes[1]
    assert "cases[0].case is not a case id" in notes[2]
    assert "pid is a str" in notes[4]
    assert "not a list of strings" in notes[5] and "series" in notes[6]
    assert all("\n" not in note and "\x1b" not in note for note in notes)
    page = get(live.parent / "results.db", "/results/-/running").text
    assert 'id="profllm-running-notes"' in page


def test_a_live_file_that_is_not_a_regular_file_is_not_read(live: Path) -> None:
    # A link to /dev/zero read 2.1 GB; a FIFO would block the page; a file past the limit
    # is not read at all.
    (live / "1.json").write_text(json.dumps({"cases": [_running_case()]}))
    (live / "2.json").symlink_to("/dev/zero")
    (live / "3.json").symlink_to(live / "1.json")
    os.mkfifo(live / "4.json")
    with (live / "5.json").open("wb") as big:
        big.truncate(MAX_LIVE_FILE_BYTES + 1)
    started = time.monotonic()
    read = live_status.read_live(live)
    assert time.monotonic() - started < 5
    assert [case["case"] for case in read.cases] == [CASE]
    assert [note.split(":")[0] for note in read.notes] == ["2.json", "3.json", "4.json",
                                                          "5.json"]
    assert "symbolic link" in read.notes[0] and "not a regular file" in read.notes[2]
    assert "over the 16,777,216 bytes" in read.notes[3]


@contextlib.contextmanager
def _process() -> Iterator[subprocess.Popen[bytes]]:
    """A process of our own that sleeps, killed and reaped whatever happens."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_dead_writers_cases_are_not_shown_running(live: Path) -> None:
    # After kill -9 of a session's worker its file stays: the page showed its case running,
    # its time growing, until another session ran in the folder.
    db = live.parent / "results.db"
    with _process() as writer:
        started = psutil.Process(writer.pid).create_time()
        ours = live_status.writer_identity()
        (live / "1.json").write_text(json.dumps({
            "pid": writer.pid, "started": started, "host": ours["host"],
            "cases": [_running_case(), _running_case(
                case="ended", stage=live_status.FINISHED, run_id="r1", ended=time.time())]}))
        assert [row["case"] for row in get(db, "/results/-/running.json").json()["running"]] \
            == [CASE]
        writer.kill()
        writer.wait()
    answer = get(db, "/results/-/running.json").json()
    assert answer["running"] == []
    assert [f["run_id"] for f in answer["finished"]] == ["r1"]  # its minute, as before
    assert answer["notes"] == [
        f"1.json: process {writer.pid} ended while {CASE} was loading: not running"]
    # A live pid is not taken for the writer when its process started at another time (the
    # pid was reused); a file from before files named the start time is checked by pid.
    assert live_status.writer_alive(ours["pid"], ours["started"], ours["host"])
    assert not live_status.writer_alive(ours["pid"], ours["started"] - 3600, ours["host"])
    assert not live_status.writer_alive(writer.pid, None, None)
    assert live_status.writer_alive(ours["pid"], None, None)
    # No pid (an old file), or another host's (a shared folder): believed.
    assert live_status.writer_alive(None, None, None)
    assert live_status.writer_alive(writer.pid, started, "another-host")


def test_the_writer_names_itself_in_its_file(live: Path) -> None:
    with live_status.running(CASE, "gw0", "r1"):
        live_status.reporter().write()  # type: ignore[union-attr]
        written = json.loads(live_status.reporter().path.read_text())  # type: ignore[union-attr]
    assert written["pid"] == os.getpid()
    assert written["started"] == pytest.approx(psutil.Process().create_time())
    assert written["host"] == socket.gethostname()


def test_every_field_of_a_live_file_has_a_check() -> None:
    # A field added to CaseStatus with a type the reader has no check for fails here, not
    # on the page.
    document = {"cases": [dataclasses.asdict(live_status.CaseStatus(CASE))]}
    _, (case,) = live_status._checked(document)
    assert case == document["cases"][0]
