"""Uploading record files on the web page (browse/upload.py, browse/upload_views.py): only an
actor allowed to write may, and each file gets the outcome `profllm ingest` would give it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest
from datasette.app import Datasette
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasette import make_record

from pytest_profllm.browse import upload
from pytest_profllm.results.store import load_records

CASE = "bench_smoke.yaml::qwen3-8b::random"


def results_db(folder: Path) -> Path:
    db = folder / "results.db"
    load_records(db, [make_record("existing", "s1", CASE, "2026-01-01T10:00:00+00:00")])
    return db


def post(db: Path, files: list[tuple[str, bytes]], actor: dict[str, Any] | None,
         metadata: dict[str, Any] | None = None) -> tuple[httpx.Response, list[httpx.Response]]:
    """GETs the upload page, then POSTs each file as the page's script does."""

    async def run() -> tuple[httpx.Response, list[httpx.Response]]:
        datasette = Datasette([str(db)], metadata=metadata)
        await datasette.invoke_startup()
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        page = await datasette.client.get("/results/-/upload", cookies=cookies)
        token = page.cookies.get("ds_csrftoken") or ""
        answers = []
        for name, content in files:
            answers.append(await datasette.client.post(
                "/results/-/upload", content=content,
                headers={"x-csrftoken": token, "x-profllm-filename": urllib.parse.quote(name)},
                cookies={**cookies, "ds_csrftoken": token}))
        return page, answers

    return asyncio.run(run())


def good(run_id: str = "uploaded") -> bytes:
    return json.dumps(make_record(run_id, "s2", CASE, "2026-01-02T10:00:00+00:00")).encode()


def run_ids(db: Path) -> set[str]:
    with sqlite3.connect(db) as connection:
        table = {r[0] for r in connection.execute("SELECT run_id FROM benchmark_runs")}
        landing = {r[0] for r in connection.execute("SELECT run_id FROM runs")}
    assert table == landing
    return table


