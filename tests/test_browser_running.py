"""The "Running now" page in a real browser: drawn from the JSON it carries, then
refreshed in place from its JSON route as the live files change, without a reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_browse_permissions import results_db
from test_browser import CHROMIUM, Browser, wait_for
from test_browser import browser as browser  # the fixture
from test_running_page import CASE, datasette_serve

from pytest_profllm.browse import running_page
from pytest_profllm.load import live_status

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium"),
]


def write_status(folder: Path, points: int, done: int) -> None:
    """One worker's live file, as live_status writes it (whole, by rename)."""
    status = {"case": CASE, "worker": "gw0", "stage": "loading", "history": ["loading"],
              "total": 40, "done": done, "failed": 0, "series_started": 0.0,
              "series": [{"t_s": 0.5 * i, "output_throughput": 100.0 + i,
                          "kv_cache_usage": 0.1, "running": 2.0, "waiting": 0.0}
                         for i in range(points)]}
    partial = folder / "1.part"
    partial.write_text(json.dumps({"pid": 1, "cases": [status]}))
    partial.replace(folder / "1.json")


def test_the_page_refreshes_its_table_and_charts_in_place(tmp_path: Path,
                                                           browser: Browser) -> None:
    db = results_db(tmp_path)
    folder = tmp_path / live_status.LIVE_FOLDER
    folder.mkdir()
    write_status(folder, points=2, done=3)
    with datasette_serve(db) as url:
        browser.open(url + "/results/-/running")
        for chart_id, *_ in running_page.CHARTS:
            drawn = f"document.getElementById('{chart_id}').getAttribute('data-drawn')"
            wait_for(lambda drawn=drawn: browser.evaluate(drawn) == "1", f"{chart_id} drawn")
        assert "3 / 40" in browser.evaluate("document.body.innerText")
        browser.evaluate("window.profllmSamePage = true")
        write_status(folder, points=5, done=17)
        # throughput, KV cache and two queue series: four rows a point.
        wait_for(lambda: browser.evaluate(
            "document.getElementById('profllm-running').getAttribute('data-points')") == "20",
            "the refreshed points")
        assert "17 / 40" in browser.evaluate("document.body.innerText")
        assert browser.evaluate("window.profllmSamePage") is True  # no reload
