"""The run page (browse/run_page.py, browse/run_views.py): what it shows of a real run on the
simulator, of a run the gate called regressed and of one that errored; databases that predate
its tables; and its downloads, which never leave the results folder."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from datasette.app import Datasette
from datasette.utils import tilde_encode
from helpers import pytest_argv, records, write_suite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasette import make_record

from conftest import shared_ports
from pytest_profllm.browse import run_capacity, run_files, run_page, run_values
from pytest_profllm.results.ingest import ingest
from pytest_profllm.results.store import load_records


def get(db: Path, *urls: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        return [await datasette.client.get(url) for url in urls]

    return asyncio.run(run())


def page_of(db: Path, run_id: str) -> run_page.RunPage:
    with sqlite3.connect(db) as connection:
        page = run_page.run_page(connection, run_id)
    assert page is not None
    return page


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str,
             test_pool_dir: Path) -> Path:
    """A small suite run on the simulator: its results folder."""
    ports = shared_ports("run_page", worker_id)
    folder = tmp_path_factory.mktemp("run")
    write_suite(folder, """\
        server: {model: Qwen/Qwen3-8B, max_num_seqs: 8}
        benchmark: {num_prompts: 24, random_input_len: 128, random_output_len: 32,
                    request_rate: 16}
        thresholds: {completed: {min: 24}}
        """)
    argv = pytest_argv(ports, "-p", "no:cacheprovider", out="results")
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    return folder / "results"


def test_the_page_of_a_real_run(real_run: Path) -> None:
    (record,) = records(real_run)
    page = page_of(real_run / "results.db", record["run_id"])
    results = record["results"]
    shown = {label: value for label, value, _ in page.headlines}
    assert shown["requests completed"] == "24"
    assert shown["output throughput"] == f"{results['output_throughput']:.4g}"
    # The distributions come from the run's own requests: 24 of them per latency, and every
    # inter-token gap.
    for name in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms"):
        bins = page.charts[f"dist-{name}"]["layer"][0]
        counted = sum(b["count"] for b in page.charts[f"dist-{name}"]["data"]["values"])
        assert bins["mark"]["type"] == "bar"
        assert counted == (24 if name != "itl_ms" else 24 * 31), name
    # Telemetry over the run: the server's queues and CPU at least (the simulator has no GPU).
    assert {"series-queues", "series-cpu"} <= set(page.charts)
    assert not any(chart_id.startswith("series-gpu") for chart_id in page.charts)
    # The KV cache's usage names the cache it is a fraction of, as the server said it.
    system = record["system"]
    tokens, blocks = system["server_kv_cache_tokens"], system["server_num_gpu_blocks"]
    assert tokens == 16 * blocks > 0
    assert page.captions["series-kv"] == (
        f"the fraction of KV-cache blocks in use, of a cache of {tokens:,} tokens in "
        f"{blocks:,} blocks of 16 (as the server sized it)")
    # ... on the load's own time axis: the last sample is taken after the load ended, so it
    # lies after every request's end (counted from the first sample, an interval late, it
    # came before the last requests ended).
    with gzip.open(real_run / f"{record['run_id']}.requests.jsonl.gz", "rt") as file:
        ended = max(json.loads(line)["end_s"] for line in file)
    with sqlite3.connect(real_run / "results.db") as connection:
        last = connection.execute("SELECT max(t_s) FROM run_series WHERE run_id = ?",
                                  (record["run_id"],)).fetchone()[0]
    assert last >= ended > 0
    x = page.charts["series-queues"]["encoding"]["x"]
    assert (x["title"], x["scale"]) == ("seconds since the load started", {"zero": True})
    # What differs from vLLM's defaults comes first, and only that.
    assert ("max_num_seqs", "8") in [(name, value) for name, value, _ in page.changed]
    assert all(name != "api_key" for name, _, _ in page.changed)
    # The run's files, from the results folder.
    files = {f.kind: f.name for f in run_files.run_files(real_run, page.row)}
    assert files["record"] == f"{record['run_id']}.json"
    assert files["requests"] == f"{record['run_id']}.requests.jsonl.gz"
    # The log of this run's server in this session, which the record names.
    assert files["log"] == f"logs/{record['runtime']['server_log']}"
    assert files["log"].endswith(f".{record['session_id']}.log")
    (html, download) = get(real_run / "results.db", f"/results/-/run/{record['run_id']}",
                           f"/results/-/run/{record['run_id']}/files/"
                           + tilde_encode(files["record"]))
    assert html.status_code == 200 and "Latency distributions" in html.text
    assert download.status_code == 200
    assert json.loads(download.content)["run_id"] == record["run_id"]


def test_the_page_says_where_the_time_went(real_run: Path) -> None:
    """The client's mean TTFT and E2E split by the server's own histograms: the bars' parts
    add up to the client's means, and the server's view is a table with bucket bounds."""
    (record,) = records(real_run)
    results, server = record["results"], record["system"]
    page = page_of(real_run / "results.db", record["run_id"])
    parts = page.charts["time-breakdown"]["data"]["values"]
    for bar, client in (("mean TTFT", "mean_ttft_ms"), ("mean E2E", "mean_e2el_ms")):
        mine = {part["part"]: part["ms"] for part in parts if part["bar"] == bar}
        assert sum(mine.values()) == pytest.approx(results[client])
        assert mine["server: queue"] == pytest.approx(server["server_queue_mean_ms"])
        assert mine["server: prefill"] == pytest.approx(server["server_prefill_mean_ms"])
    decode = [p["ms"] for p in parts if p["bar"] == "mean E2E" and p["part"] == "server: decode"]
    assert decode == [pytest.approx(server["server_decode_mean_ms"])]
    names = [row["name"] for row in page.server_view]
    assert names[:2] == ["TTFT", "E2E"] and page.server_view_problem is None
    assert page.server_view[0]["count"] == "24"
    (html,) = get(real_run / "results.db", f"/results/-/run/{record['run_id']}")
    assert "Where the time goes" in html.text and 'id="time-breakdown"' in html.text


def test_a_run_without_the_servers_view_says_why(tmp_path: Path) -> None:
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["server_view"] = {"problem": "the server's /metrics did not answer",
                             "histograms": {}}
    page = page_of(ingested(tmp_path, record), "r1")
    assert "time-breakdown" not in page.charts
    assert page.server_view == []
    assert page.server_view_problem == "the server's /metrics did not answer"


def ingested(folder: Path, *records_: dict[str, Any]) -> Path:
    for record in records_:
        (folder / f"{record['run_id']}.json").write_text(json.dumps(record))
    db = folder / "results.db"
    ingest(db, sorted(folder.glob("*.json")))
    return db


CASE = "bench_smoke.yaml::qwen3-8b::random"


def test_a_regressed_run_links_its_baseline_and_an_errored_run_has_a_page(
    tmp_path: Path,
) -> None:
    baseline = make_record("base", "s1", CASE, "2026-01-01T10:00:00+00:00")
    regressed = make_record("now", "s2", CASE, "2026-01-02T10:00:00+00:00", "failed")
    regressed["regression"] = [{
        "metric": "p99_ttft_ms", "verdict": "regressed", "tolerance": 0.1,
        "higher_is_better": False, "baseline": 1.0, "value": 1.5, "change": 0.5,
        "ci_low": 0.4, "ci_high": 0.6, "confidence": 0.99, "baseline_session": "s1"}]
    errored = make_record("err", "s2", "bench_smoke.yaml::qwen3-8b::other",
                          "2026-01-02T10:05:00+00:00", "error")
    errored["results"] = {}
    db = ingested(tmp_path, baseline, regressed, errored)
    page = page_of(db, "now")
    assert [(g["metric"], g["verdict"]) for g in page.gate] == [("p99_ttft_ms", "regressed")]
    assert page.baseline_runs == ["base"]
    now, err, missing = get(db, "/results/-/run/now", "/results/-/run/err",
                            "/results/-/run/nope")
    assert now.status_code == 200
    assert "regressed" in now.text and 'href="/results/-/run/base"' in now.text
    assert err.status_code == 200 and "error" in err.text
    assert missing.status_code == 404


def test_a_database_from_before_the_page_still_opens_it(tmp_path: Path) -> None:
    db = ingested(tmp_path, make_record("old", "s1", CASE, "2026-01-01T10:00:00+00:00"))
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TABLE run_series")
        connection.execute("DROP TABLE request_samples")
        connection.execute("DROP TABLE regression_verdicts")
    page = page_of(db, "old")
    assert not page.charts
    assert any("telemetry" in note for note in page.notes)
    (response,) = get(db, "/results/-/run/old")
    assert response.status_code == 200


def test_downloads_never_leave_the_results_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not yours")
    folder = tmp_path / "results"
    folder.mkdir()
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["runtime"]["server_key"] = "0123456789ab"
    trace_inside = folder / "profiles" / "trace-1.json"
    trace_inside.parent.mkdir()
    trace_inside.write_text("{}")
    record["profiling"] = {
        "profiler": "torch", "trace_dir": str(folder / "profiles"), "num_prompts": 1,
        "duration_s": 1.0, "trace_bytes": 2,
        "traces": [{"path": str(trace_inside), "size_bytes": 2},
                   {"path": str(outside / "secret.txt"), "size_bytes": 9},
                   {"path": "../outside/secret.txt", "size_bytes": 9}],
    }
    (folder / "logs").mkdir()
    # A symbolic link named like the server's log, pointing out of the folder.
    (folder / "logs" / "smoke-x-0123456789ab.log").symlink_to(outside / "secret.txt")
    db = ingested(folder, record)
    page = page_of(db, "r1")
    files = run_files.run_files(folder, page.row)
    assert {(f.kind, f.name) for f in files} == {
        ("record", "r1.json"), ("trace", "profiles/trace-1.json")}
    base = "/results/-/run/r1/files/"
    attempts = ["..~2Foutside~2Fsecret.txt", tilde_encode(str(outside / "secret.txt")),
                "logs~2Fsmoke-x-0123456789ab.log", "~2Fetc~2Fpasswd", "results.db",
                "~2E~2E", "r1.json~2F..~2F..~2Foutside~2Fsecret.txt"]
    responses = get(db, *(base + attempt for attempt in attempts),
                    base + "profiles~2Ftrace-1.json", "/api/export/traces/r1")
    assert [r.status_code for r in responses[:-2]] == [404] * len(attempts)
    assert all(b"not yours" not in r.content for r in responses)
    assert responses[-2].status_code == 200 and responses[-2].content == b"{}"
    assert responses[-1].status_code == 200 and responses[-1].content == b"{}"


def test_a_run_links_its_own_servers_log_of_its_session(tmp_path: Path) -> None:
    # Once, the log link was every `*-{server_key}.log`: another suite's server with the
    # same key, in a file that gathered every session's output.
    folder = tmp_path / "results"
    (folder / "logs").mkdir(parents=True)
    names = ("smoke-qwen-0123456789ab.s1.log", "smoke-qwen-0123456789ab.s2.log",
             "other-qwen-0123456789ab.s1.log", "smoke-qwen-0123456789ab.log",
             "other-qwen-0123456789ab.log")
    for name in names:
        (folder / "logs" / name).write_text(name)
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["runtime"]["server_log"] = "smoke-qwen-0123456789ab.s1.log"
    older = make_record("r0", "s0", CASE, "2025-12-01T10:00:00+00:00")
    db = ingested(folder, record, older)
    logs = [(f.kind, f.name) for f in run_files.run_files(folder, page_of(db, "r1").row)
            if f.kind.startswith("log")]
    assert logs == [("log", "logs/smoke-qwen-0123456789ab.s1.log")]
    # A record from before logs were named by session: its suite's log, said to hold more.
    logs = [(f.kind, f.name) for f in run_files.run_files(folder, page_of(db, "r0").row)
            if f.kind.startswith("log")]
    assert logs == [("log (every session of this server)", "logs/smoke-qwen-0123456789ab.log")]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(max_size=80) | st.sampled_from(
    ["\x00", "../secret.txt", "a.log", "..", "", "a.log\x00x", "./a.log"]))
def test_any_server_log_name_gives_files_inside_logs_or_none(tmp_path: Path, name: str) -> None:
    """A record (an upload, say) names its log: any name gives the run's files, each inside
    the results folder's logs/, never an error."""
    folder = tmp_path / "results"
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    (folder / "logs" / "a.log").write_text("a")
    (folder / "secret.txt").write_text("s")
    row = {"run_id": "r1", "runtime_server_log": name, "runtime_server_key": "0123456789ab",
           "suite": "smoke"}
    for found in run_files.run_files(folder, row):
        assert found.path.is_relative_to((folder / "logs").resolve())
        assert found.path.is_file()


