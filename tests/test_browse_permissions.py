"""Every page of the plugin asks Datasette for the permissions Datasette's own pages ask: a
database private to root by Datasette's own `allow` block answers 403 to anyone else on every
route the plugin registers, uploads included; root gets through. The routes are listed
from the plugin's own `register_routes`, so a new route cannot escape."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
from datasette.app import Datasette
from test_datasette import make_record

from pytest_profllm.browse import plugin
from pytest_profllm.results.ingest import ingest

CASE = "bench_smoke.yaml::qwen3-8b::random"
PRIVATE = {
    "databases": {"results": {"allow": {"id": "root"}}},
    # alice may write (upload, presets) by the plugin's own rule, but not see the database.
    "plugins": {"pytest-profllm": {"upload": {"allow": {"id": ["alice"]}}}},
}
# A value for each URL part a route of ours names: a route with a part missing here fails
# the test, so that a new route is walked too.
SAMPLES = {"database": "results", "run_id": "r1", "file": "r1.json", "dashboard": "load",
           "page": "run", "rest": "r1/more"}
SECRET = "a-case-only-the-database-knows"


def results_db(folder: Path) -> Path:
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["case_id"] = SECRET
    (folder / "r1.json").write_text(json.dumps(record))
    db = folder / "results.db"
    ingest(db, [folder / "r1.json"])
    return db


def paths() -> list[str]:
    """One concrete path per route the plugin registers."""
    found = []
    for pattern, _ in plugin.register_routes():
        names = re.findall(r"\(\?P<(\w+)>", pattern)
        assert set(names) <= set(SAMPLES), f"no sample value for {names} of {pattern}"
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: SAMPLES[m.group(1)], pattern)
        found.append(path.removeprefix("^").removesuffix("$"))
    return found


def walk(db: Path, actor: dict[str, Any] | None, metadata: dict[str, Any]
         ) -> dict[tuple[str, str], httpx.Response]:
    """GET and POST (with a valid CSRF token and a record as body) on every route."""

    async def run() -> dict[tuple[str, str], httpx.Response]:
        datasette = Datasette([str(db)], metadata=metadata)
        await datasette.invoke_startup()
        root = {"ds_actor": datasette.sign({"a": {"id": "root"}}, "actor")}
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        form = await datasette.client.get("/results/-/upload", cookies=root)
        token = form.cookies.get("ds_csrftoken") or ""
        body = json.dumps(make_record("posted", "s2", CASE, "2026-01-02T10:00:00+00:00"))
        answers = {}
        for path in paths():
            answers[("GET", path)] = await datasette.client.get(path, cookies=cookies)
            answers[("POST", path)] = await datasette.client.post(
                path, content=body.encode(),
                headers={"x-csrftoken": token, "x-profllm-filename": "posted.json"},
                cookies={**cookies, "ds_csrftoken": token})
        answers[("GET", "/results/benchmark_runs")] = await datasette.client.get(
            "/results/benchmark_runs", cookies=cookies)
        return answers

    return asyncio.run(run())


def test_the_plugin_registers_the_routes_walked() -> None:
    # The walk below covers these; a route added to a module's ROUTES shows here too.
    assert len(paths()) == len(plugin.register_routes()) >= 9
    assert "/results/-/upload" in paths() and "/api/export/traces/r1" in paths()


def test_a_private_database_is_private_on_every_page(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    for actor in (None, {"id": "alice"}, {"id": "bob"}):
        answers = walk(db, actor, PRIVATE)
        # Datasette's own page refuses, and so does every page of ours, GET and POST.
        assert {key: r.status_code for key, r in answers.items()} == dict.fromkeys(
            answers, 403), actor
        for response in answers.values():
            assert SECRET not in response.text and b"SQLite format" not in response.content
    # Nothing was uploaded by those who may not see the database.
    assert not (tmp_path / "uploads").exists()


def test_root_gets_through_every_page(tmp_path: Path) -> None:
    db = results_db(tmp_path)
    answers = walk(db, {"id": "root"}, PRIVATE)
    statuses = {key: r.status_code for key, r in answers.items()}
    assert all(status not in (401, 403) and status < 500 for status in statuses.values()), \
        statuses
    assert statuses[("GET", "/results/-/run/r1")] == 200
    assert SECRET in answers[("GET", "/results/-/run/r1")].text
    assert statuses[("GET", "/results/-/dashboards/load")] == 200
    assert answers[("POST", "/results/-/upload")].json()["outcome"] == "loaded"


def test_a_table_of_ours_hidden_hides_the_pages_that_show_it(tmp_path: Path) -> None:
    # The database is public, but one table the run page draws from is root's: as with
    # Datasette's own pages, the visitor sees none of it.
    db = results_db(tmp_path)
    hidden = {"databases": {"results": {"tables": {"request_samples": {
        "allow": {"id": "root"}}}}}}
    answers = walk(db, None, hidden)
    assert answers[("GET", "/results/-/run/r1")].status_code == 403
    assert answers[("GET", "/results/benchmark_runs")].status_code == 200
    assert walk(db, {"id": "root"}, hidden)[("GET", "/results/-/run/r1")].status_code == 200