def test_an_anonymous_upload_is_refused(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    page, (answer,) = post(db, [("a.json", good())], actor=None)
    assert page.status_code == 403 and "--root" in page.text
    assert answer.status_code == 403
    assert run_ids(db) == {"existing"}
    assert not (tmp_path / upload.UPLOADS).exists()


def test_good_malformed_and_duplicate_files_get_their_outcomes(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    page, answers = post(db, [("good.json", good()), ("bad.json", b'{"run_id": "x", '),
                              ("again.json", good()), ("nan.json", good("n").replace(
                                  b'"request_throughput": 10.0', b'"request_throughput": NaN'))],
                         actor={"id": "root"})
    assert page.status_code == 200 and "Drop files here" in page.text
    outcomes = [(a.status_code, a.json()["outcome"]) for a in answers]
    assert outcomes == [(200, "loaded"), (422, "refused"), (200, "duplicate"), (422, "refused")]
    assert answers[1].json()["reason"].startswith("not JSON")
    assert "request_throughput" in answers[3].json()["reason"]
    assert run_ids(db) == {"existing", "uploaded"}
    assert [p.name for p in (tmp_path / upload.UPLOADS).iterdir()] == ["uploaded.json"]
    # The run page finds the uploaded record among the run's files.
    async def run_page() -> httpx.Response:
        datasette = Datasette([str(db)])
        response: httpx.Response = await datasette.client.get("/results/-/run/uploaded")
        return response

    assert "uploads/uploaded.json" in asyncio.run(run_page()).text


def test_an_allow_block_lets_an_actor_upload(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    metadata = {"plugins": {"pytest-profllm": {"upload": {"allow": {"id": ["alice"]}}}}}
    _, (alice,) = post(db, [("a.json", good("a"))], {"id": "alice"}, metadata)
    _, (bob,) = post(db, [("b.json", good("b"))], {"id": "bob"}, metadata)
    assert (alice.status_code, bob.status_code) == (200, 403)
    assert run_ids(db) == {"existing", "a"}


def test_no_file_name_writes_outside_the_results_folder(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    db = results_db(folder)
    _, answers = post(db, [("../../escape.json", good("../../escape")),
                           ("/etc/cron.d/x.json", good("x"))], {"id": "root"})
    # A run id that is a path is refused by ingest (its request file could not be beside it);
    # a client's file name is never a path here.
    assert [a.json()["outcome"] for a in answers] == ["refused", "loaded"]
    assert not (tmp_path / "escape.json").exists()
    assert [p.name for p in (folder / upload.UPLOADS).iterdir()] == ["x.json"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=400) | st.from_regex(rb'\{"run_id": ".{0,20}"\}'),
       name=st.text(max_size=30))
def test_any_bytes_get_a_reason_and_write_nothing(tmp_path: Path, content: bytes,
                                                  name: str) -> None:
    folder = tmp_path / "any"
    folder.mkdir(exist_ok=True)
    db = folder / "results.db"
    result = upload.upload(db, name, content)
    assert result.outcome == "refused" and result.reason
    assert not db.exists()
    assert not (folder / upload.UPLOADS).exists() or not list(
        (folder / upload.UPLOADS).iterdir())


def test_a_file_that_fails_to_load_is_a_4xx_in_one_line_and_leaves_nothing(
        tmp_path: Path) -> None:
    # Once, a NUL in a key made loading fail inside SQLite: a 500, and the file stayed in
    # uploads/ although nothing was loaded.
    db = results_db(tmp_path)
    record = make_record("nul", "s2", CASE, "2026-01-02T10:00:00+00:00")
    record["results"]["a\u0000b"] = 1.0
    _, (answer,) = post(db, [("nul.json", json.dumps(record).encode())], {"id": "root"})
    assert 400 <= answer.status_code < 500
    assert answer.json()["outcome"] == "refused"
    assert "\n" not in answer.json()["reason"]
    assert run_ids(db) == {"existing"}
    assert not list((tmp_path / upload.UPLOADS).glob("*"))


@pytest.mark.parametrize("key", ["\n", "a\r\nb", "x" * 500])
def test_an_unknown_key_is_named_on_one_line(tmp_path: Path, key: str) -> None:
    """A key the record does not have is quoted, escaped and cut in the one line that refuses
    it (a newline key once broke the line in two)."""
    db = results_db(tmp_path)
    record = make_record("gen", "s2", CASE, "2026-01-02T10:00:00+00:00")
    record[key] = None
    _, (answer,) = post(db, [("key.json", json.dumps(record).encode())], {"id": "root"})
    reason = answer.json()["reason"]
    assert 400 <= answer.status_code < 500 and "\n" not in reason and "\r" not in reason
    assert "Extra inputs are not permitted" in reason and len(reason) < 300


def _record_like() -> st.SearchStrategy[bytes]:
    """A good record with a key or value replaced by generated JSON (NUL and odd unicode
    included), or bytes that are hardly JSON at all."""
    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
               | st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                          max_leaves=8)

    def altered(where: str, key: str, value: Any) -> bytes:
        record = make_record("gen", "s2", CASE, "2026-01-02T10:00:00+00:00")
        target = record if where == "top" else record[where]
        target[key] = value
        return json.dumps(record).encode()

    return (st.builds(altered, st.sampled_from(["top", "results", "config", "runtime",
                                                "system"]),
                      st.text(max_size=12) | st.sampled_from(["run_id", "a\x00b", "results"]),
                      values)
            | st.binary(max_size=300))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(bodies=st.lists(_record_like(), min_size=1, max_size=3))
def test_any_upload_body_gets_a_4xx_or_loads_and_leaves_only_what_loaded(
        tmp_path_factory: pytest.TempPathFactory, bodies: list[bytes]) -> None:
    folder = tmp_path_factory.mktemp("bodies")
    db = results_db(folder)
    _, answers = post(db, [(f"f{n}.json", body) for n, body in enumerate(bodies)],
                      {"id": "root"})
    loaded = set()
    for answer in answers:
        assert answer.status_code < 500, answer.text[:300]
        outcome = answer.json()
        assert outcome["reason"] and "\n" not in outcome["reason"]
        if outcome["outcome"] in ("loaded", "updated"):
            loaded.add(outcome["run_id"])
    # uploads/ keeps the files of what was loaded, and nothing else.
    kept = {p.name for p in (folder / upload.UPLOADS).glob("*")}
    assert kept == {upload.stored_name(run_id) for run_id in loaded}
    assert run_ids(db) == {"existing"} | loaded


def test_an_upload_over_the_limit_is_not_read_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: Datasette's post_body read the whole body first (a 400 MB chunked POST took the
    # server from 83 MB to 864 MB) and only then said it was over the limit.
    monkeypatch.setattr("pytest_profllm.browse.upload_views.MAX_UPLOAD_BYTES", 1 << 20)
    db = results_db(tmp_path)
    chunk, sent = b"x" * 65536, [0]

    async def body() -> Any:  # chunked: no Content-Length; 64 MiB if read to its end
        for _ in range(1024):
            sent[0] += 1
            yield chunk

    async def run() -> httpx.Response:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        cookies = {"ds_actor": datasette.sign({"a": {"id": "root"}}, "actor")}
        page = await datasette.client.get("/results/-/upload", cookies=cookies)
        token = page.cookies.get("ds_csrftoken") or ""
        response: httpx.Response = await datasette.client.post(
            "/results/-/upload", content=body(),
            headers={"x-csrftoken": token, "x-profllm-filename": "big.json"},
            cookies={**cookies, "ds_csrftoken": token})
        return response

    answer = asyncio.run(run())
    assert answer.status_code == 413
    assert answer.json()["outcome"] == "refused" and "1 MiB" in answer.json()["reason"]
    assert sent[0] <= 17  # the 17th chunk passes 1 MiB: none after it was read
    assert run_ids(db) == {"existing"}
