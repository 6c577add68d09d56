"""The regression gate's pieces, in-process: what `regression:` accepts, fingerprints, verdicts
from bootstrap intervals, baselines from a results.db and from a folder of records, and the
history's change points (the command and the Datasette aggregate)."""

from __future__ import annotations

import argparse
import gzip
import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.browse.change_points import ChangePointsAggregate
from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.gates.baseline import Baseline
from pytest_profllm.gates.history import Point, change_points
from pytest_profllm.gates.regression import GateSettings, describe, judge_regression
from pytest_profllm.gates.samples import RunSamples
from pytest_profllm.gates.summary import KEY_METRICS, markdown, terminal_lines
from pytest_profllm.options import parse_confidence, parse_resamples
from pytest_profllm.plan.regression import gated_metric, parse_regression, parse_tolerance
from pytest_profllm.plan.suite import SuiteError, validate_suite
from pytest_profllm.results import gate_tables as tables
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.record_files import write_record, write_requests


@pytest.mark.parametrize(
    ("text", "expected"), [("5%", 0.05), (" 12.5 % ", 0.125), (10, 0.1), (None, 0.05)]
)
def test_parse_tolerance_reads_percentages(text: object, expected: float) -> None:
    assert parse_tolerance(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["five", "-1%", "100%", True])
def test_parse_tolerance_rejects_bad_input(text: object) -> None:
    with pytest.raises(ValueError, match="tolerance"):
        parse_tolerance(text)


def test_regression_block_as_mapping_or_list() -> None:
    assert parse_regression({"output_throughput": "5%", "p99_ttft_ms": "10%"}) == {
        "output_throughput": 0.05,
        "p99_ttft_ms": 0.1,
    }
    # Defaults: 5 % per repeat, 10 % per request (docs/regression-gates.md).
    assert parse_regression(["median_tpot_ms", "request_throughput"]) == {
        "median_tpot_ms": 0.1,
        "request_throughput": 0.05,
    }


def test_each_metric_knows_its_direction_and_comparison() -> None:
    throughput = gated_metric("output_throughput", 0.05)
    assert throughput.higher_is_better and throughput.per_repeat
    latency = gated_metric("p99.9_itl_ms", 0.05)
    assert not latency.higher_is_better and latency.latency == "itl"
    assert latency.statistic == "99.9"


def test_unknown_metric_in_a_suite_is_one_line_naming_it() -> None:
    data = {"server": {"model": "m"}, "regression": {"p99_ttf_ms": "5%"}}
    with pytest.raises(SuiteError, match=r"bench_x.yaml: regression: .*cannot gate 'p99_ttf_ms'"):
        validate_suite(data, "bench_x.yaml")


def test_throughput_gate_needs_repeats() -> None:
    data = {"server": {"model": "m"}, "regression": {"output_throughput": "5%"}}
    with pytest.raises(SuiteError, match="set 'repeat: 2' or more"):
        validate_suite(data, "bench_x.yaml")
    assert validate_suite({**data, "repeat": 2}, "bench_x.yaml").regression == {
        "output_throughput": 0.05
    }


