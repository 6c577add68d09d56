"""The three questions people open the results with, answered from `/` in at most two clicks
each, in a real browser (Debian's Chromium, headless), on three databases:
- the README's example run (the example suites on the simulated engine, one session);
- a mixed one: two suites run twice on the virtual clock, the second session slowed, gated
  against the first;
- a generated one of 100,000 records (tests/generated_results.py).

The questions: which configuration is best under a p99 TTFT bound (the Pareto dashboard and
its table), what regressed against the last session and by how much (the latest-session
dashboard), and how throughput scaled with load per configuration (the load dashboard).
Every page visited is screenshotted (PROFLLM_SCREENSHOT_DIR keeps them; README's come from
here)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from generated_results import generate
from helpers import pytest_argv
from test_browser import CHROMIUM, Browser, browser, free_port, wait_for

from conftest import ExampleRun, shared_ports
from pytest_profllm.browse import dashboards

__all__ = ["browser"]  # the fixture, used by name

REPO = Path(__file__).resolve().parent.parent
MIXED_SUITES = Path(__file__).parent / "data" / "mixed_suites"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="needs Chromium: apt-get install -y chromium (.ci/run installs it)",
    ),
]
LARGE = 100_000


def _run(ports: str, out: Path, *args: str, env: dict[str, str] | None = None) -> None:
    # One process: its ten cases take a second on the virtual clock, two xdist workers
    # took ten more to start.
    argv = pytest_argv(ports, *args, "-n", "0", "-q", out=str(out), cache=False)
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert (out / "results.db").exists(), done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory, worker_id: str,
              test_pool_dir: Path, example_run: ExampleRun) -> dict[str, Path]:
    ports = shared_ports("browser_dashboards", worker_id)
    root = tmp_path_factory.mktemp("databases")
    # README's main job, run once for the test session (conftest.py): a copy, since the
    # pages may write beside it.
    example = root / "example"
    shutil.copytree(example_run.results, example, ignore=shutil.ignore_patterns("logs"))
    suites = root / "suites"
    suites.mkdir()
    for suite in MIXED_SUITES.glob("*.yaml"):
        shutil.copy(suite, suites / f"bench_{suite.name}")
    # On the virtual clock: the pages are under test, not the real-time client (which the
    # example run has), and a slowed engine regresses there as deterministically.
    mixed, baseline = root / "mixed", root / "baseline"
    _run(ports, mixed, str(suites), f"--profllm-baseline={baseline}",
         "--profllm-baseline-update", "--profllm-sim-clock=virtual")
    # The second session is slowed: the gate calls its latencies regressed (the run fails).
    _run(ports, mixed, str(suites), f"--profllm-baseline={baseline}",
         "--profllm-sim-clock=virtual", env={"PROFLLM_SIM_SLOWDOWN": "1.5"})
    large = root / "large"
    large.mkdir()
    assert generate(large / "results.db", LARGE) == LARGE
    return {"example": example / "results.db", "mixed": mixed / "results.db",
            "large": large / "results.db"}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """Starts `datasette serve DB` (with `--root`: returns also the URL that logs in as root)."""
    processes: list[subprocess.Popen[str]] = []

    def start(db: Path, root: bool = False) -> str | tuple[str, str]:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "datasette", "serve", str(db), "--host", "127.0.0.1",
             "--port", str(port), *(["--root"] if root else [])],
            stdout=subprocess.PIPE if root else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, text=True)
        processes.append(process)
        base = f"http://127.0.0.1:{port}"
        login = ""
        if root:
            assert process.stdout is not None
            login = next(line.strip() for line in process.stdout if "/-/auth-token" in line)

        def up() -> bool:
            try:
                urllib.request.urlopen(base + "/-/versions.json", timeout=2)
                return True
            except OSError:
                return False

        wait_for(up, "datasette to answer")
        return (base, login) if root else base

    yield start
    for process in processes:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Visit:
    """Navigation from `/` by clicks on links and buttons only, counted."""

    def __init__(self, browser: Browser, base: str, shots: Path, name: str) -> None:
        self.browser, self.base, self.shots, self.name = browser, base, shots, name
        self.clicks = 0

    def home(self) -> None:
        self.clicks = 0
        self.browser.open(self.base + "/")

    def click(self, selector_js: str, what: str) -> None:
        before = self.browser.evaluate("location.href")
        self.browser.evaluate(f"({selector_js}).click()")
        self.clicks += 1
        wait_for(lambda: self.browser.evaluate("location.href") != before
                 and self.browser.evaluate("document.readyState") == "complete", what)

    def charts_drawn(self) -> int:
        """Waits until every chart of the page has drawn; returns how many there are."""
        count = self.browser.evaluate("document.querySelectorAll('.profllm-chart').length")
        wait_for(lambda: self.browser.evaluate(
            "document.querySelectorAll('.profllm-chart[data-drawn]').length") == count
            or self.browser.evaluate("document.querySelector('.profllm-chart[data-error]')"
                                     " && document.querySelector('.profllm-chart[data-error]')"
                                     ".dataset.error"),
            "the charts to draw")
        errors = self.browser.evaluate(
            "[...document.querySelectorAll('.profllm-chart[data-error]')]"
            ".map(e => e.dataset.error)")
        assert errors == [], errors
        return int(count)

    def shoot(self, page: str) -> None:
        height = self.browser.evaluate("document.documentElement.scrollHeight")
        self.browser.call("Emulation.setDeviceMetricsOverride", width=1400,
                          height=min(int(height), 4000), deviceScaleFactor=1, mobile=False)
        self.browser.screenshot(self.shots / f"{self.name}-{page}.png")
        self.browser.call("Emulation.clearDeviceMetricsOverride")

    def dashboard(self, name: str) -> None:
        """One click from the landing page: its dashboard links."""
        self.home()
        assert self.browser.evaluate("location.pathname").endswith("/runs")
        self.click(f"document.querySelector('.profllm-dashboard-links "
                   f"a[href$=\"/-/dashboards/{name}\"]')", f"the {name} dashboard")


@pytest.mark.parametrize("which", ["example", "mixed", "large"])
def test_three_questions_in_two_clicks(
    which: str, databases: dict[str, Path], serve: object, browser: Browser, tmp_path: Path
) -> None:
    keep = os.environ.get("PROFLLM_SCREENSHOT_DIR")
    shots = Path(keep) if keep else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    db = databases[which]
    base = serve(db)  # type: ignore[operator]
    visit = Visit(browser, base, shots, which)

    visit.home()
    wait_for(lambda: browser.evaluate(
        "document.querySelectorAll('table.rows-and-columns tbody tr').length") > 0,
        "the landing page's rows")
    visit.shoot("landing")

    # A run's page: one click on a run id of the landing table.
    visit.click("document.querySelector('table.rows-and-columns tbody td.col-run_id a')",
                "a run's page")
    assert "/-/run/" in browser.evaluate("location.pathname")
    assert visit.charts_drawn() >= 1 or which == "large"
    visit.shoot("run")

    # For the slowest-TTFT case, its TTFT distribution and its KV cache and queue over the
    # run: two clicks, the landing table's "slowest p99 TTFT" order, then its first run id.
    visit.home()
    slowest_first = "a[href$=\"_sort_desc=p99_ttft_ms\"]"
    visit.click(f"document.querySelector('.profllm-order-links {slowest_first}')",
                "the landing table, slowest p99 TTFT first")
    visit.click("document.querySelector('table.rows-and-columns tbody td.col-run_id a')",
                "the slowest run's page")
    assert visit.clicks == 2
    with sqlite3.connect(db) as connection:
        slowest = connection.execute(
            "SELECT run_id FROM runs WHERE validity = 'valid' ORDER BY p99_ttft_ms DESC "
            "LIMIT 1").fetchone()[0]
    shown = urllib.parse.unquote(browser.evaluate("location.pathname"))
    assert shown.endswith(f"/-/run/{slowest}"), (shown, slowest)
    visit.shoot("slowest-run")

    # How did throughput scale with load, per configuration? One click.
    visit.dashboard("load")
    assert visit.clicks == 1
    assert visit.charts_drawn() >= 4
    legends = browser.evaluate(
        "[...document.querySelectorAll('.profllm-chart .role-legend-label text')]"
        ".map(t => t.textContent)")
    assert legends, "the load charts have a legend of configurations"
    assert not any(label.endswith(("…", "...")) for label in legends), legends
    marks = browser.evaluate(
        "document.querySelectorAll('.profllm-chart .mark-symbol path').length")
    assert marks >= 4
    visit.shoot("load")

    # Which configuration is best under a p99 TTFT bound? Two clicks: the dashboard, then
    # the bound, set and shown.
    visit.dashboard("pareto")
    with sqlite3.connect(db) as connection:
        bound = _bound(connection)
        # A chart (and frontier) per model and device that measured output tokens.
        facets = connection.execute(
            "SELECT count(DISTINCT server_model || '|' || device) FROM measured_runs "
            "WHERE output_throughput IS NOT NULL").fetchone()[0]
    assert visit.charts_drawn() == facets
    browser.evaluate(
        f"document.querySelector('.profllm-inputs input[name=max_p99_ttft_ms]').value = "
        f"'{bound:.3f}'")
    visit.click("document.querySelector('.profllm-inputs input[type=submit]')",
                "the bound's page")
    assert visit.clicks == 2
    visit.charts_drawn()
    table = browser.evaluate("""(() => {
        const heading = [...document.querySelectorAll('h2')]
            .find(h => h.textContent.startsWith('Best configurations under'));
        const table = heading && heading.nextElementSibling.querySelector('table');
        if (!table) return null;
        const head = [...table.querySelectorAll('th')].map(th => th.textContent);
        return [...table.querySelectorAll('tbody tr')].map(tr => Object.fromEntries(
            [...tr.querySelectorAll('td')].map((td, i) => [head[i], td.textContent.trim()])));
    })()""")
    assert table, "a table of the configurations that meet the bound"
    typed = round(bound, 3)  # the table rounds to 3 decimals too
    assert all(float(row["p99_ttft_ms"]) <= typed + 0.0005 for row in table)
    per_gpu = [float(row["output_tok_per_s_per_gpu"]) for row in table]
    assert per_gpu == sorted(per_gpu, reverse=True)
    visit.shoot("pareto")

    # What regressed against the last session, and by how much? One click.
    visit.dashboard("latest")
    assert visit.clicks == 1
    visit.charts_drawn()
    regressed = browser.evaluate("""(() => {
        const heading = [...document.querySelectorAll('h2')]
            .find(h => h.textContent.startsWith('Regressed'));
        return [...heading.nextElementSibling.querySelectorAll('tbody tr')]
            .map(tr => tr.textContent);
    })()""")
    with sqlite3.connect(db) as connection:
        latest = connection.execute(
            "SELECT session_id FROM benchmark_runs ORDER BY timestamp DESC LIMIT 1").fetchone()[0]
        expected = connection.execute(
            "SELECT count(*) FROM regression_verdicts v JOIN measured_runs r USING (run_id) "
            "WHERE r.session_id = ? AND v.verdict = 'regressed'", (latest,)).fetchone()[0] if (
            connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'regression_verdicts'")
            .fetchone()) else 0
    assert len(regressed) == expected
    if which != "example":
        assert expected > 0, "the slowed session regressed"
        red = browser.evaluate(
            "[...document.querySelectorAll('.profllm-chart .mark-rect path')]"
            ".filter(p => (p.getAttribute('fill') || '').toLowerCase() === '#c62828').length")
        assert red > 0, "regressed bars are drawn in red"
    visit.shoot("latest")

    # The other dashboards draw too.
    for other in dashboards.DASHBOARDS:
        if other.name in ("load", "pareto", "latest"):
            continue
        visit.dashboard(other.name)
        drawn = visit.charts_drawn()
        if other.name == "capacity" and which == "example":
            # The example's capacity suite: a bar per configuration.
            assert drawn == 1
            bars = browser.evaluate(
                "document.querySelectorAll('.profllm-chart .mark-rect path').length")
            assert bars == 2
        visit.shoot(other.name)


def _bound(connection: sqlite3.Connection) -> float:
    """A p99 TTFT bound that some valid runs meet and others miss: their median."""
    values = sorted(row[0] for row in connection.execute(
        "SELECT p99_ttft_ms FROM measured_runs WHERE p99_ttft_ms IS NOT NULL"))
    return float(values[len(values) // 2])


def test_screenshots_are_kept_where_asked() -> None:
    """The manual's pictures come from PROFLLM_SCREENSHOT_DIR runs of the test above."""
    page = (REPO / "docs" / "results.md").read_text()
    for picture in ("dashboard-load.png", "pareto.png"):
        assert f"]({picture})" in page and (REPO / "docs" / picture).exists(), picture
    assert shutil.which("chromium") or shutil.which("chromium-browser")


