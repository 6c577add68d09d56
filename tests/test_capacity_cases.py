"""Capacity cases through real pytest runs on the simulated engine: two configurations searched
in parallel under -n 2, each record's capacity with its bracket and probes, the threshold on
it, and a slowed simulator (PROFLLM_SIM_SLOWDOWN) whose lower capacity the gate calls
regressed."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

import pytest
from helpers import assert_invalid, run_records, run_suites

from pytest_profllm.browse import filters
from pytest_profllm.browse.dashboards import BY_NAME
from pytest_profllm.browse.filters import Selection
from pytest_profllm.browse.run_page import run_page

# Short requests at modest rates (under 40 req/s, which a loaded 2-core host paces): a probe
# of 40 requests takes a few seconds. The batch
# limit sets the capacity: 2 sequences carry half the requests per second that 4 do.
SUITE = """
server:
  model: sim-8b
  max_num_seqs: [2, 4]
  enable_prefix_caching: false
benchmark:
  kind: capacity
  num_prompts: 40
  random_input_len: 128
  random_output_len: 12
  slo: {median_ttft_ms: 120}
  # One run per load (no confirming run, no extension of an unsure one): these tests are
  # about the path, not the noise (test_capacity.py extends unsure probes).
  search: {low: 8, high: 128, precision: 25%, confirm: 1, min_duration_s: 0.5, max_time_s: 60,
           max_extension: 1}
thresholds:
  capacity: {min: 4}
regression:
  capacity: 10%
