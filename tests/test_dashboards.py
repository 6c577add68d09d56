"""The dashboards (browse/dashboards/) and their filter panel (browse/filters.py): the data
each chart draws, on records of known values, and the pages Datasette serves."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sqlite3
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from datasette.app import Datasette
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasette import make_record

from pytest_profllm.browse import charts, dashboards, filters, sql_functions
from pytest_profllm.browse.dashboard_pages import WRITE_ACTION, data_quality
from pytest_profllm.browse.dashboards import BY_NAME, common, history, pareto_frontier
from pytest_profllm.browse.filters import Selection
from pytest_profllm.results.ingest import ingest

SLOWDOWN = 0.6  # the second session's throughput, as a fraction of the first's


def sweep(session: str, day: str, factor: float) -> list[dict[str, Any]]:
    """One session of two suites: `rates` sweeps request rate (8, 16, inf) at two batch
    limits; `tp` sweeps concurrency (4, 16) at tensor parallel 1 and 2. Throughput grows with
    load and, in `tp`, with tensor parallelism."""
    records = []
    index = 0
    rates: tuple[float | str, ...] = (8.0, 16.0, "inf")
    for seqs, rate in itertools.product((8, 16), rates):
        load = 32.0 if rate == "inf" else float(rate)
        case = f"bench_rates.yaml::qwen-seqs{seqs}::random-rate{rate}"
        record = make_record(
            f"{session}-r{index:02d}", session, case, f"2026-01-{day}T10:{index:02d}:00+00:00",
            throughput=factor * load * seqs / 8, max_num_seqs=seqs, request_rate=rate,
            p99_ttft=load * 10 / factor)
        record["suite"] = "rates"
        records.append(record)
        index += 1
    for tp, concurrency in itertools.product((1, 2), (4, 16)):
        case = f"bench_tp.yaml::llama-tp{tp}::random-conc{concurrency}"
        record = make_record(
            f"{session}-t{index:02d}", session, case, f"2026-01-{day}T11:{index:02d}:00+00:00",
            throughput=factor * concurrency * tp * 0.9, request_rate="inf",
            p99_ttft=concurrency * 5 / factor)
        record["suite"] = "tp"
        record["config"]["server"] = {"model": "meta-llama/Llama-3.1-8B-Instruct",
                                      "tensor_parallel_size": tp}
        record["config"]["benchmark"]["max_concurrency"] = concurrency
        records.append(record)
        index += 1
    return records


def gate(record: dict[str, Any], metric: str, verdict: str, change: float) -> None:
    record["regression"] = [{"metric": metric, "verdict": verdict, "tolerance": 0.05,
                             "higher_is_better": True, "baseline": 1.0, "value": 1 + change,
                             "change": change, "confidence": 0.99,
                             "baseline_session": "s1"}]


@pytest.fixture(scope="module")
def mixed_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sessions; the second is slowed, and the gate called one case regressed."""
    first, second = sweep("s1", "01", 1.0), sweep("s2", "02", SLOWDOWN)
    gate(second[0], "output_throughput", "regressed", SLOWDOWN - 1)
    folder = tmp_path_factory.mktemp("mixed")
    return ingested(folder, [*first, *second])


def ingested(folder: Path, records: list[dict[str, Any]]) -> Path:
    """The records as files in `folder`, loaded as `profllm ingest` does (which fills the
    gate's tables too)."""
    for record in records:
        (folder / f"{record['run_id']}.json").write_text(json.dumps(record))
    path = folder / "results.db"
    ingest(path, sorted(folder.glob("*.json")))
    return path


@pytest.fixture
def connection(mixed_db: Path) -> Any:
    connection = sqlite3.connect(mixed_db)
    sql_functions.register(connection)
    yield connection
    connection.close()


def view(connection: sqlite3.Connection, name: str, query: str = "",
         **args: str) -> dashboards.View:
    schema = filters.read_schema(connection)
    selection = Selection.parse(urllib.parse.parse_qsl(query), schema)
    return BY_NAME[name].build(connection, schema, selection, args)