def test_upload_a_batch_as_root(databases: dict[str, Path], serve: object, browser: Browser,
                                tmp_path: Path) -> None:
    """Logged in as root, three files dropped on the upload page: a new record, a malformed
    file and the same record again, each with its outcome and the batch's count."""
    keep = os.environ.get("PROFLLM_SCREENSHOT_DIR")
    shots = Path(keep) if keep else tmp_path
    db = tmp_path / "served" / "results.db"
    db.parent.mkdir()
    shutil.copy(databases["mixed"], db)
    new = next(p for p in databases["example"].parent.glob("*.json"))
    bad = tmp_path / "broken.json"
    bad.write_text('{"run_id": "half a record"')
    again = tmp_path / "again.json"
    again.write_bytes(new.read_bytes())
    base, login = serve(db, root=True)  # type: ignore[operator]
    browser.open(login)
    browser.open(base + "/results/-/upload")
    assert browser.evaluate("document.getElementById('profllm-drop') !== null")
    document = browser.call("DOM.getDocument")["root"]["nodeId"]
    node = browser.call("DOM.querySelector", nodeId=document, selector="#profllm-files")
    browser.call("DOM.setFileInputFiles", nodeId=node["nodeId"],
                 files=[str(new), str(bad), str(again)])
    wait_for(lambda: browser.evaluate(
        "document.getElementById('profllm-batch').dataset.done") == "true", "the batch")
    outcomes = browser.evaluate(
        "[...document.querySelectorAll('#profllm-results tbody tr')]"
        ".map(tr => [tr.children[0].textContent, tr.children[2].textContent])")
    assert outcomes == [[new.name, "loaded"], ["broken.json", "refused"],
                        ["again.json", "duplicate"]]
    browser.screenshot(shots / "upload.png")
    with sqlite3.connect(db) as connection:
        run_id = json.loads(new.read_text())["run_id"]
        assert connection.execute("SELECT count(*) FROM runs WHERE run_id = ?",
                                  (run_id,)).fetchone() == (1,)