"""


def _interval(record: dict[str, Any]) -> tuple[float, float]:
    start = datetime.fromisoformat(record["timestamp"]).timestamp()
    return start, start + record["duration"]


def test_two_configurations_search_in_parallel(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_cap=SUITE)
    result = run_suites(pytester, ports, "-n", "2", "-rA", cache=False)
    result.assert_outcomes(passed=2)
    records = {r["config"]["server"]["max_num_seqs"]: r for r in run_records(pytester)}
    small, large = records[2], records[4]
    for record in (small, large):
        search = record["capacity"]
        assert record["validity"] == "valid"
        assert record["results"]["capacity"] == search["capacity"] == search["bracket"][0]
        assert search["bracket"][1] is None or search["bracket"][1] > search["bracket"][0]
        assert search["limit"] == "median_ttft_ms"
        assert {p["decision"] for p in search["probes"]} <= {"meets", "misses", "unsure"}
        # No server's view: a probe's runs each have a window of their own; the record says so.
        assert "capacity searches" in record["server_view"]["problem"]
        assert record["system"].get("server_ttft_mean_ms") is None
        assert any(p["decision"] == "meets" and p["load"] == search["capacity"]
                   for p in search["probes"])
        assert all(p["readings"][0]["slo"] == "median_ttft_ms" for p in search["probes"])
        # The simulator is traced by default: each probe's requests were joined to their
        # server spans, and the kept probe's tail is in the record, as a case's is.
        assert record["results"]["client_overhead_ttft_p99_ms"] >= 0.0
    # More sequences carry more load; both searches ran at once, on their own workers.
    assert large["results"]["capacity"] > small["results"]["capacity"]
    (start_a, end_a), (start_b, end_b) = _interval(small), _interval(large)
    assert start_a < end_b and start_b < end_a
    assert small["runtime"]["worker"] != large["runtime"]["worker"]
    # The terminal summary and the database carry the capacity and what limits it.
    result.stdout.fnmatch_lines(["*capacity*req/s*"])
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = db.execute(
            "SELECT capacity, capacity_low, capacity_high, capacity_limit FROM benchmark_runs"
        ).fetchall()
    assert len(rows) == 2 and all(row[3] == "median_ttft_ms" for row in rows)
    # The capacity dashboard draws one bar per configuration with its bracket; the run page
    # shows the probes.
    db = sqlite3.connect(pytester.path / "results" / "results.db")
    schema = filters.read_schema(db)
    shown = BY_NAME["capacity"].build(db, schema, Selection.parse([], schema), {})
    bars = shown.charts["capacity"]["data"]["values"]
    assert sorted(bar["capacity"] for bar in bars) == sorted(
        r["results"]["capacity"] for r in (small, large))
    assert len({bar["series"] for bar in bars}) == 2
    # The bars' labels name themselves (`configuration=...`); an axis title over such long
    # labels is drawn across them.
    (y_axis,) = [layer["encoding"]["y"] for layer in shown.charts["capacity"]["layer"]
                 if "axis" in layer["encoding"]["y"]]
    assert y_axis["axis"]["title"] is None
    page = run_page(db, small["run_id"])
    assert page is not None and page.capacity is not None
    assert page.capacity.startswith(f"Capacity {small['results']['capacity']:.4g} req/s")
    # Every probe, then the search's answer run once more after it.
    assert len(page.probes) == len(small["capacity"]["probes"]) + 1
    assert page.probes[-1]["number"] == "re-check"
    # What the re-check decided: a steady server's tail makes one run near the capacity
    # either meet or be unsure, never read as met when it was unsure.
    recheck = small["capacity"]["recheck"]
    said = ("it met every SLO, so it agrees." if recheck["decision"] == "meets" else
            f"it decided unsure ({recheck['reason']}): not a miss, so the capacity stands")
    assert (
        f"Re-checked after the search at {small['results']['capacity']:.4g} req/s: {said}"
        in page.capacity)
    assert "capacity-median_ttft_ms" in page.charts


def test_a_slowed_simulator_lowers_the_capacity_and_the_gate_says_regressed(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the virtual clock: the gate's verdict on a capacity is under test, not the real-time
    # client (the test above searches in real time); the slowdown prices every step there too.
    pytester.makefile(".yaml", bench_cap=SUITE.replace("[2, 4]", "4"))
    base = run_suites(pytester, ports, "--profllm-baseline=base/results.db",
                      "--profllm-baseline-update", "--profllm-sim-clock=virtual", out="base",
                      cache=False)
    base.assert_outcomes(passed=1)
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "2.0")
    slow = run_suites(pytester, ports, "--profllm-baseline=base/results.db",
                      "--profllm-sim-clock=virtual", out="slow", cache=False)
    slow.assert_outcomes(failed=1)
    (before,) = run_records(pytester, "base")
    (after,) = run_records(pytester, "slow")
    assert after["results"]["capacity"] < before["results"]["capacity"]
    (verdict,) = after["regression"]
    assert verdict["metric"] == "capacity" and verdict["decision"] == "regressed"
    assert verdict["ci_high"] < -0.10
    slow.stdout.fnmatch_lines(["*capacity regressed*"])


def test_a_search_the_host_held_back_is_invalid_never_failed(
    pytester: pytest.Pytester, ports: str
) -> None:
    # No client sends within a microsecond of its schedule: every probe falls behind, as on a
    # host kept busy, and none is measured again. Before, the search found no capacity and the
    # case failed its threshold (`capacity = missing < min 4`) with a valid badge.
    suite = SUITE.replace("[2, 4]", "4").replace(
        "low: 8, high: 128, precision: 25%", "low: 16, high: 64, precision: 90%")
    pytester.makefile(".yaml", bench_cap=suite)
    result = run_suites(pytester, ports, "--profllm-max-schedule-lag=0.001",
                        "--profllm-remeasure=0", cache=False)
    assert_invalid(result, 1)
    result.stdout.fnmatch_lines(["*invalid measurement: the host limited the capacity search*"])
    (record,) = run_records(pytester)
    assert record["status"] == "invalid" and record["validity"] == "invalid"
    assert "client fell behind" in record["message"]
    assert all(probe["host"] for probe in record["capacity"]["probes"])


# A serve suite and a capacity suite with the same server settings: in real time the capacity
# case runs on the serve case's server, started once (the example run's capacity suite shares
# the smoke suite's servers this way; the tests' example run puts capacity on the virtual clock).
SHARED_SERVER = """
server:
  model: sim-8b
  max_num_seqs: 4
  enable_prefix_caching: false
"""


def test_a_capacity_case_runs_on_the_server_a_serve_case_started(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_a_serve=SHARED_SERVER + "benchmark: {num_prompts: 4, random_input_len: 16,"
        " random_output_len: 4}\n",
        bench_b_cap=SHARED_SERVER + "benchmark: {kind: capacity, num_prompts: 8,"
        " random_input_len: 16, random_output_len: 4, slo: {median_ttft_ms: 2000},"
        " search: {low: 32, high: 64, precision: 50%, confirm: 1, min_duration_s: 0.2,"
        " max_probes: 2}}\n",
    )
    result = run_suites(pytester, ports, "-n", "0", cache=False)
    result.assert_outcomes(passed=2)
    records = run_records(pytester)
    assert sorted(r["config"]["benchmark"].get("kind") or "serve" for r in records) == [
        "capacity", "serve"
    ]
    assert {r["engine"]["clock"] for r in records} == {"real"}
    assert len({r["runtime"]["server_key"] for r in records}) == 1
    assert len({r["runtime"]["server_started_at"] for r in records}) == 1
    assert len(list((pytester.path / "results" / "logs").glob("*.log"))) == 1