def values(chart: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = chart["data"]["values"]
    return rows


def test_load_charts_follow_the_axis_each_suite_sweeps(connection: sqlite3.Connection) -> None:
    shown = view(connection, "load")
    rate = values(shown.charts["load-rates-request_rate-output_throughput"])
    concurrency = values(shown.charts["load-tp-max_concurrency-output_throughput"])
    # The rate sweep has its infinite rate, at the end of the axis, not left out.
    assert sorted({(r["load"], r["load_order"]) for r in rate}, key=lambda x: x[1]) == [
        ("8", 8.0), ("16", 16.0), ("inf", common._INF_ORDER)]
    assert {r["load"] for r in concurrency} == {"4", "16"}
    # Series are named by the axis that differs within the suite, not by a case id.
    assert {r["series"] for r in rate} == {"max_num_seqs=8", "max_num_seqs=16"}
    assert {r["series"] for r in concurrency} == {"tensor_parallel_size=1",
                                                  "tensor_parallel_size=2"}
    # The latest session only, by default: s2's (slowed) figures.
    at_16 = {r["series"]: r["output_throughput"] for r in rate if r["load"] == "16"}
    assert at_16 == {"max_num_seqs=8": pytest.approx(SLOWDOWN * 160),
                     "max_num_seqs=16": pytest.approx(SLOWDOWN * 320)}
    assert shown.charts["load-rates-request_rate-output_throughput"]["title"].startswith("rates: ")


def test_a_slowed_second_session_is_drawn_apart_from_the_first(
    connection: sqlite3.Connection,
) -> None:
    both = values(view(connection, "load", "session=s1&session=s2").charts[
        "load-rates-request_rate-output_throughput"])
    by_series = {(r["series"], r["load"]): r["output_throughput"] for r in both}
    assert by_series[("max_num_seqs=8 · session=s1", "8")] == pytest.approx(80)
    assert by_series[("max_num_seqs=8 · session=s2", "8")] == pytest.approx(SLOWDOWN * 80)
    # Blended on request: one median over the two sessions per point, no session in names.
    blended = values(view(connection, "load", "session=s1&session=s2&blend=1").charts[
        "load-rates-request_rate-output_throughput"])
    point = {(r["series"], r["load"]): r for r in blended}[("max_num_seqs=8", "8")]
    assert point["output_throughput"] == pytest.approx((80 + SLOWDOWN * 80) / 2)
    assert point["runs"] == 2


def test_filters_select_runs_and_combine_with_and_or(connection: sqlite3.Connection) -> None:
    only_tp2 = view(connection, "load", "f.server_tensor_parallel_size=2")
    assert set(only_tp2.charts) == {f"load-tp-max_concurrency-{m}" for m in (
        "output_throughput", "p99_ttft_ms", "median_tpot_ms", "request_throughput")}
    assert {r["series"] for r in values(only_tp2.charts[
        "load-tp-max_concurrency-output_throughput"])} == {"llama-tp2"}
    # A numeric range and a text search, ANDed: nothing is both; ORed: both kinds show.
    query = "max.output_throughput=60&q=seqs16"
    assert view(connection, "load", query).notes == ["No valid measurement in this selection."]
    either = view(connection, "load", query + "&match=any")
    shown = {r["series"] for chart in either.charts.values() for r in values(chart)}
    assert "max_num_seqs=16" in shown and "max_num_seqs=8" in shown  # a low one at rate 8
    # An unknown column is named and ignored, never put into SQL.
    schema = filters.read_schema(connection)
    refused = Selection.parse([("f.x) OR 1=1 --", "1"), ("min.p99_ttft_ms", "fast")], schema)
    assert refused.values == {} and refused.low == {}
    assert len(refused.problems) == 2


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(
    st.sampled_from(["f.server_model", "f.suite", "f.bench_request_rate", "min.p99_ttft_ms",
                     "max.output_throughput", "q", "match", "session", "blend", "f.nope",
                     "f.server_max_num_seqs"]),
    st.text(max_size=12)), max_size=8))
def test_any_query_string_makes_valid_sql(connection: sqlite3.Connection,
                                          pairs: list[tuple[str, str]]) -> None:
    """Whatever the query string holds, the selection is valid SQL that selects a subset of
    the runs, and it survives a round trip through its own query string."""
    schema = filters.read_schema(connection)
    selection = Selection.parse(pairs, schema)
    where, params = selection.where(schema)
    connection.execute(f"SELECT count(*) FROM benchmark_runs WHERE {where}", params).fetchone()
    again = Selection.parse(urllib.parse.parse_qsl(selection.query_string(),
                                                   keep_blank_values=True), schema)
    assert again.where(schema) == (where, params)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metric=st.text(max_size=300) | st.sampled_from(
    ["capacity", "p99_ttft_ms", "median_itl_ms", "output_throughput", "run_id", "x]; --"]),
       case_id=st.text(max_size=40) | st.just("bench_rates.yaml::qwen-seqs8::random-rate8.0"))
def test_any_history_metric_draws_or_says_why_in_one_line(
        connection: sqlite3.Connection, metric: str, case_id: str) -> None:
    """`?metric=` and `?case_id=` come from the URL: any value gives the history of a metric
    the page lists, or one short note naming what it could not draw."""
    shown = view(connection, "history", metric=metric, case_id=case_id)
    offered = shown.inputs["metric"][2]
    assert shown.inputs["metric"][1] in offered
    assert (metric in offered) == (not any(n.startswith("No history of metric")
                                           for n in shown.notes))
    assert all("\n" not in note and len(note) < 400 for note in shown.notes)


def test_pareto_frontier_and_the_best_under_a_bound(connection: sqlite3.Connection) -> None:
    shown = view(connection, "pareto", max_p99_ttft_ms="100")
    # A chart per model: qwen's and llama's.
    assert len(shown.charts) == 2
    llama = next(chart for name, chart in shown.charts.items() if "Llama" in name)
    rows = values(llama)
    # Throughput per GPU divides by tensor parallelism.
    tp2 = [r for r in rows if r["series"] == "tensor_parallel_size=2"]
    assert {r["gpus"] for r in tp2} == {2}
    ranked = shown.tables[0].rows
    assert ranked and all(r["p99_ttft_ms"] <= 100 for r in ranked)
    per_gpu = [r["output_tok_per_s_per_gpu"] for r in ranked]
    assert per_gpu == sorted(per_gpu, reverse=True)
    frontier = llama["layer"][0]["data"]["values"]
    assert frontier and all(r["on_frontier"] for r in frontier)


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), max_size=40),
       st.booleans())