def _two_sessions(folder: Path) -> Path:
    """Two sessions of the same two cases, the second faster: s1-a, s1-b, then s2-a, s2-b."""
    from test_datasette import CASE_A, CASE_B, make_record

    from pytest_profllm.results.store import load_records

    db = folder / "results.db"
    load_records(db, [
        make_record("s1-a", "s1", CASE_A, "2026-01-01T10:00:00+00:00", throughput=11.0),
        make_record("s1-b", "s1", CASE_B, "2026-01-01T10:05:00+00:00", throughput=12.0),
        make_record("s2-a", "s2", CASE_A, "2026-01-02T10:00:00+00:00", throughput=21.0),
        make_record("s2-b", "s2", CASE_B, "2026-01-02T10:05:00+00:00", throughput=22.0),
    ])
    return db


def test_compare_two_ticked_runs_and_their_sessions(serve: object, browser: Browser,
                                                     tmp_path: Path) -> None:
    """On the landing table, two runs ticked (newest first, as listed): one click opens
    compare_runs with the older as A, another compare_sessions; figures with units."""
    keep = os.environ.get("PROFLLM_SCREENSHOT_DIR")
    shots = Path(keep) if keep else tmp_path
    db = _two_sessions(tmp_path)
    base = serve(db)  # type: ignore[operator]
    tick = ("[...document.querySelectorAll('input.profllm-compare-box')]"
            ".filter(b => ['s2-a', 's1-a'].includes(b.dataset.run)).forEach(b => b.click())")
    browser.open(base + "/")
    wait_for(lambda: browser.evaluate(
        "document.querySelectorAll('input.profllm-compare-box').length") == 4, "the boxes")
    assert browser.evaluate("document.getElementById('profllm-compare-runs').href") == ""
    browser.evaluate(tick)
    browser.screenshot(shots / "compare-landing-ticked.png")
    browser.evaluate("document.getElementById('profllm-compare-runs').click()")
    wait_for(lambda: "/results/compare_runs?" in browser.evaluate("location.href")
             and browser.evaluate("document.readyState") == "complete", "compare_runs")
    assert browser.evaluate("location.search") == "?run_a=s1-a&run_b=s2-a"
    rows = browser.evaluate(
        "[...document.querySelectorAll('table.rows-and-columns tbody tr')]"
        ".map(tr => [...tr.children].map(td => td.textContent.trim()))")
    assert ["output_throughput", "110.0 tok/s", "210.0 tok/s", "+100.0 tok/s (+90.9%)"] in [
        row[:4] for row in rows]
    browser.screenshot(shots / "compare-runs.png")
    browser.open(base + "/")
    wait_for(lambda: browser.evaluate(
        "document.querySelectorAll('input.profllm-compare-box').length") == 4, "the boxes")
    browser.evaluate(tick)
    browser.evaluate("document.getElementById('profllm-compare-sessions').click()")
    wait_for(lambda: "/results/compare_sessions?" in browser.evaluate("location.href")
             and browser.evaluate("document.readyState") == "complete", "compare_sessions")
    assert browser.evaluate("location.search") == "?session_a=s1&session_b=s2"
    assert browser.evaluate(
        "document.querySelectorAll('table.rows-and-columns tbody tr').length") == 2
    browser.screenshot(shots / "compare-sessions.png")