def test_run_ids_with_odd_characters_have_pages(tmp_path: Path) -> None:
    odd = "2026 run/with~odd.chars"
    db = ingested(tmp_path, make_record("plain", "s1", CASE, "2026-01-01T10:00:00+00:00"))
    load_records(db, [make_record(odd, "s1", CASE, "2026-01-01T10:01:00+00:00")])
    (response,) = get(db, "/results/-/run/" + tilde_encode(odd))
    assert response.status_code == 200
    assert "run/with~odd.chars" in response.text


def test_a_record_cannot_name_the_database_as_its_file(tmp_path: Path) -> None:
    # Once, a record naming results.db (or a link to it, or another folder's file) as
    # its trace made the whole database downloadable from the run's page.
    folder = tmp_path / "results"
    (folder / "profiles").mkdir(parents=True)
    (folder / "other").mkdir()
    (folder / "other" / "notes.json").write_text("{}")
    (folder / "profiles" / "db-link.json").symlink_to(folder / "results.db")
    (folder / "profiles" / "trace-1.json").write_text("{}")
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["profiling"] = {
        "profiler": "torch", "trace_dir": str(folder), "num_prompts": 1, "duration_s": 1.0,
        "trace_bytes": 2, "traces": [{"path": path, "size_bytes": 1} for path in (
            "results.db", str(folder / "results.db"), "profiles/../results.db",
            "profiles/db-link.json", "results.db-wal", "other/notes.json",
            "profiles/trace-1.json")]}
    db = ingested(folder, record)
    (folder / "results.db-wal").write_bytes(b"wal")
    files = run_files.run_files(folder, page_of(db, "r1").row)
    assert {(f.kind, f.name) for f in files} == {
        ("record", "r1.json"), ("trace", "profiles/trace-1.json")}
    base = "/results/-/run/r1/files/"
    responses = get(db, "/results/-/run/r1", base + "results.db",
                    base + "profiles~2Fdb-link.json", base + "other~2Fnotes.json")
    # Named in the "Re-run this case" box's command (`--db results.db`), never linked.
    assert responses[0].status_code == 200
    assert not re.search(r'href="[^"]*results\.db', responses[0].text)
    assert [r.status_code for r in responses[1:]] == [404, 404, 404]
    assert all(b"SQLite format" not in r.content for r in responses)