def test_parse_confidence_and_resamples() -> None:
    assert parse_confidence("0.95") == 0.95
    assert parse_resamples("500") == 500
    for parse, text in (
        (parse_confidence, "1.0"),
        (parse_confidence, "x"),
        (parse_resamples, "10"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def record(run_id: str, session: str, *, seed: int = 0, version: str = "0.1.0") -> dict[str, Any]:
    return {
        "schema_version": 1,
        "run_id": run_id,
        "session_id": session,
        "suite": "gate",
        "source": "bench_gate.yaml",
        "case_id": "bench_gate.yaml::sim-8b::random",
        "nodeid": "bench_gate.yaml::sim-8b::random",
        "timestamp": f"2026-11-22T{session}",
        "duration": 1.0,
        "status": "passed",
        "engine": {"name": "sim", "reason": "test", "version": version},
        "config": {"server": {"model": "sim-8b"}, "benchmark": {"num_prompts": 20, "seed": seed}},
        "results": {"output_throughput": 100.0},
        "system": {"host": "box", "platform": "Linux", "python": "3.11"},
        "runtime": {"worker": "main", "server_key": "0123456789ab", "gpus": ["0"]},
    }


def test_fingerprint_leaves_out_the_seed_and_optionally_the_version() -> None:
    base = digests(record("a", "s1"))
    assert digests(record("b", "s2", seed=7)) == base
    other_version = digests(record("c", "s3", version="0.2.0"))
    assert other_version[0] != base[0] and other_version[1] == base[1]
    bigger = record("d", "s4")
    bigger["config"]["benchmark"]["num_prompts"] = 40
    assert digests(bigger)[1] != base[1]


def runs(values: list[np.ndarray], throughputs: list[float]) -> list[RunSamples]:
    return [
        RunSamples(f"r{i}", "s", "t", {"output_throughput": t}, {"tpot": v})
        for i, (v, t) in enumerate(zip(values, throughputs, strict=True))
    ]


SETTINGS = GateSettings(resamples=1000)


def test_latency_verdicts_need_the_whole_interval_beyond_the_tolerance() -> None:
    rng = np.random.default_rng(3)
    base = runs([rng.normal(10, 0.5, 200) for _ in range(2)], [100, 100])
    slower = runs([rng.normal(11.5, 0.5, 200) for _ in range(2)], [87, 87])
    same = runs([rng.normal(10, 0.5, 200) for _ in range(2)], [101, 99])
    faster = runs([rng.normal(8.5, 0.5, 200) for _ in range(2)], [115, 116])
    tpot = gated_metric("median_tpot_ms", 0.05)
    verdict = judge_regression(tpot, slower, base, SETTINGS)
    assert verdict.decision == "regressed"
    assert verdict.ci_low is not None and verdict.ci_low > 0.05
    assert verdict.change == pytest.approx(0.15, abs=0.02)
    assert judge_regression(tpot, same, base, SETTINGS).decision == "unchanged"
    assert judge_regression(tpot, faster, base, SETTINGS).decision == "improved"
    # A 15 % change against a 20 % tolerance is inside it, whatever the interval.
    within = judge_regression(gated_metric("median_tpot_ms", 0.2), slower, base, SETTINGS)
    assert within.decision == "unchanged"
    assert judge_regression(tpot, slower, [], SETTINGS).decision == "no-baseline"
    text = describe(verdict)
    assert text.startswith("median_tpot_ms regressed: baseline 10")
    assert "99% CI +" in text and "tolerance 5%" in text


def test_throughputs_are_compared_per_repeat_and_lower_is_worse() -> None:
    base = runs([np.ones(3)] * 3, [100, 101, 99])
    slower = runs([np.ones(3)] * 3, [86, 87, 86.5])
    noisy = runs([np.ones(3)] * 3, [80, 120, 100])
    throughput = gated_metric("output_throughput", 0.05)
    verdict = judge_regression(throughput, slower, base, SETTINGS)
    assert verdict.decision == "regressed" and verdict.samples == 3
    assert verdict.ci_high is not None and verdict.ci_high < -0.05
    assert judge_regression(throughput, noisy, base, SETTINGS).decision == "unchanged"
    # One repeat left (the other invalid) has no spread to judge the noise by: not judged,
    # never `unchanged`, and said why.
    alone = judge_regression(throughput, slower[:1], base, SETTINGS)
    assert alone.decision == "not-judged" and alone.ci_low is None and alone.change is not None
    assert alone.reason


def requests_rows(ttft_s: float, count: int = 4) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "success": True,
            "output_tokens": 5,
            "ttft_s": ttft_s,
            "latency_s": ttft_s + 0.04,
            "itl_s": [0.01] * 4,
        }
        for i in range(count)
    ]