def test_two_runs_ticked_on_different_pages_compare(serve: object, browser: Browser,
                                                     tmp_path: Path) -> None:
    """A tick survives paging: one run ticked on the first page of the landing table, one on
    the second, and the compare link holds both (before, ticks lived on one page only)."""
    db = _two_sessions(tmp_path)
    base = serve(db)  # type: ignore[operator]

    def tick(run_id: str) -> None:
        wait_for(lambda: browser.evaluate(
            "document.querySelectorAll('input.profllm-compare-box').length") == 2, "the boxes")
        browser.evaluate("[...document.querySelectorAll('input.profllm-compare-box')]"
                         f".filter(b => b.dataset.run === '{run_id}').forEach(b => b.click())")

    browser.open(base + "/results/runs?_size=2")  # newest first: s2-b, s2-a | s1-b, s1-a
    tick("s2-a")
    assert "1 ticked" in browser.evaluate("document.getElementById('profllm-compare').textContent")
    next_page = browser.evaluate("document.querySelector('a[href*=\"_next=\"]').href")
    browser.open(next_page)
    tick("s1-a")
    bar = browser.evaluate("document.getElementById('profllm-compare').textContent")
    assert "2 ticked, 1 on another page" in bar, bar
    keep = os.environ.get("PROFLLM_SCREENSHOT_DIR")
    browser.screenshot((Path(keep) if keep else tmp_path) / "compare-ticked-across-pages.png")
    href = browser.evaluate("document.getElementById('profllm-compare-runs').href")
    assert href.endswith("/results/compare_runs?run_a=s1-a&run_b=s2-a"), href
    browser.evaluate("document.getElementById('profllm-compare-runs').click()")
    wait_for(lambda: "/results/compare_runs?" in browser.evaluate("location.href")
             and browser.evaluate("document.readyState") == "complete", "compare_runs")
    # Following the link clears the ticks: the landing table starts afresh.
    browser.open(base + "/results/runs?_size=2")
    wait_for(lambda: browser.evaluate(
        "document.querySelectorAll('input.profllm-compare-box').length") == 2, "the boxes")
    assert browser.evaluate(
        "document.querySelectorAll('input.profllm-compare-box:checked').length") == 0