def test_the_recheck_line_says_what_the_recheck_decided() -> None:
    assert run_capacity.recheck_verdict({"decision": "meets", "agrees": True}) == (
        "it met every SLO, so it agrees.")
    unsure = run_capacity.recheck_verdict({"decision": "unsure", "agrees": True,
                               "reason": "median_tpot_ms"})
    assert unsure.startswith("it decided unsure (median_tpot_ms): not a miss")
    assert "agrees" not in unsure
    assert run_capacity.recheck_verdict({"decision": "misses", "agrees": False}).startswith(
        "it missed: the server changed")


def test_the_rerun_command_names_the_database_from_where_pytest_ran() -> None:
    # `datasette results/results.db` where pytest ran with --profllm-out results/: as given.
    assert run_page.rerun_command("r1", Path("results/results.db")) == (
        "profllm rerun r1 --db results/results.db")
    # Served by an absolute path: its output folder and file, never the folders above.
    assert run_page.rerun_command("r1", Path("/srv/ci/project/results/results.db")) == (
        "profllm rerun r1 --db results/results.db")
    assert run_page.rerun_command("r1", Path("../elsewhere/out/results.db")) == (
        "profllm rerun r1 --db out/results.db")


def test_a_figure_is_never_shown_in_exponent_form() -> None:
    # A trace case's total token throughput, 25,470 tok/s, once read "2.547e+04".
    assert run_values.shown(25470.3) == "25,470"
    assert run_values.shown(9999.4) == "9999"
    assert run_values.shown(0.06214) == "0.06214"


