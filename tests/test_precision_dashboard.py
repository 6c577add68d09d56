"""The precision-analysis dashboard (browse/dashboards/precision.py): accuracy against peak
output throughput and against cost per million output tokens, per configuration, a chart per
model with its frontier; and its one line where no accuracy was measured. Accuracy rows are
inserted into a test database under the dashboard's own column name."""

from __future__ import annotations

import itertools
import json
import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import cases_of
from test_dashboards import pages
from test_datasette import make_record

from pytest_profllm.browse import filters, sql_functions
from pytest_profllm.browse.dashboards import BY_NAME, View
from pytest_profllm.browse.dashboards.precision import (
    NO_ACCURACY_SELECTED,
    accuracy_of,
    frontier,
)
from pytest_profllm.browse.filters import Selection
from pytest_profllm.results.ingest import ingest
from pytest_profllm.results.table import quote
from pytest_profllm.run.cost import case_cost

QWEN = "Qwen/Qwen3-8B"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
# model, configuration, precision settings, output tok/s at its two loads, accuracy
CONFIGURATIONS: list[tuple[str, str, dict[str, Any], tuple[float, float], float]] = [
    (QWEN, "bf16", {"dtype": "bfloat16"}, (100.0, 180.0), 0.80),
    (QWEN, "fp8", {"dtype": "bfloat16", "quantization": "fp8"}, (150.0, 260.0), 0.78),
    (QWEN, "fp8-kv", {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"},
     (140.0, 250.0), 0.70),  # slower and less accurate than fp8: off both frontiers
    (LLAMA, "bf16", {"dtype": "bfloat16"}, (90.0, 160.0), 0.75),
    (LLAMA, "fp8", {"dtype": "bfloat16", "quantization": "fp8"}, (130.0, 230.0), 0.74),
]
PRICE = 2.5
DURATION = 10.0


def records() -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Serve records at two loads per configuration, priced; and the accuracy (by run id) of
    one accuracy run per configuration, on the same server."""
    made = []
    accuracy = {}
    for index, (model, name, settings, throughputs, score) in enumerate(CONFIGURATIONS):
        suite = "bench_precision.yaml"
        server = f"{model.split('/')[0].lower()}-{name}"
        for load, throughput in enumerate((*throughputs, None)):
            kind = "accuracy" if throughput is None else f"rate{load}"
            record = make_record(f"{server}-{kind}", "s1", f"{suite}::{server}::{kind}",
                                 f"2026-01-01T10:{index:02d}:{load:02d}+00:00",
                                 throughput=(throughput or 1.0) / 10, request_rate=load + 1.0)
            record["config"]["server"] = {"model": model, **settings}
            record["runtime"]["server_key"] = f"key-{server}"
            if throughput is None:
                # An accuracy case's results, as lm-eval's metrics land in them.
                record["results"] = {"completed": 10, "failed": 0}
                record["config"]["benchmark"] = {"kind": "accuracy"}
                accuracy[record["run_id"]] = score
            else:
                record["results"]["total_output_tokens"] = int(throughput * DURATION)
                record["cost"] = case_cost(PRICE, {
                    "duration": DURATION, "total_output_tokens": int(throughput * DURATION)},
                    1, "leased")
            made.append(record)
    return made, accuracy


def database(folder: Path, with_accuracy: bool) -> Path:
    made, accuracy = records()
    for record in made:
        if with_accuracy and record["run_id"] in accuracy:
            record["results"].update(acc=accuracy[record["run_id"]], acc_stderr=0.01)
        (folder / f"{record['run_id']}.json").write_text(json.dumps(record))
    path = folder / "results.db"
    ingest(path, sorted(folder.glob("*.json")))
    return path


def open_db(path: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(path)
    sql_functions.register(connection)
    yield connection
    connection.close()


@pytest.fixture
def measured(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    yield from open_db(database(tmp_path, with_accuracy=True))


@pytest.fixture
def unmeasured(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    yield from open_db(database(tmp_path, with_accuracy=False))


def precision(connection: sqlite3.Connection, query: str = "") -> View:
    schema = filters.read_schema(connection)
    selection = Selection.parse(urllib.parse.parse_qsl(query), schema)
    return BY_NAME["precision"].build(connection, schema, selection, {})


def test_accuracy_against_throughput_and_cost_with_a_frontier_per_model(
    measured: sqlite3.Connection,
) -> None:
    view = precision(measured)
    assert sorted(view.charts) == [
        "precision-cost-Qwen_Qwen3_8B", "precision-cost-meta_llama_Llama_3_1_8B_Instruct",
        "precision-throughput-Qwen_Qwen3_8B",
        "precision-throughput-meta_llama_Llama_3_1_8B_Instruct"]
    assert view.notes == []
    qwen = {row["configuration"]: row
            for row in view.charts["precision-throughput-Qwen_Qwen3_8B"]["data"]["values"]}
    # Named by the precision settings that differ between the model's configurations.
    assert set(qwen) == {"quantization=default · kv_cache_dtype=default",
                         "quantization=fp8 · kv_cache_dtype=default",
                         "quantization=fp8 · kv_cache_dtype=fp8"}
    fp8 = qwen["quantization=fp8 · kv_cache_dtype=default"]
    # The accuracy run and the serve runs of one server are one configuration; its x is the
    # highest throughput of its loads, its cost the lowest.
    assert (fp8["accuracy"], fp8["output_throughput"]) == (0.78, 260.0)
    assert fp8["usd_per_million_output_tokens"] == pytest.approx(
        PRICE / 3600 * DURATION / (260 * DURATION) * 1e6, abs=1e-4)
    assert fp8["accuracy_run_id"] == "qwen-fp8-accuracy"
    assert fp8["throughput_run_id"] == "qwen-fp8-rate1"
    line = view.charts["precision-throughput-Qwen_Qwen3_8B"]["layer"][0]["data"]["values"]
    assert [(p["output_throughput"], p["accuracy"]) for p in line] == [(180.0, 0.8),
                                                                     (260.0, 0.78)]
    cost_line = view.charts["precision-cost-Qwen_Qwen3_8B"]["layer"][0]["data"]["values"]
    assert [p["accuracy"] for p in cost_line] == [0.78, 0.8]  # cheapest first
    table = {(row["model"], row["configuration"]): row for row in view.tables[0].rows}
    assert table[(QWEN, "quantization=fp8 · kv_cache_dtype=fp8")]["frontier"] == ""
    assert table[(QWEN, "quantization=fp8 · kv_cache_dtype=default")]["frontier"] == (
        "throughput + cost")


def test_without_accuracy_it_says_so_in_one_line_and_still_lists_throughput_and_cost(
    unmeasured: sqlite3.Connection,
) -> None:
    view = precision(unmeasured)
    # The accuracy columns are the table's own (standard metrics): no run of the selection
    # filled them.
    assert view.notes == [NO_ACCURACY_SELECTED]
    assert view.charts == {}
    rows = view.tables[0].rows
    assert len(rows) == len(CONFIGURATIONS)
    assert all(row["accuracy"] is None and row["output_throughput"] for row in rows)
    assert {row["gpu_hour_price_usd"] for row in rows} == {PRICE}


def test_a_filter_narrows_the_configurations(measured: sqlite3.Connection) -> None:
    view = precision(measured, f"f.server_model={urllib.parse.quote(LLAMA)}")
    assert {row["model"] for row in view.tables[0].rows} == {LLAMA}
    assert len(view.charts) == 2


def test_frontier_keeps_only_the_points_nothing_beats() -> None:
    rows: list[dict[str, float | None]] = [
        {"x": 1.0, "y": 0.9}, {"x": 2.0, "y": 0.8}, {"x": 2.0, "y": 0.7}, {"x": 3.0, "y": 0.8},
        {"x": None, "y": 1.0}]
    assert frontier(rows, "x", "y", x_higher_is_better=True) == [rows[0], rows[3]]
    assert frontier(rows, "x", "y", x_higher_is_better=False) == [rows[0]]


def test_the_page_shows_the_note_and_the_charts(tmp_path: Path) -> None:
    without = tmp_path / "without"
    without.mkdir()
    (empty,) = pages(database(without, with_accuracy=False), "/results/-/dashboards/precision")
    assert empty.status_code == 200
    assert "No accuracy cases in this selection" in empty.text
    with_ = tmp_path / "with"
    with_.mkdir()
    (drawn,) = pages(database(with_, with_accuracy=True), "/results/-/dashboards/precision")
    assert drawn.status_code == 200
    assert "precision-throughput-Qwen_Qwen3_8B" in drawn.text
    assert "No accuracy cases" not in drawn.text


def test_the_example_suite_is_dtype_by_quantization_by_kv_cache_dtype() -> None:
    suite = Path(__file__).resolve().parents[1] / "benchmarks" / "precision"
    cases = cases_of(suite / "bench_precision.yaml")
    settings = {(c.server["dtype"], c.server.get("quantization"), c.server["kv_cache_dtype"])
                for c in cases}
    assert settings == set(itertools.product(("bfloat16", "float16"), (None, "fp8"),
                                             ("auto", "fp8")))
    assert len({c.server_key for c in cases}) == 8


def test_accuracy_outside_the_selection_is_named_as_such(measured: sqlite3.Connection) -> None:
    # The accuracy runs have no throughput: a throughput bound leaves them out.
    view = precision(measured, "min.output_throughput=1")
    assert view.notes == [NO_ACCURACY_SELECTED]
    assert view.charts == {}
    assert len(view.tables[0].rows) == len(CONFIGURATIONS)


def test_accuracy_is_the_first_of_lm_evals_metrics_a_database_has() -> None:
    def schema(*names: str) -> filters.Schema:
        return filters.Schema(types={name: "REAL" for name in names}, axes=(), sessions=())

    both = f"coalesce({quote('acc')}, {quote('exact_match')})"
    assert accuracy_of(schema("acc", "exact_match", "output_throughput")) == both
    assert accuracy_of(schema("exact_match")) == quote("exact_match")
    # A database from before accuracy cases: the page says so in one line.
    assert accuracy_of(schema("output_throughput")) is None


def test_each_figure_is_its_linked_runs_from_the_latest_session(tmp_path: Path) -> None:
    # Once, the table showed 1721.5, a median over two sessions, linked to a
    # run whose output_throughput was 1867.35.
    made, accuracy = records()
    for record in made:
        if record["run_id"] in accuracy:
            record["results"].update(acc=accuracy[record["run_id"]], acc_stderr=0.01)
    again = []
    for record in made:
        if record["run_id"].startswith("qwen-fp8-rate"):
            for repeat, factor in enumerate((1.1, 1.3, 1.2)):  # s2: three repeats, faster
                copy = json.loads(json.dumps(record))
                copy.update(run_id=f"{record['run_id']}-s2-{repeat}", session_id="s2",
                            timestamp=f"2026-01-02T10:00:{repeat:02d}+00:00")
                copy["results"]["output_throughput"] *= factor
                again.append(copy)
    for record in [*made, *again]:
        (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    ingest(tmp_path / "results.db", sorted(tmp_path.glob("*.json")))
    for connection in open_db(tmp_path / "results.db"):
        figures = dict(connection.execute(
            "SELECT run_id, output_throughput FROM benchmark_runs"))
        for query in ("", "session=all", "session=s1&session=s2"):
            rows = precision(connection, query).tables[0].rows
            linked = [r for r in rows if r["throughput_run_id"]]
            assert linked and all(
                r["output_throughput"] == round(figures[r["throughput_run_id"]], 1)
                for r in linked), query
        # By default the suite's latest session, s2 (its fp8 loads alone): its median
        # repeat (1.2 x 260), not a median over s1 and s2.
        (fp8,) = precision(connection).tables[0].rows
        assert (fp8["output_throughput"], fp8["throughput_run_id"]) == (
            312.0, "qwen-fp8-rate1-s2-2")


def test_one_point_per_accuracy_task_and_metric(tmp_path: Path) -> None:
    # Once, profllm_arithmetic_mc (acc 0.275) and profllm_arithmetic_gen
    # (exact_match 0.0) on one server were drawn as one `accuracy` of 0.1375.
    made, accuracy = records()
    for record in made:
        if record["run_id"] in accuracy:
            record["results"].update(acc=accuracy[record["run_id"]], acc_stderr=0.01)
    (first,) = [r for r in made if r["run_id"] == "qwen-fp8-accuracy"]
    generated = json.loads(json.dumps(first))
    generated["run_id"] = "qwen-fp8-accuracy-gen"
    generated["results"] = {"completed": 10, "failed": 0, "exact_match": 0.0}
    made.append(generated)
    for record in made:
        (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    ingest(tmp_path / "results.db", sorted(tmp_path.glob("*.json")))
    with sqlite3.connect(tmp_path / "results.db") as connection:
        connection.execute("UPDATE benchmark_runs SET accuracy_task = 'profllm_arithmetic_' || "
                           "CASE WHEN run_id LIKE '%-gen' THEN 'gen' ELSE 'mc' END "
                           "WHERE run_id LIKE '%accuracy%'")
    for connection in open_db(tmp_path / "results.db"):
        view = precision(connection)
        fp8 = sorted((r["task"], r["metric"], r["accuracy"], r["accuracy_run_id"])
                     for r in view.tables[0].rows
                     if r["model"] == QWEN
                     and r["configuration"] == "quantization=fp8 · kv_cache_dtype=default")
        assert fp8 == [("profllm_arithmetic_gen", "exact_match", 0.0, "qwen-fp8-accuracy-gen"),
                       ("profllm_arithmetic_mc", "acc", 0.78, "qwen-fp8-accuracy")]
        drawn = {r["accuracy"] for chart in view.charts.values()
                 for r in chart["data"]["values"]}
        assert 0.39 not in drawn  # the mean of the two, no task's score
        assert "precision-throughput-Qwen_Qwen3_8B_profllm_arithmetic_gen_exact_match" in (
            view.charts)
        title = view.charts["precision-throughput-Qwen_Qwen3_8B_profllm_arithmetic_mc_acc"][
            "title"]
        assert "profllm_arithmetic_mc acc" in json.dumps(title)
