"""Where a slow request's time went (browse/request_timeline.py): the run page's per-request
timeline on a run with server spans and one without, its sampling at 10,000 requests, the
slowest requests' dominant part, and the `run_requests` canned query."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import httpx
from datasette.app import Datasette
from test_datasette import make_record

from pytest_profllm.browse import request_timeline, run_page
from pytest_profllm.results.store import load_records

CASE = "bench[timeline]"


def traced(index: int, *, queue: float = 2.0, prefill: float = 10.0, decode: float = 50.0,
           client: float = 3.0, prompt: int = 128, span: bool = True) -> dict[str, Any]:
    """A successful request row as a traced load writes it (times in s, span in ms)."""
    server = queue + prefill + decode
    row: dict[str, Any] = {
        "index": index, "success": True, "status": 200, "prompt_len": prompt,
        "output_tokens": 32, "start_s": index * 0.01, "ttft_s": (queue + prefill + 1) / 1000,
        "latency_s": (server + client) / 1000, "itl_s": [],
    }
    if span:
        row.update(server_queue_ms=queue, server_prefill_ms=prefill, server_decode_ms=decode,
                   server_inference_ms=prefill + decode, server_ttft_ms=queue + prefill,
                   server_e2el_ms=server, client_overhead_ttft_ms=1.0,
                   client_overhead_e2el_ms=client)
    return row


def database(tmp_path: Path, runs: dict[str, list[dict[str, Any]]]) -> Path:
    db = tmp_path / "results.db"
    load_records(db, [make_record(run_id, "s1", CASE, "2026-01-01T10:00:00+00:00")
                      for run_id in runs], requests=runs)
    return db


def page_of(db: Path, run_id: str) -> run_page.RunPage:
    with sqlite3.connect(db) as connection:
        page = run_page.run_page(connection, run_id)
    assert page is not None
    return page


def get(db: Path, *urls: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        return [await datasette.client.get(url) for url in urls]

    return asyncio.run(run())


def test_the_timeline_of_a_traced_run_and_of_one_without_spans(tmp_path: Path) -> None:
    rows = [traced(i) for i in range(5)] + [traced(5, queue=400.0)]
    db = database(tmp_path, {"traced": rows, "plain": [traced(i, span=False)
                                                       for i in range(4)]})
    page = page_of(db, "traced")
    chart = page.charts["requests-timeline"]
    bars = chart["data"]["values"]
    assert [bar["request"] for bar in bars] == list(range(6))  # by arrival
    last = bars[-1]
    # Its parts end to end from its send: queue, prefill, decode, the server's rest, client.
    assert last["start_s"] == 0.05 and last["queue_ms"] == 400.0
    assert last["end4_s"] == round(0.05 + (400 + 10 + 50 + 0 + 3) / 1000, 4)
    assert "6 of 6 requests shown" in chart["title"]
    assert page.timeline_note is None
    plain = page_of(db, "plain")
    assert "requests-timeline" not in plain.charts and plain.slowest == []
    assert plain.timeline_note == request_timeline.NO_SPANS
    traced_html, plain_html = (r.text for r in get(db, "/results/-/run/traced",
                                                   "/results/-/run/plain"))
    assert 'id="requests-timeline"' in traced_html and "slowest by E2E" in traced_html
    assert 'id="requests-timeline"' not in plain_html
    assert "no per-request timeline" in plain_html


def test_ten_thousand_requests_are_sampled_and_keep_the_slowest() -> None:
    found = [request_timeline.Request(i, i * 1.0, 100, 32, 5.0, 20.0 + (i * 7919) % 10_000,
                                      1, 2, 3, 3, 6, 0, 0) for i in range(10_000)]
    shown = request_timeline.sample(found)
    assert len(shown) == request_timeline.CAP
    slowest = {r.index for r in sorted(found, key=lambda r: -r.e2el_ms)[:20]}
    assert slowest <= {r.index for r in shown}
    assert [r.start_ms for r in shown] == sorted(r.start_ms for r in shown)
    # The rest spread over the whole load, not its first 480.
    assert max(r.index for r in shown if r.index not in slowest) > 9_000
    chart, caption = request_timeline.timeline(found)
    assert len(chart["data"]["values"]) == request_timeline.CAP
    assert caption.startswith("500 of 10,000 requests shown: the 20 slowest by E2E")


def test_the_slowest_requests_say_what_dominated(tmp_path: Path) -> None:
    rows = [traced(i) for i in range(12)]
    rows[3] = traced(3, queue=900.0)
    rows[7] = traced(7, prefill=600.0, prompt=8000)
    rows[9] = traced(9, decode=2000.0)
    rows[11] = traced(11, client=700.0)
    page = page_of(database(tmp_path, {"r": rows}), "r")
    by_ttft, by_e2e = page.slowest
    assert (by_ttft.metric, by_e2e.metric) == ("ttft", "e2el")
    assert len(by_ttft.rows) == len(by_e2e.rows) == request_timeline.TOP
    e2e = {row["request"]: row["dominant"] for row in by_e2e.rows}
    assert [row["request"] for row in by_e2e.rows[:4]] == [9, 3, 11, 7]
    assert e2e[9].startswith("the decode of 32 tokens: 2000.0 of ")
    assert e2e[3].startswith("the queue")
    assert e2e[11].startswith("the client")
    assert e2e[7].startswith("the prefill of a 8,000-token prompt: 600.0 of ")
    ttft = {row["request"]: row["dominant"] for row in by_ttft.rows}
    assert [row["request"] for row in by_ttft.rows[:2]] == [3, 7]
    assert ttft[3] == "the queue: 900.0 of 911.0 ms (99%)"


def test_the_run_requests_query_lists_a_runs_requests_with_their_spans(tmp_path: Path) -> None:
    db = database(tmp_path, {"r": [traced(0), traced(1, span=False)], "other": [traced(0)]})
    (answer, csv) = get(db, "/results/run_requests.json?run_id=r&_shape=array",
                        "/results/run_requests.csv?run_id=r")
    assert answer.status_code == 200, answer.text
    first, second = answer.json()
    assert (first["request_index"], first["start_ms"], first["prompt_len"]) == (0, 0.0, 128)
    assert (first["server_queue_ms"], first["server_decode_ms"],
            first["client_overhead_e2el_ms"]) == (2.0, 50.0, 3.0)
    assert second["server_e2el_ms"] is None
    assert csv.status_code == 200 and csv.text.splitlines()[0].startswith(
        "run_id,request_index,success,start_ms,prompt_len")