@given(st.floats(min_value=1e-4, max_value=1e15) | st.floats(min_value=-1e15, max_value=-1e-4))
def test_any_figure_a_record_holds_reads_without_an_exponent(value: float) -> None:
    assert "e" not in run_values.shown(value)


def test_the_new_parts_read_as_sentences_with_units(tmp_path: Path) -> None:
    """The speculative headlines in percent, the prefix-cache ratio as a percentage of the
    ideal, the `until:` line with the headlines' name of its statistic, the adapters' headers
    with their units: each as the page renders it."""
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00")
    record["system"].update(
        server_spec_decode_acceptance_rate=0.348, server_spec_decode_mean_acceptance_length=2.044,
        server_spec_decode_acceptance_rate_per_position=[0.6213, 0.3171, 0.1052],
        implied_prefix_cache_hit_rate=0.436, server_kv_block_size=16,
        server_prefix_cache_hit_rate=0.436, prefix_cache_hit_rate_vs_implied=1.0,
    )
    record["until"] = {"metric": "p90_ttft_ms", "half_width": 0.1, "confidence": 0.95,
                       "max_prompts": 2000, "stopped_by": "interval", "value": 75.0,
                       "ci_low": 67.79, "ci_high": 82.26, "relative_half_width": 0.098,
                       "rounds": 3, "requests": 300, "samples": 300}
    record["by_adapter"] = [{"model": "sql", "requests": 31, "completed": 31, "failed": 0,
                             "request_throughput": 9.377, "output_throughput": 300.1,
                             "median_ttft_ms": 64.9, "p99_ttft_ms": 141.1,
                             "median_tpot_ms": 8.525, "p99_tpot_ms": 11.36}]
    db = ingested(tmp_path, record)
    page = page_of(db, "r1")
    shown = {label: (value, unit) for label, value, unit in page.headlines}
    assert shown["draft acceptance rate"] == ("34.8", "%")
    assert shown["acceptance rate by draft position (1st · 2nd · ...)"] == ("62 · 32 · 11", "%")
    assert shown["mean acceptance length"] == ("2.044", "tok/draft")
    assert page.prefix_cache is not None
    assert page.prefix_cache.endswith("The server found 43.6%, 100% of the ideal.")
    assert page.until == (
        "Sent until p90 TTFT was known to ±10.0%: 95% interval 67.79 .. 82.26 ms (±9.8%); "
        "stopped as the interval was narrow enough, after 3 round(s), 300 requests.")
    html = get(db, "/results/-/run/r1")[0].text
    assert "<th>median TTFT (ms)</th>" in html and "<td>sql</td>" in html
    assert "<strong>62 · 32 · 11</strong> %" in html