def test_baseline_from_a_database_is_the_latest_other_session(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    tables.load_runs(db, [(record("old", "10:00:00"), requests_rows(0.2))])
    tables.load_runs(db, [(record("new", "11:00:00"), requests_rows(0.1))])
    failed = record("bad", "12:00:00")
    failed["status"] = "error"
    tables.load_runs(db, [(failed, requests_rows(0.5))])
    baseline = Baseline(db)
    found = baseline.runs_for(record("now", "13:00:00", seed=3))
    assert [run.run_id for run in found] == ["new"]
    assert found[0].latencies["ttft"].tolist() == pytest.approx([100.0] * 4)
    assert found[0].latencies["tpot"].tolist() == pytest.approx([10.0] * 4)
    assert found[0].results == {"output_throughput": 100.0}
    # Its own session is never its baseline; another engine version is, only if asked.
    assert [r.run_id for r in baseline.runs_for(record("x", "11:00:00"))] == ["old"]
    assert Baseline(db).runs_for(record("y", "13:00:00", version="9")) == []
    assert [
        r.run_id for r in Baseline(db, False).runs_for(record("y", "13:00:00", version="9"))
    ] == ["new"]
    rows = sqlite3.connect(db).execute(f"select count(*) from {tables.SAMPLES}").fetchone()
    assert rows == (12,)


def test_baseline_from_a_folder_of_records(tmp_path: Path) -> None:
    write_record(tmp_path, record("a", "10:00:00"))
    write_requests(tmp_path, "a", requests_rows(0.3))
    found = Baseline(tmp_path).runs_for(record("now", "13:00:00"))
    assert [run.run_id for run in found] == ["a"]
    assert found[0].latencies["e2el"].tolist() == pytest.approx([340.0] * 4)


def test_a_request_file_in_a_baseline_folder_that_expands_too_far_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pytest_profllm.limits.MAX_REQUEST_FILE_BYTES", 1 << 20)
    write_record(tmp_path, record("a", "10:00:00"))
    (tmp_path / "a.requests.jsonl.gz").write_bytes(gzip.compress(b"{}\n" * (1 << 20)))
    # Before: decompressed whole into memory (a few MB of gzip can hold terabytes).
    with pytest.raises(ValueError, match=r"a.requests.jsonl.gz\b"):
        Baseline(tmp_path).runs_for(record("now", "13:00:00"))
    (tmp_path / "a.requests.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"a.requests.jsonl.gz: not a request file: "):
        Baseline(tmp_path).runs_for(record("now", "13:00:00"))


def test_markdown_summary_has_the_gate_columns() -> None:
    gated = record("a", "10:00:00")
    gated["regression"] = [
        {
            "metric": "median_tpot_ms",
            "decision": "regressed",
            "change": 0.15,
            "ci_low": 0.12,
            "ci_high": 0.18,
        }
    ]
    text = markdown([gated], "sim", "base/results.db")
    assert "| case | status | req/s |" in text
    assert "| regressed | median_tpot_ms +15.0% [+12.0, +18.0] |" in text
    assert "Regression gate: 1 regressed, against base/results.db." in text
    # A record written before `decision` (one a resumed session holds) says `verdict`.
    gated["regression"] = [{"verdict" if key == "decision" else key: value
                            for key, value in gated["regression"][0].items()}]
    assert markdown([gated], "sim", "base/results.db") == text


def _serve_and_capacity() -> list[dict[str, Any]]:
    serve = record("a", "10:00:00")
    serve["case_id"] = "benchmarks/bench_gate.yaml::qwen3-8b-seqs32::random-rate-inf-r3"
    serve["results"] = {"request_throughput": 34.29, "output_throughput": 548.7,
                        "median_ttft_ms": 291.1, "median_tpot_ms": 16.79, "p99_itl_ms": 55.9}
    serve["regression"] = [
        {"metric": metric, "decision": "regressed", "change": 0.2, "ci_low": 0.195,
         "ci_high": 0.207}
        for metric in ("output_throughput", "p99_e2el_ms", "mean_ttft_ms", "median_tpot_ms")
    ]
    capacity = record("b", "10:00:00")
    capacity["case_id"] = "benchmarks/bench_capacity.yaml::qwen3-8b-seqs8::capacity-random"
    capacity["config"]["benchmark"] = {"kind": "capacity"}
    capacity["results"] = {"request_throughput": 23.01, "capacity": 26.33}
    capacity["capacity"] = {"capacity": 26.33, "bracket": [26.33, 28.1],
                            "limit": "median_ttft_ms"}
    return [serve, capacity]  # fmt: skip


def test_the_terminal_table_fits_the_terminal_and_heads_capacity_as_such() -> None:
    records = _serve_and_capacity()
    wide = terminal_lines(records)
    # As wide as it is (about 250 characters before), a capacity under `capacity`, not `offline`.
    assert "offline" not in wide[0]
    assert wide[0].split()[-5:] == ["ITL", "p99", "ms", "capacity", "gate", "change", "vs",
                                    "baseline"][-5:]  # fmt: skip
    assert "26.33 req/s [26.33, 28.1] median_ttft_ms" in wide[2]
    for width in (80, 100, 120):
        lines = terminal_lines(records, width)
        assert max(len(line) for line in lines) <= width, "\n".join(lines)
        text = "\n".join(lines)
        # Nothing said is lost: the case, the gate and every change, the capacity; a figure
        # left out is named.
        for case in records:
            assert case["case_id"] in text
        assert "regressed" in text and text.count("+20.0% [+19.5, +20.7]") == 4
        assert "26.33 req/s [26.33, 28.1] median_ttft_ms" in text
        assert "capacity" in text
    # At 120 the ids keep their rows and the last figures give way, named; at 80 the ids go
    # on lines of their own, which leaves room for every figure.
    left_out = "(to fit 120 columns, left out: ITL p99 ms, TPOT p50 ms)"
    assert terminal_lines(records, 120)[-1] == left_out
    narrow = terminal_lines(records, 80)
    assert narrow[2] == records[0]["case_id"] and narrow[3].split()[:2] == ["passed", "34.29"]
    assert "ITL p99 ms" in narrow[1] and not narrow[-1].startswith("(to fit")


def test_columns_no_case_has_are_left_out() -> None:
    (capacity,) = _serve_and_capacity()[1:]
    header = terminal_lines([capacity])[0].split("  ")
    assert [name.strip() for name in header if name.strip()] == [
        "case", "status", "req/s", "capacity"
    ]  # fmt: skip


def shifted(shift: float, seed: int) -> list[Point]:
    rng = np.random.default_rng(seed)
    values = [*rng.normal(100, 1, 8), *rng.normal(100 * (1 + shift), 1, 5)]
    return [Point(f"s{i:03d}", float(v), f"run{i}") for i, v in enumerate(values)]


def test_change_points_find_the_shifted_session_and_no_other() -> None:
    for seed in range(5):
        found = change_points(shifted(-0.15, seed))
        assert [(c.index, c.point.run_id) for c in found] == [(8, "run8")]
        assert found[0].change == pytest.approx(-0.15, abs=0.03)
        assert change_points(shifted(0.0, seed)) == []
    assert change_points(shifted(-0.15, 0)[:3]) == []  # too short a history


def test_datasette_aggregate_averages_sessions_and_orders_them() -> None:
    aggregate = ChangePointsAggregate()
    for point in reversed(shifted(0.2, 1)):
        aggregate.step(point.key, point.value)
        aggregate.step(point.key, point.value)  # a second repeat of the session
    aggregate.step("s999", None)
    found = json.loads(aggregate.finalize())
    assert [f["session"] for f in found] == ["s008"]


def test_history_command_prints_and_stores_change_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "results.db"
    for point in shifted(-0.2, 2):
        run = record(point.run_id, point.key)
        run["timestamp"] = point.key
        run["results"] = {"output_throughput": point.value}
        tables.load_runs(db, [(run, None)])
    assert cli_main(["history", str(db), "--metric", "output_throughput"]) == 0
    out = capsys.readouterr().out
    assert "output_throughput: 1 change point(s) in 1 history(ies)" in out
    assert "from session s008 (run run8)" in out
    stored = (
        sqlite3.connect(db)
        .execute(f"select run_id, round(change, 1) from {tables.CHANGE_POINTS}")
        .fetchall()
    )
    assert stored == [("run8", -0.2)]
    assert cli_main(["history", str(tmp_path / "none.db")]) == 2
    assert "no such database" in capsys.readouterr().err


def test_datasette_canned_query_finds_the_change(tmp_path: Path) -> None:
    import asyncio

    from datasette.app import Datasette

    db = tmp_path / "results.db"
    for point in shifted(-0.2, 2):
        run = record(point.run_id, point.key)
        run["results"] = {"output_throughput": point.value}
        tables.load_runs(db, [(run, None)])
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("create table t (x)").connection.close()

    async def fetch() -> list[Any]:
        datasette = Datasette([str(db), str(other)])
        urls = [
            "/results/metric_change_points.json?metric=output_throughput&_shape=array",
            "/other/metric_change_points.json",
            "/-/plugins.json",
        ]
        return [await datasette.client.get(url) for url in urls]

    found, elsewhere, plugins = asyncio.run(fetch())
    assert found.status_code == 200, found.text
    (row,) = found.json()
    assert row["sessions"] == 13
    assert [c["session"] for c in json.loads(row["change_points"])] == ["s008"]
    assert elsewhere.status_code == 404  # only where the gate's tables are
    hooks = {hook for p in plugins.json() if p["name"] == "pytest-profllm" for hook in p["hooks"]}
    assert {"prepare_connection", "canned_queries"} <= hooks


def test_a_deep_record_in_a_baseline_folder_is_one_line(tmp_path: Path) -> None:
    # Deeper than limits.py allows. Once: RecursionError, an INTERNALERROR of the session.
    write_record(tmp_path, record("a", "10:00:00"))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError) as caught:
        Baseline(tmp_path).describe()
    deep = tmp_path / "deep.json"
    assert str(caught.value) == f"{deep}: the file nests JSON deeper than 64 levels"


_WORD = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")),
                min_size=1, max_size=30)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    width=st.integers(60, 250),  # a terminal: status, req/s and the gate fit in 60
    cases=st.lists(
        st.tuples(_WORD, st.sampled_from(["passed", "failed", "error", "skipped"]),
                  st.lists(st.floats(0, 1e7), max_size=5), st.lists(_WORD, max_size=4),
                  st.booleans()),
        min_size=1, max_size=6,
    ),
)  # fmt: skip
def test_any_table_keeps_to_the_width_but_for_what_cannot_be_cut(
    width: int, cases: list[tuple[str, str, list[float], list[str], bool]]
) -> None:
    records = []
    for index, (case_id, status, figures, changes, capacity) in enumerate(cases):
        made = record(str(index), "10:00:00")
        made.update(case_id=case_id, status=status)
        made["results"] = dict(zip([key for _, key, _ in KEY_METRICS], figures, strict=False))
        made["regression"] = [{"metric": text, "decision": "regressed", "change": None}
                              for text in changes]  # fmt: skip
        if capacity:
            made["config"]["benchmark"] = {"kind": "capacity"}
            made["capacity"] = {"capacity": 1.0, "bracket": [1.0, 2.0], "limit": "p99_ttft_ms"}
        records.append(made)
    lines = terminal_lines(records, width)
    text = "\n".join(lines)
    for made in records:
        assert made["case_id"] in text and made["status"] in text
    uncut = {made["case_id"] for made in records} | {
        f"{text} -" for made in records for text in (v["metric"] for v in made["regression"])
    }
    for line in lines:
        # A line over the width holds one thing that is never cut: an id, or one change.
        assert len(line) <= width or any(part in line for part in uncut), (width, line)
