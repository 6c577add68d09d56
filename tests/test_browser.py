"""In a real browser (Debian's Chromium, headless): the landing page opens, a facet filters it,
and the CSV export downloads every row (the dashboards: tests/test_browser_dashboards.py).

Chromium is driven over its DevTools protocol with websocket-client: no browser download, no
driver binary. Set PROFLLM_SCREENSHOT_DIR to keep a screenshot of the landing page. Skipped,
in one line, where Chromium is not installed.
"""

from __future__ import annotations

import base64
import csv
import io
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_datasette import make_record

from pytest_profllm.results.store import load_records

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="needs Chromium: apt-get install -y chromium (.ci/run installs it)",
    ),
]
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1400,1000")
WAIT_S = 60.0
NAVIGATION_RETRIES = 20


def sweep_records() -> list[dict[str, Any]]:
    """Two sessions of a sweep: two configurations x three rates, and a concurrency sweep."""
    records = []
    for session, day in (("s1", "01"), ("s2", "02")):
        for index, (seqs, load) in enumerate(itertools.product(
            (8, 16), (("rate", 2.0), ("rate", 4.0), ("rate", 8.0), ("concurrency", 4),
                      ("concurrency", 16)))):
            kind, value = load
            case = f"bench_sweep.yaml::seqs{seqs}::{kind}-{value}"
            record = make_record(
                f"{session}-{index:02d}", session, case,
                f"2026-01-{day}T10:{index:02d}:00+00:00",
                "passed" if index % 7 else "failed",
                throughput=float(value) * seqs / 10 + (1 if session == "s2" else 0),
                max_num_seqs=seqs, request_rate=value if kind == "rate" else "inf",
                p99_ttft=10.0 * value,
            )
            if kind == "concurrency":
                record["config"]["benchmark"]["max_concurrency"] = value
            records.append(record)
    return records


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for(check: Any, what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def datasette_url(tmp_path: Path) -> Iterator[str]:
    db_path = tmp_path / "results.db"
    load_records(db_path, sweep_records())
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "datasette", "serve", str(db_path), "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(base + "/-/versions.json", timeout=2)
            return True
        except OSError:
            return False

    try:
        wait_for(up, "datasette to answer")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Browser:
    """The few DevTools protocol calls the test needs, over one websocket.

    Hand-written because the maintained drivers either download a browser of their own
    (Playwright, pyppeteer) or need a driver binary beside Chromium (Selenium)."""

    def __init__(self, process: subprocess.Popen[str], socket_url: str) -> None:
        import websocket

        self.process = process
        self.socket = websocket.create_connection(socket_url, timeout=WAIT_S,
                                                  suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        # A page that navigates while the expression runs drops its execution context and
        # Chromium answers "Inspected target navigated or closed": ask the new page again.
        for attempt in range(NAVIGATION_RETRIES):
            try:
                result = self.call("Runtime.evaluate", expression=expression,
                                   returnByValue=True, awaitPromise=True)
                break
            except AssertionError as error:
                if "navigated or closed" not in str(error) or attempt == NAVIGATION_RETRIES - 1:
                    raise
                time.sleep(0.2)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        wait_for(lambda: self.evaluate("document.readyState") == "complete"
                 and self.evaluate("location.href") != "about:blank", f"{url} to load")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    assert CHROMIUM is not None
    process = subprocess.Popen(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
         "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert process.stderr is not None
        lines = iter(process.stderr.readline, "")
        listening = next((line for line in lines if "DevTools listening on" in line), "")
        assert listening, "chromium did not open its DevTools port"
        browser_url = listening.split("listening on ", 1)[1].strip()
        http = browser_url.replace("ws://", "http://").split("/devtools/")[0]
        with urllib.request.urlopen(http + "/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        driver = Browser(process, page["webSocketDebuggerUrl"])
        try:
            yield driver
        finally:
            driver.socket.close()
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def test_landing_facet_and_csv_in_a_browser(
    browser: Browser, datasette_url: str, tmp_path: Path
) -> None:
    keep = os.environ.get("PROFLLM_SCREENSHOT_DIR")
    shots = Path(keep) if keep else tmp_path
    records = sweep_records()

    # The root opens on the landing view: rows, a handful of columns, the default facets.
    browser.open(datasette_url + "/")
    assert browser.evaluate("location.pathname") == "/results/runs"
    wait_for(lambda: browser.evaluate(
        "document.querySelectorAll('table.rows-and-columns tbody tr').length") == 20,
        "the landing view's rows")
    columns = browser.evaluate("document.querySelectorAll('table.rows-and-columns th').length")
    assert 15 <= columns <= 32
    facets = browser.evaluate(
        "[...document.querySelectorAll('.facet-info')].map(f => f.dataset.column)")
    # The verdicts and the axes; never a column that holds one value in every row (here the
    # engine and the device).
    assert {"gate", "status", "server_max_num_seqs", "bench_request_rate"} <= set(facets)
    assert not {"engine", "device"} & set(facets)
    browser.evaluate("window.scrollTo(0, document.querySelector('.facet-info').offsetTop - 250)")
    browser.screenshot(shots / "landing.png")

    # Apply a facet: status = failed.
    browser.evaluate("""[...document.querySelectorAll('#facet-status a')]
        .find(a => a.textContent.trim() === 'failed').click()""")
    wait_for(lambda: "status=failed" in browser.evaluate("location.search")
             and browser.evaluate("document.readyState") == "complete", "the facet's page")
    failed = sum(record["status"] == "failed" for record in records)
    assert browser.evaluate(
        "document.querySelectorAll('table.rows-and-columns tbody tr').length") == failed
    browser.open(datasette_url + "/results/runs")

    # The CSV link downloads every row.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.call("Browser.setDownloadBehavior", behavior="allow",
                 downloadPath=str(downloads))
    browser.open(datasette_url + "/results/runs")
    href = browser.evaluate(
        "document.querySelector('.export-links a[href*=\".csv\"]').href")
    browser.call("Page.navigate", url=href + "&_dl=1")
    done = wait_for(lambda: [p for p in downloads.iterdir() if p.suffix == ".csv"],
                    "the CSV download")
    rows = list(csv.reader(io.StringIO(done[0].read_text())))
    assert rows[0][:3] == ["run_id", "status", "gate"]
    assert sorted(row[0] for row in rows[1:]) == sorted(r["run_id"] for r in records)