def test_a_capped_until_line_and_an_unknown_statistic() -> None:
    line = run_page.until_line({"metric": "mean_e2el_ms", "half_width": 0.05,
                                "confidence": 0.9, "max_prompts": 250, "stopped_by": "cap",
                                "ci_low": 1.0, "ci_high": 2.0, "relative_half_width": 0.3,
                                "rounds": 3, "requests": 250})
    assert line is not None and "Sent until mean E2EL was known" in line
    assert "stopped by the cap of 250 requests, after 3 round(s)" in line
    assert run_page.metric_label("request_throughput") == "request_throughput"


def test_its_tables_stay_tables_on_a_phone() -> None:
    # Datasette turns a rows-and-columns table into cards on a narrow screen, labelling each
    # cell by CSS it writes for its own tables: ours had unlabelled numbers there.
    css = (Path(run_page.__file__).parent / "static" / "profllm.css").read_text()
    phone = css.split("@media only screen and (max-width: 576px)", 1)[1]
    assert "table.profllm-table { display: table; }" in phone
    assert "table.profllm-table td:before { content: none; }" in phone


def test_the_verdicts_show_large_figures_whole(tmp_path: Path) -> None:
    # A slow case's TTFT of 80,917 ms once read "8.092e+04" against a limit of "2000.0".
    record = make_record("r1", "s1", CASE, "2026-01-01T10:00:00+00:00", "failed")
    record["threshold_results"] = [{"metric": "median_ttft_ms", "bound": "max",
                                    "limit": 2000.0, "value": 80917.2, "passed": False}]
    html = get(ingested(tmp_path, record), "/results/-/run/r1")[0].text
    assert "<td>2000</td><td>80,917</td>" in html
    assert "e+0" not in html.split("<h2>Headline metrics</h2>")[0]


def test_the_receivers_span_counts_read_as_one_sentence() -> None:
    counts = {"exports": 15, "refused_malformed": 1, "refused_too_large": 0,
              "spans_received": 40, "spans_kept": 32, "spans_unexpected": 6,
              "spans_over_limit": 0, "spans_duplicate": 2}
    assert run_page.span_counts_line({"span_receiver": counts}) == (
        "The trace receiver accepted 15 export(s) holding 40 request span(s) during the load: "
        "32 kept as this load's own; set aside: 6 of trace ids the load did not send "
        "(warm-ups, start-up), 2 repeated for a trace id (the last to end kept). It refused 1 "
        "export(s) (1 malformed, 0 too large).")
    clean = {**counts, "refused_malformed": 0, "spans_received": 32, "spans_unexpected": 0,
             "spans_duplicate": 0}
    line = run_page.span_counts_line({"span_receiver": clean})
    assert line is not None and line.endswith("32 kept as this load's own.")
    # Not traced, or a record from before the receiver counted: nothing said.
    assert run_page.span_counts_line({"span_receiver": None}) is None
    assert run_page.span_counts_line(None) is None


@given(st.dictionaries(st.text(max_size=20), st.none() | st.booleans() | st.integers()
                       | st.floats() | st.text(max_size=5), max_size=10))
def test_any_receiver_counts_give_a_sentence(counts: dict[str, Any]) -> None:
    line = run_page.span_counts_line({"span_receiver": counts})
    assert line is not None and line.startswith("The trace receiver accepted ")