def test_no_point_beats_the_frontier(points: list[tuple[float, float]], higher: bool) -> None:
    rows = [{"x": x, "y": y} for x, y in points]
    frontier = pareto_frontier(rows, "x", "y", y_higher_is_better=higher)

    def beats(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
        better_y = a["y"] >= b["y"] if higher else a["y"] <= b["y"]
        strictly = a["x"] > b["x"] or (a["y"] > b["y"] if higher else a["y"] < b["y"])
        return bool(a["x"] >= b["x"] and better_y and strictly)

    for point in frontier:
        assert not any(beats(other, point) for other in rows)
    for row in rows:
        assert any(f is row for f in frontier) or any(beats(f, row) or f == row
                                                       for f in frontier)


def test_latest_session_shows_what_regressed_and_by_how_much(
    connection: sqlite3.Connection,
) -> None:
    shown = view(connection, "latest")
    regressed = shown.tables[0].rows
    assert [(r["metric"], r["gate"], r["change_percent"], r["baseline_session"])
            for r in regressed] == [
        ("output_throughput", "regressed", pytest.approx(100 * (SLOWDOWN - 1)), "s1")]
    assert regressed[0]["case_id"] == "bench_rates.yaml::qwen-seqs8::random-rate8.0"
    changes = shown.tables[1].rows
    throughput = [r for r in changes if r["metric"] == "output_throughput"]
    assert len(throughput) == 10
    assert all(r["change_percent"] == pytest.approx(100 * (SLOWDOWN - 1)) for r in throughput)
    colours = {r["case"]: r["gate"] for r in values(
        shown.charts["latest-change-output_throughput"])}
    assert colours["rates · max_num_seqs=8 · workload=random-rate8.0"] == "regressed"


def test_latest_lists_every_regressed_verdict_and_charts_each_metric(tmp_path: Path) -> None:
    """Verdicts on a capacity, on a metric the session-to-session points do not carry and on
    a second repeat of a case are regressed too: the page lists each of regression_verdicts'
    rows, and charts each regressed metric."""
    first, second = sweep("s1", "01", 1.0), sweep("s2", "02", SLOWDOWN)
    repeat = {**second[0], "run_id": "s2-r00-repeat2", "repeat_index": 1}
    verdict = {"verdict": "regressed", "tolerance": 0.05, "higher_is_better": False,
               "confidence": 0.99, "baseline_session": "s1"}
    second[0]["regression"] = [
        {**verdict, "metric": "mean_tpot_ms", "baseline": 10.0, "value": 12.0, "change": 0.2,
         "ci_low": 0.15, "ci_high": 0.25},
        {**verdict, "metric": "p99_ttft_ms", "baseline": 80.0, "value": 133.3,
         "change": 0.666, "ci_low": 0.5, "ci_high": 0.8}]
    repeat["regression"] = [{**verdict, "metric": "mean_tpot_ms", "baseline": 10.0,
                             "value": 11.0, "change": 0.1, "ci_low": 0.06, "ci_high": 0.14}]
    second[1]["regression"] = [{**verdict, "metric": "capacity", "higher_is_better": True,
                                "baseline": 20.0, "value": 12.0, "change": -0.4},
                               {**verdict, "metric": "median_ttft_ms",
                                "verdict": "unchanged", "change": 0.01}]
    db = ingested(tmp_path, [*first, *second, repeat])
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        stored = connection.execute(
            "SELECT count(*) FROM regression_verdicts WHERE verdict = 'regressed'").fetchone()
        shown = view(connection, "latest")
    assert stored == (4,)
    regressed = shown.tables[0].rows
    assert sorted((r["run_id"], r["metric"], r["change_percent"]) for r in regressed) == [
        ("s2-r00", "mean_tpot_ms", 20.0), ("s2-r00", "p99_ttft_ms", 66.6),
        ("s2-r00-repeat2", "mean_tpot_ms", 10.0), ("s2-r01", "capacity", -40.0)]
    tpot = next(r for r in regressed if r["run_id"] == "s2-r00" and r["metric"] ==
                "mean_tpot_ms")
    assert (tpot["baseline"], tpot["value"], tpot["interval_percent"],
            tpot["baseline_session"]) == (10.0, 12.0, "[15.0, 25.0]", "s1")
    assert {"latest-gate-mean_tpot_ms", "latest-gate-p99_ttft_ms",
            "latest-gate-capacity"} <= set(shown.charts)
    assert "latest-gate-median_ttft_ms" not in shown.charts  # not regressed
    assert len(values(shown.charts["latest-gate-mean_tpot_ms"])) == 2


def test_history_marks_the_gate_verdicts(connection: sqlite3.Connection) -> None:
    case = "bench_rates.yaml::qwen-seqs8::random-rate8.0"
    shown = view(connection, "history", case_id=case)
    points = values(shown.charts["history"])
    assert [(p["session"], p["gate"]) for p in points] == [("s1", "not gated"),
                                                          ("s2", "regressed")]
    time_axis = shown.charts["history"]["layer"][0]["encoding"]["x"]
    assert time_axis["scale"] == {"type": "utc"}
    # A 24-hour clock, in UTC, never finer than a second (Vega's defaults read 17:03 as
    # "05:03" and put ".500" ticks between runs seconds apart).
    assert time_axis["axis"]["format"] == "%Y-%m-%d %H:%M"  # two days apart
    assert time_axis["axis"]["tickMinStep"] == 1000
    assert not shown.notes


def test_history_says_which_metrics_it_has_and_offers_capacity(tmp_path: Path) -> None:
    case = "bench_rates.yaml::qwen-seqs8::random-rate8.0"
    db = ingested(tmp_path, sweep("s1", "01", 1.0))
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        unknown = view(connection, "history", case_id=case, metric="capacity")
        assert unknown.notes == [
            "No history of metric 'capacity' here: it is one of output_throughput, "
            "request_throughput, median_ttft_ms, p99_ttft_ms, median_tpot_ms, p99_tpot_ms, "
            "median_itl_ms, p99_e2el_ms; showing output_throughput."]
        assert unknown.inputs["metric"][1] == "output_throughput"
        connection.execute("UPDATE benchmark_runs SET capacity = 12.5 WHERE case_id = ?",
                           (case,))
        shown = view(connection, "history", case_id=case, metric="capacity")
    assert not shown.notes
    assert "capacity" in shown.inputs["metric"][2] and shown.inputs["metric"][1] == "capacity"
    assert [p["value"] for p in values(shown.charts["history"])] == [12.5]
    # One run: its date and time; runs seconds apart: to the second; hours apart: minutes.
    assert shown.charts["history"]["layer"][0]["encoding"]["x"]["axis"]["format"] == (
        "%Y-%m-%d %H:%M:%S")
    day = "2026-01-01T17:03:0{}+00:00"
    assert history._time_format([day.format(0), day.format(2)]) == "%H:%M:%S"
    assert history._time_format([day.format(0), "2026-01-01T21:00:00+00:00"]) == "%H:%M"


def test_scaling_efficiency_against_the_smallest_tp(connection: sqlite3.Connection) -> None:
    rows = values(view(connection, "scaling").charts["scaling-efficiency"])
    # Throughput doubles with tp 2: per GPU it is the same, 100 % efficient.
    assert {(r["tensor_parallel_size"], r["efficiency_percent"]) for r in rows} == {
        (1, 100.0), (2, 100.0)}


def test_scaling_compares_tp_sizes_on_as_many_gpus(tmp_path: Path) -> None:
    """On GPUs, tp 2 runs on two: the device column says `2x ...` where tp 1 says `1x ...`,
    and the two are still one configuration at two sizes."""
    records = []
    for tp in (1, 2):
        record = make_record(f"g-t{tp}", "g", f"bench_tp.yaml::llama-tp{tp}::random-conc16",
                             f"2026-01-01T11:0{tp}:00+00:00",
                             throughput=100.0 if tp == 1 else 160.0, request_rate="inf",
                             p99_ttft=50.0)
        record["config"]["server"] = {"model": "meta-llama/Llama-3.1-8B-Instruct",
                                      "tensor_parallel_size": tp}
        record["config"]["benchmark"]["max_concurrency"] = 16
        record["system"]["gpu_names"] = ["NVIDIA H100 80GB HBM3"] * tp
        records.append(record)
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    try:
        rows = values(view(connection, "scaling").charts["scaling-efficiency"])
    finally:
        connection.close()
    assert {(r["tensor_parallel_size"], r["efficiency_percent"]) for r in rows} == {
        (1, 100.0), (2, 80.0)}


def test_scaling_says_when_its_series_outnumber_the_colours(tmp_path: Path) -> None:
    records = []
    for tp, concurrency in itertools.product((1, 2), range(1, charts.MAX_COLOURS + 2)):
        record = make_record(f"c-t{tp}-{concurrency:02d}", "c",
                             f"bench_tp.yaml::llama-tp{tp}::random-conc{concurrency}",
                             f"2026-01-01T11:{concurrency:02d}:0{tp}+00:00",
                             throughput=10.0 * concurrency * tp, request_rate="inf",
                             p99_ttft=50.0)
        record["config"]["server"] = {"model": "meta-llama/Llama-3.1-8B-Instruct",
                                      "tensor_parallel_size": tp}
        record["config"]["benchmark"]["max_concurrency"] = concurrency
        records.append(record)
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    try:
        notes = view(connection, "scaling").notes
    finally:
        connection.close()
    assert any(note.startswith(f"Scaling: {charts.MAX_COLOURS + 1} series on one chart")
               for note in notes), notes


def test_latest_draws_the_largest_changes_of_many_cases(tmp_path: Path) -> None:
    """Hundreds of cases would make each change chart thousands of pixels tall: it draws the
    largest changes and every regressed case, and says so."""
    cases = dashboards.MAX_CHANGE_BARS + 10
    records = []
    for session, day in (("m1", "01"), ("m2", "02")):
        for index in range(cases):
            # In m2 case i is i % 50 % slower; case 3 (3 % slower) is the one regressed.
            factor = 1.0 if session == "m1" else 1 - index / 100
            record = make_record(f"{session}-{index:02d}", session,
                                 f"bench_many.yaml::qwen::random-rate{index + 1}",
                                 f"2026-01-{day}T10:{index:02d}:00+00:00",
                                 throughput=100.0 * factor, request_rate=float(index + 1),
                                 p99_ttft=50.0)
            record["suite"] = "many"
            if session == "m2" and index == 3:
                gate(record, "output_throughput", "regressed", -0.03)
            records.append(record)
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    try:
        shown = view(connection, "latest")
    finally:
        connection.close()
    bars = values(shown.charts["latest-change-output_throughput"])
    assert len(bars) == dashboards.MAX_CHANGE_BARS
    # The regressed case and the 39 largest drops (11 to 49 %).
    drops = {round(-r["change_percent"]) for r in bars if r["gate"] != "regressed"}
    assert drops == set(range(cases - dashboards.MAX_CHANGE_BARS + 1, cases))
    assert any(r["gate"] == "regressed" for r in bars)  # a small change, but regressed
    assert shown.captions["latest-change-output_throughput"].startswith(
        f"The {dashboards.MAX_CHANGE_BARS} of {cases} cases that changed most or regressed")
    assert "latest-change-output_throughput" in shown.wide


def test_capacity_says_when_there_is_none(connection: sqlite3.Connection) -> None:
    assert view(connection, "capacity").notes == [
        "No capacity case in this database (benchmark kind: capacity)."]


def pages(db: Path, *urls: str, actor: dict[str, str] | None = None,
          post: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        cookies = {"ds_actor": datasette.sign({"a": actor}, "actor")} if actor else {}
        responses = [await datasette.client.get(url, cookies=cookies) for url in urls]
        if post is not None:
            form = await datasette.client.get(urls[0], cookies=cookies)
            token = form.cookies.get("ds_csrftoken") or ""
            responses.append(await datasette.client.post(
                f"/results/-/dashboards/{post.pop('dashboard')}/presets",
                data={**post, "csrftoken": token}, cookies={**cookies, "ds_csrftoken": token}))
            responses.append(await datasette.client.get("/results/-/dashboards",
                                                        cookies=cookies))
        return responses

    return asyncio.run(run())


def test_every_dashboard_page_renders_with_its_charts(mixed_db: Path) -> None:
    responses = pages(mixed_db, "/results/-/dashboards",
                      *(f"/results/-/dashboards/{d.name}" for d in dashboards.DASHBOARDS),
                      "/results/-/dashboards/nope")
    assert [r.status_code for r in responses] == [200] * (len(dashboards.DASHBOARDS) + 1) + [404]
    for response, dashboard in zip(responses[1:], dashboards.DASHBOARDS, strict=False):
        assert dashboard.question in response.text
        # Capacity and precision draw only cases of their kinds, which this database lacks.
        if dashboard.name not in ("capacity", "precision"):
            assert 'class="profllm-chart"' in response.text
    # The landing page links every dashboard: one click.
    (landing,) = pages(mixed_db, "/results/runs")
    for dashboard in dashboards.DASHBOARDS:
        assert f'href="/results/-/dashboards/{dashboard.name}"' in landing.text


def test_an_empty_or_older_database_gets_pages_not_errors(tmp_path: Path) -> None:
    db = ingested(tmp_path, sweep("s1", "01", 1.0)[:1])
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TABLE regression_verdicts")
        connection.execute("DELETE FROM benchmark_runs")
    responses = pages(db, *(f"/results/-/dashboards/{d.name}" for d in dashboards.DASHBOARDS))
    assert [r.status_code for r in responses] == [200] * len(dashboards.DASHBOARDS)


def test_presets_are_saved_by_a_writer_and_opened_by_anyone(mixed_db: Path,
                                                            tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    db.write_bytes(mixed_db.read_bytes())
    query = "f.suite=tp&session=all"
    anonymous = pages(db, "/results/-/dashboards/load",
                      post={"dashboard": "load", "name": "tp only", "query": query})
    assert anonymous[1].status_code == 403
    root = pages(db, "/results/-/dashboards/load", actor={"id": "root"},
                 post={"dashboard": "load", "name": "tp only", "query": query})
    assert root[1].status_code == 302
    assert root[1].headers["location"].endswith("/results/-/dashboards/load?" + query)
    assert 'href="/results/-/dashboards/load?f.suite=tp&amp;session=all">tp only</a>' in (
        root[2].text)
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT name, dashboard, query, saved_by FROM "
                                  "filter_presets").fetchall() == [
            ("tp only", "load", query, "root")]
    assert WRITE_ACTION == "profllm-upload"


def test_all_sessions_draw_the_newest_apart_and_say_so(
    connection: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common, "MAX_SESSIONS", 1)
    shown = view(connection, "load", "session=all")
    sessions = {r["session"] for chart in shown.charts.values() for r in values(chart)}
    assert sessions == {"s2"}
    assert shown.notes == [
        "More sessions match than a page draws apart: the 1 newest with valid measurements "
        "are drawn (at most 1 sessions, 1500 points); pick sessions, or blend them, for "
        "others."]
    # A filter that only the older session meets finds it, however far back it is.
    older = view(connection, "load", "session=all&min.output_throughput=500&f.suite=rates")
    assert {r["session"] for chart in older.charts.values() for r in values(chart)} == {"s1"}


@pytest.fixture(scope="module")
def many_sessions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 sessions of 0 to 4 valid points each (a session of none holds one errored run)."""
    records = []
    for number in range(40):
        session, cases = f"m{number:02d}", number % 5
        for case in range(max(cases, 1)):
            record = make_record(f"{session}-{case}", session, f"bench_m.yaml::c{case}::w",
                                 f"2026-02-01T{number // 4:02d}:{number % 4 * 10 + case:02d}:00"
                                 "+00:00", "passed" if cases else "error")
            record["suite"] = "m"
            records.append(record)
    return ingested(tmp_path_factory.mktemp("many"), records)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(most_sessions=st.integers(1, 15), most_points=st.integers(1, 120))
def test_all_sessions_take_whole_sessions_newest_first_until_a_limit(
    many_sessions: Path, monkeypatch: pytest.MonkeyPatch, most_sessions: int, most_points: int
) -> None:
    # However the sessions are read (in chunks sized by the points found so far), the page
    # draws the newest sessions with points, whole, while under both limits.
    monkeypatch.setattr(common, "MAX_SESSIONS", most_sessions)
    monkeypatch.setattr(common, "MAX_POINTS", most_points)
    with contextlib.closing(sqlite3.connect(many_sessions)) as connection:
        sql_functions.register(connection)
        schema = filters.read_schema(connection)
        selection = Selection.parse([("session", "all")], schema)
        points = dashboards.load_points(connection, schema, selection)
        newest_first = [session.session_id for session in schema.sessions]
        every: dict[str, int] = {
            session: connection.execute("SELECT count(*) FROM measured_runs WHERE "
                                        "session_id = ?", (session,)).fetchone()[0]
            for session in newest_first}
    expected: list[str] = []
    taken = 0
    for session in newest_first:
        if not every[session]:
            continue
        if len(expected) == most_sessions or (expected and taken >= most_points):
            break
        expected.append(session)
        taken += every[session]
    drawn = list(dict.fromkeys(point.session for point in points))
    assert drawn == expected
    assert len(points) == taken


def test_runs_left_out_are_counted(tmp_path: Path) -> None:
    records = sweep("s1", "01", 1.0)
    records[0]["status"] = "error"
    records[0]["results"] = {}
    db = ingested(tmp_path, records)
    with sqlite3.connect(db) as connection:
        schema = filters.read_schema(connection)
        notes = data_quality(connection, schema, Selection.parse([], schema))
    assert notes == [f"1 of the {len(records)} runs in this selection are not a valid "
                     "measurement and are left out of every chart (the landing table's "
                     "validity facet lists them)."]


def test_a_skipped_run_is_not_counted_as_an_invalid_measurement(tmp_path: Path) -> None:
    # Accuracy cases skipped for a missing extra read as "2 of the 20 runs ... are
    # not a valid measurement" on every dashboard. A skipped case measured nothing, wrongly
    # or not: it is named as skipped, apart from the invalid ones.
    records = sweep("s1", "01", 1.0)
    for record in records[:2]:
        record["status"] = "skipped"
        record["message"] = "lm-eval is not installed"
        record["results"] = {}
    db = ingested(tmp_path, records)
    with sqlite3.connect(db) as connection:
        schema = filters.read_schema(connection)
        notes = data_quality(connection, schema, Selection.parse([], schema))
    assert not any("not a valid measurement" in note for note in notes)
    [note] = notes
    assert note.startswith(f"2 of the {len(records)} runs in this selection were skipped")
    # With an invalid run beside them, each is counted apart.
    records[2]["status"] = "error"
    records[2]["results"] = {}
    (tmp_path / "again").mkdir()
    db = ingested(tmp_path / "again", records)
    with sqlite3.connect(db) as connection:
        schema = filters.read_schema(connection)
        notes = data_quality(connection, schema, Selection.parse([], schema))
    assert notes[0].startswith(f"1 of the {len(records)} runs in this selection are not a valid")
    assert notes[1].startswith(f"2 of the {len(records)} runs in this selection were skipped")


def test_latest_compares_with_the_newest_session_that_measured_its_cases(
        tmp_path: Path) -> None:
    # Session s3, between s1 and s4, failed in every case; the latest dashboard compared
    # s4 with it and said "No case ran in both sessions".
    failed = sweep("s3", "03", 1.0)
    for record in failed:
        record["status"] = "error"
        record["results"] = {}
    db = ingested(tmp_path, [*sweep("s1", "01", 1.0), *failed, *sweep("s4", "04", SLOWDOWN)])
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        shown = view(connection, "latest")
        assert shown.tables[1].title == "Every change against session s1"
        throughput = [r for r in shown.tables[1].rows if r["metric"] == "output_throughput"]
        assert len(throughput) == 10
        assert shown.notes[-1] == (
            "Session s4 (the latest) against session s1, the newest before it that measured "
            "the same cases; pick others in the filters (the first session chosen is "
            "compared with the second). Passed over, with no valid measurement of these "
            "cases: s3.")
        # A latest session that failed everywhere says so, plainly.
        alone = view(connection, "latest", "session=s3")
        assert alone.notes[-1] == ("Session s3 has no valid measurement (every case failed, "
                                   "or measured the client): nothing to compare.")
        first = view(connection, "latest", "session=s1")
        assert first.notes[-1] == ("Session s1 has no earlier session of the same suites "
                                   "with a valid measurement of its cases: nothing to compare.")


def test_latest_of_a_single_session_draws_no_empty_change_and_says_no_gate_ran(
        tmp_path: Path) -> None:
    # Before: an empty chart, a table headed "Every change against session -", and "Nothing
    # regressed by the gate's verdicts" where no gate had judged anything.
    db = ingested(tmp_path, sweep("s1", "01", 1.0))
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        shown = view(connection, "latest")
    assert not shown.charts
    assert [table.title for table in shown.tables] == [
        "Regressed (the regression gate's decisions in the latest session)"]
    (regressed,) = shown.tables
    assert not regressed.rows and "No regression gate ran" in regressed.empty
    assert "nothing to compare" in shown.notes[-1]


def one_load(session: str, suite: str, case: str, index: int, *, server_key: str = "k",
             concurrency: int = 4, **server: Any) -> dict[str, Any]:
    """A case of a suite that does not sweep load: `concurrency` requests at a time."""
    record = make_record(f"{session}-{suite}-{index:02d}", session, case,
                         f"2026-01-01T10:{index:02d}:00+00:00", throughput=10.0 + index,
                         request_rate="inf")
    record["suite"] = suite
    record["config"]["benchmark"]["max_concurrency"] = concurrency
    record["config"]["server"].update(server)
    record["runtime"]["server_key"] = server_key
    return record


def test_two_workloads_of_one_configuration_are_two_series_and_bars(tmp_path: Path) -> None:
    """The multimodal suite's two image sizes, at one concurrency: two series, not one line
    drawn up and down at a single load; and, with no load swept, bars saying so."""
    records = [one_load("s1", "multimodal", f"bench_mm.yaml::vl::random-mm-image-{size}", i)
               for i, size in enumerate(("256x256", "720x1280"))]
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    shown = view(connection, "load")
    chart = shown.charts["load-multimodal-max_concurrency-output_throughput"]
    assert sorted(r["series"] for r in values(chart)) == [
        "workload=random-mm-image-256x256", "workload=random-mm-image-720x1280"]
    assert chart["mark"]["type"] == "bar"
    assert chart["title"] == "multimodal: output tok/s at max concurrency 4"
    caption = shown.captions["load-multimodal-max_concurrency-output_throughput"]
    assert "does not sweep load" in caption and "the suite sweeps" not in caption


def swept_both(suite: str, loads: list[tuple[float | str, int | None]]) -> list[dict[str, Any]]:
    """One configuration of `suite` at each (request rate, concurrency cap) of `loads`."""
    records = []
    for index, (rate, concurrency) in enumerate(loads):
        record = make_record(f"s1-{suite}-{index:02d}", "s1",
                             f"bench_{suite}.yaml::qwen::random-r{rate}-c{concurrency}",
                             f"2026-01-01T10:{index:02d}:00+00:00", throughput=10.0 + index,
                             request_rate=rate)
        record["suite"] = suite
        record["config"]["benchmark"]["max_concurrency"] = concurrency
        records.append(record)
    return records


def test_a_suite_sweeping_both_loads_draws_one_line_per_load_it_holds(tmp_path: Path) -> None:
    """Rates at two concurrency caps: a line against rate per cap, not one line going up
    and down at each rate. A rate sweep beside a concurrency sweep at rate inf: a line
    against each, not the concurrency sweep as extra points at rate inf."""
    grid = swept_both("grid", [(2.0, 4), (2.0, 16), (8.0, 4), (8.0, 16)])
    apart = swept_both("apart", [(2.0, None), (8.0, None), ("inf", 4), ("inf", 16)])
    connection = sqlite3.connect(ingested(tmp_path, [*grid, *apart]))
    sql_functions.register(connection)
    shown = view(connection, "load")
    against_rate = values(shown.charts["load-grid-request_rate-output_throughput"])
    assert sorted((r["series"], r["load"], r["output_throughput"]) for r in against_rate) == [
        ("max_concurrency=16", "2", 110.0), ("max_concurrency=16", "8", 130.0),
        ("max_concurrency=4", "2", 100.0), ("max_concurrency=4", "8", 120.0)]
    assert not any(c.startswith("load-grid-max_concurrency") for c in shown.charts)
    rates = values(shown.charts["load-apart-request_rate-output_throughput"])
    assert sorted((r["load"], r["output_throughput"]) for r in rates) == [
        ("2", 100.0), ("8", 110.0)]
    caps = values(shown.charts["load-apart-max_concurrency-output_throughput"])
    assert sorted((r["load"], r["output_throughput"]) for r in caps) == [
        ("16", 130.0), ("4", 120.0)]
    # Alone in its chart, each is named by its configuration.
    assert {r["series"] for r in rates} == {r["series"] for r in caps} == {"qwen"}


def test_every_suite_is_drawn_pooling_and_the_last_run_first(tmp_path: Path) -> None:
    """Nine suites of one session, run ids in no time order (as real ones): all drawn, in
    the order they ran, the last first; a pooling suite (no output tokens) with its req/s."""
    records = [one_load("s1", f"suite{i}", f"bench_{i}.yaml::m::random", i)
               for i in range(8)]
    pooling = one_load("s1", "pooling", "bench_pooling.yaml::embed::random", 8)
    for name in ("output_throughput", "median_tpot_ms", "p99_ttft_ms"):
        pooling["results"][name] = None
    records.append(pooling)
    for record, run_id in zip(records, ("9", "1", "8", "2", "7", "3", "6", "4", "5"),
                              strict=True):
        record["run_id"] = f"s1-{run_id}"
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    shown = view(connection, "load")
    drawn = list(dict.fromkeys(c.split("-")[1] for c in shown.charts))
    assert drawn == ["pooling", *(f"suite{i}" for i in reversed(range(8)))]
    assert [c for c in shown.charts if c.startswith("load-pooling")] == [
        "load-pooling-max_concurrency-request_throughput"]
    assert shown.notes == ["pooling: no run measured output tok/s, p99 TTFT (ms), median TPOT "
                           "(ms) (a pooling model has no output tokens, say): those charts "
                           "are not drawn."]


def test_pareto_has_a_frontier_per_model_and_one_configuration_per_server(
    tmp_path: Path,
) -> None:
    """Two models: a chart and a frontier each. Two suites measured on one server (one
    server_key in one session) are one configuration."""
    records = [
        one_load("s1", "smoke", "bench_smoke.yaml::qwen::random-a", 0, server_key="A",
                 concurrency=4),
        one_load("s1", "capacity", "bench_capacity.yaml::qwen::capacity", 1, server_key="A",
                 concurrency=8),
        one_load("s1", "smoke", "bench_smoke.yaml::small::random-a", 2, server_key="B",
                 model="Qwen/Qwen3-0.6B"),
    ]
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    shown = view(connection, "pareto")
    assert set(shown.charts) == {"pareto-Qwen_Qwen3_8B-unknown",
                                 "pareto-Qwen_Qwen3_0_6B-unknown"}
    big = values(shown.charts["pareto-Qwen_Qwen3_8B-unknown"])
    assert {r["series"] for r in big} == {"qwen"}
    assert "capacity+smoke · qwen" in {r["series"] for r in shown.tables[0].rows}
    frontier = shown.charts["pareto-Qwen_Qwen3_0_6B-unknown"]["layer"][0]["data"]["values"]
    assert {r["model"] for r in frontier} == {"Qwen/Qwen3-0.6B"}
    assert len({r["series"] for r in shown.tables[0].rows}) == 2


def test_series_get_enough_colours_and_the_page_says_when_they_are_too_many(
    tmp_path: Path,
) -> None:
    records = [one_load("s1", "wide", f"bench_wide.yaml::m-seqs{n}::random", n,
                        concurrency=4, max_num_seqs=n) for n in range(1, 12)]
    connection = sqlite3.connect(ingested(tmp_path, records))
    sql_functions.register(connection)
    eleven = view(connection, "load").charts["load-wide-max_concurrency-output_throughput"]
    assert eleven["encoding"]["color"]["scale"] == {"scheme": "category20"}
    assert view(connection, "load").notes == []
    crowded = [one_load("s1", "wide", f"bench_wide.yaml::m-seqs{n}::random", n,
                        concurrency=4, max_num_seqs=n) for n in range(1, 23)]
    (tmp_path / "more").mkdir()
    connection = sqlite3.connect(ingested(tmp_path / "more", crowded))
    sql_functions.register(connection)
    assert view(connection, "load").notes == [
        "wide, against max concurrency: 22 series on one chart, more than its 20 colours "
        "tell apart (colours repeat; the tooltip names each point): filter on a setting in "
        "the legend, or pick fewer sessions (or blend them)."]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(
    st.sampled_from(("smoke", "mm", "pooling")), st.sampled_from(("Qwen/Qwen3-8B", "m/small")),
    st.integers(1, 24), st.sampled_from(("random", "image-256", "image-720")),
    st.sampled_from((2.0, 8.0, "inf")), st.sampled_from(("A", "B", "C")), st.booleans(),
), min_size=1, max_size=30))
def test_any_runs_draw_series_of_one_point_per_load_and_one_model_per_frontier(
    tmp_path_factory: pytest.TempPathFactory,
    cases: list[tuple[str, str, int, str, float | str, str, bool]],
) -> None:
    """Whatever suites, models, settings, workloads and loads a database holds: a line never
    joins two points at one load, a Pareto chart holds one model, series get enough colours or
    the page says they are too many."""
    records = []
    for index, (suite, model, seqs, workload, rate, server, tokens) in enumerate(cases):
        record = make_record(f"s1-{index:03d}", "s1",
                             f"bench_{suite}.yaml::m-seqs{seqs}::{workload}-rate{rate}",
                             f"2026-01-01T10:{index // 60:02d}:{index % 60:02d}+00:00",
                             throughput=1.0 + index, max_num_seqs=seqs, request_rate=rate)
        record["suite"] = suite
        record["config"]["server"]["model"] = model
        record["runtime"]["server_key"] = server
        if not tokens:
            record["results"]["output_throughput"] = None
        records.append(record)
    connection = sqlite3.connect(ingested(tmp_path_factory.mktemp("any"), records))
    sql_functions.register(connection)
    try:
        load = view(connection, "load")
        for chart in load.charts.values():
            rows = values(chart)
            series = {r["series"] for r in rows}
            if chart.get("mark", {}).get("type") == "line":
                assert len({(r["series"], r["load"]) for r in rows}) == len(rows)
            scheme = chart["encoding"]["color"]["scale"]["scheme"]
            assert scheme == ("category10" if len(series) <= 10 else "category20")
            if len(series) > 20:
                assert any("more than its 20 colours" in note for note in load.notes)
        pareto = view(connection, "pareto")
        for chart in pareto.charts.values():
            assert len({r["model"] for r in values(chart)}) == 1
            frontier = chart["layer"][0]["data"]["values"]
            assert len({r["model"] for r in frontier}) <= 1
    finally:
        connection.close()


def test_latest_compares_a_capacity_case_by_its_capacity_and_marks_a_failed_case(
        tmp_path: Path) -> None:
    # A capacity that fell, 26.33 -> 14.67 req/s, was not shown, and the failed capacity case
    # was charted as +6.6 % (its output throughput, at whatever load its search ended).
    case = "bench_capacity.yaml::qwen::random-capacity"
    before = make_record("s1-cap", "s1", case, "2026-01-01T10:00:00+00:00", throughput=70.0)
    after = make_record("s2-cap", "s2", case, "2026-01-02T10:00:00+00:00", "failed",
                        throughput=74.62)
    served = [make_record(f"{s}-serve", s, "bench_smoke.yaml::qwen::random", f"2026-01-0{d}"
                          "T09:00:00+00:00", throughput=t)
              for s, d, t in (("s1", 1, 10.0), ("s2", 2, 9.0))]
    for record in (before, after):
        record["suite"] = "capacity"
    for record in served:
        record["suite"] = "capacity"
    db = ingested(tmp_path, [before, after, *served])
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        for run_id, found in (("s1-cap", 26.33), ("s2-cap", 14.67)):
            connection.execute("UPDATE benchmark_runs SET capacity = ? WHERE run_id = ?",
                               (found, run_id))
        shown = view(connection, "latest")
    (capacity,) = values(shown.charts["latest-change-capacity"])
    assert (capacity["previous"], capacity["latest"], capacity["change_percent"]) == (
        26.33, 14.67, -44.3)
    assert capacity["gate"] == "case failed"
    assert capacity["status"] == "failed in the latest session"
    # Its output throughput (+6.6 %) is no change of the case: not drawn, not listed.
    throughput = values(shown.charts["latest-change-output_throughput"])
    assert [row["run_id"] for row in throughput] == ["s2-serve"]
    changes = {(r["run_id"], r["metric"]) for r in shown.tables[1].rows}
    assert ("s2-cap", "output_throughput") not in changes
    assert ("s2-cap", "capacity") in changes
    assert any("1 case(s) failed" in note for note in shown.notes)


def test_capacity_cases_show_their_figures_runs_and_the_load_they_ran_at(
        tmp_path: Path) -> None:
    # Two sessions of a capacity search (rate inf in its suite) that found the same capacity:
    # a change of 0 % drew a bar of no width, the capacity bars had no figure and no run, and
    # the load page said the case ran "at request rate inf".
    case = "bench_capacity.yaml::qwen::random-capacity"
    runs = [make_record(f"{s}-cap", s, case, f"2026-01-0{d}T10:00:00+00:00",
                        request_rate="inf") for s, d in (("s1", 1), ("s2", 2))]
    for record in runs:
        record["suite"] = "capacity"
        record["results"].update(capacity=26.332087650463436, capacity_low=26.332087650463436,
                                 capacity_high=28.10003456597279)
    db = ingested(tmp_path, runs)
    with sqlite3.connect(db) as connection:
        sql_functions.register(connection)
        latest = view(connection, "latest")
        capacity = view(connection, "capacity")
        load = view(connection, "load")
    chart = latest.charts["latest-change-capacity"]
    (row,) = values(chart)
    assert row["change_percent"] == 0.0 and row["bar_label"] == "+0.0 %, not gated"
    marks = [layer["mark"]["type"] for layer in chart["layer"]]
    assert marks == ["bar", "point", "text", "text"]  # a 0 % change is a point, labelled
    bars = capacity.charts["capacity"]
    assert any(layer["mark"]["type"] == "text" and layer["encoding"]["text"]["field"]
               == "capacity" for layer in bars["layer"])
    (table,) = capacity.tables
    (listed,) = table.rows
    assert listed["run_id"] == "s2-cap" and listed["validity"] == "valid"
    assert (listed["capacity"], listed["capacity_high"]) == (26.33, 28.1)
    (throughput,) = [key for key in load.charts if key.endswith("-output_throughput")]
    title = str(load.charts[throughput]["title"])
    assert "at its capacity (26.3 req/s)" in title and "inf" not in title
    assert {r["load"] for r in values(load.charts[throughput])} == {"26.3 (capacity)"}
