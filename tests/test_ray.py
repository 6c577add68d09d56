"""Suites on a Ray cluster (`--profllm-ray`): local clusters of logical GPUs on this host
(`ray.cluster_utils.Cluster`: a head without GPUs and two nodes of 2 GPUs each), the simulated
engine, real pytest runs. The tests marked `ray` run with `pytest -m ray` (as CI does)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import pytest_argv, run_records, run_suites
from ray_cluster import LocalCluster, local_cluster

from conftest import sim_processes
from pytest_profllm.results.rows import record_row

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="no Ray: pip install -e '.[test,ray]'")
NODE_GPUS = 2

SUITE_TP = """
server:
  model: Qwen/Qwen3-8B
  tensor_parallel_size: [1, 2]
  max_num_seqs: [8, 16]
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 8
  request_rate: [inf, 24]
thresholds:
  completed: {min: 6}
"""


@pytest.fixture(autouse=True)
def run_apart(request: pytest.FixtureRequest) -> None:
    """Ray's daemons and workers listen on random ports of the ephemeral range, where other
    tests' servers may be about to bind theirs: the Ray tests run in a session of their own."""
    if request.node.get_closest_marker("ray") and "ray" not in request.config.option.markexpr:
        pytest.skip("Ray tests run apart from the others: pytest -m ray")


def running_groups() -> list[psutil.Process]:
    """Ray workers running one of our server groups (Ray titles a worker after its task)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any("ray::run_group" in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture
def own_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lease pool of the test's own: its logical GPUs are no one else's, and it must not
    queue behind other tests' leases on the host-wide one."""
    directory = tmp_path / "pool"
    monkeypatch.setenv("PROFLLM_POOL_DIR", str(directory))
    return directory


@pytest.fixture
def two_nodes(own_pool: Path) -> Iterator[LocalCluster]:
    """A Ray cluster on this host: a head without GPUs, two nodes of 2 logical GPUs each
    (their workers inherit the test's pool folder); its Ray daemons are gone after the test."""
    with local_cluster(nodes=2, gpus=NODE_GPUS) as cluster:
        yield cluster


def db_equals_files(pytester: pytest.Pytester, written: list[dict[str, Any]]) -> None:
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        db.row_factory = sqlite3.Row
        rows = {row["run_id"]: dict(row) for row in db.execute("select * from benchmark_runs")}
    assert set(rows) == {record["run_id"] for record in written}
    for record in written:
        expected = record_row(record)
        stored = rows[record["run_id"]]
        differ = {k: (stored[k], v) for k, v in expected.items() if not same_cell(stored[k], v)}
        assert not differ


def same_cell(stored: Any, value: Any) -> bool:
    """SQLite keeps a value by its column's affinity: 24.0 in a text column reads '24.0'."""
    if stored == value:
        return True
    try:
        return float(stored) == float(value)
    except (TypeError, ValueError):
        return False


@pytest.mark.ray
@needs_ray
def test_suite_at_tp_1_and_2_on_two_nodes(
    pytester: pytest.Pytester, ports: str, two_nodes: LocalCluster
) -> None:
    pytester.makefile(".yaml", bench_tp=SUITE_TP)
    result = run_suites(pytester, ports, f"--profllm-ray={two_nodes.address}", cache=False)
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines([f"profllm: engine sim *Ray cluster {two_nodes.address}"])
    written = run_records(pytester)
    # Every case's record came back once.
    assert sorted(r["nodeid"] for r in written) == sorted(
        f"bench_tp.yaml::qwen3-8b-tp{tp}-seqs{seqs}::random-rate{rate}"
        for tp in (1, 2)
        for seqs in (8, 16)
        for rate in ("-inf", "24")
    )
    assert {r["runtime"]["node_id"] for r in written} <= set(two_nodes.nodes)
    # Each server started once: one start per server key, and GPUs as many as its tp.
    servers: dict[str, set[tuple[Any, ...]]] = {}
    for record in written:
        runtime = record["runtime"]
        assert len(runtime["gpus"]) == record["config"]["server"]["tensor_parallel_size"]
        servers.setdefault(runtime["server_key"], set()).add(
            (
                runtime["node_id"],
                tuple(runtime["gpus"]),
                runtime["server_started_at"],
                runtime["server_stopped_at"],
            )
        )
    assert len(servers) == 4
    assert all(len(lifetimes) == 1 for lifetimes in servers.values())
    # No two live servers shared a logical GPU of one node.
    lifetimes = [next(iter(lifetime)) for lifetime in servers.values()]
    for (node_a, gpus_a, start_a, stop_a), (node_b, gpus_b, start_b, stop_b) in combinations(
        lifetimes, 2
    ):
        if node_a == node_b and start_a < stop_b and start_b < stop_a:
            assert not set(gpus_a) & set(gpus_b), (gpus_a, gpus_b)
    db_equals_files(pytester, written)


SUITE_LONG = """
server:
  model: Qwen/Qwen3-8B
  tensor_parallel_size: 2
  max_num_seqs: [8, 16]
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 8
  request_rate: 4
  seed: [1, 2, 3, 4]
"""


@pytest.mark.ray
@needs_ray
@pytest.mark.parametrize("retry", [False, True], ids=["fail", "retry"])
def test_node_removed_mid_run(
    pytester: pytest.Pytester, ports: str, two_nodes: LocalCluster, retry: bool
) -> None:
    # Two servers of 2 GPUs: one on each node. Four cases of about 1.5 s each.
    pytester.makefile(".yaml", bench_long=SUITE_LONG)
    argv = pytest_argv(ports, f"--profllm-ray={two_nodes.address}", "-rA", cache=False)
    if retry:
        argv.append("--profllm-ray-retry")
    results = pytester.path / "results"
    log = pytester.path / "pytest.log"
    with log.open("wb") as output:
        driver = subprocess.Popen(
            argv,
            cwd=pytester.path,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        # The first record written: its node is the one to lose, mid-way through its group.
        deadline = time.monotonic() + 120
        first: dict[str, Any] | None = None
        while first is None and time.monotonic() < deadline and driver.poll() is None:
            found = sorted(results.glob("*.json")) if results.exists() else []
            first = json.loads(found[0].read_text()) if found else None
            time.sleep(0.05)
        assert first is not None, log.read_text()
        lost_id = first["runtime"]["node_id"]
        two_nodes.remove(lost_id)
        driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    output_text = log.read_text()
    written = {r["nodeid"]: r for r in run_records(pytester)}
    assert len(written) == 8, output_text
    finished = [r for r in written.values() if r["status"] == "passed"]
    unfinished = [r for r in written.values() if r["status"] != "passed"]
    # The finished cases' records are all there, from the node that survived or from the lost
    # node before it went.
    assert first["nodeid"] in {r["nodeid"] for r in finished}
    if retry:
        assert not unfinished, output_text
        retried = [r for r in finished if r["runtime"]["node_id"] != lost_id]
        assert len(retried) > 4  # the lost node's unfinished cases ran on the other one
        assert f"ran again on another node after Ray node {lost_id[:12]}" in output_text
        assert driver.returncode == 0
    else:
        assert unfinished, output_text
        lost_name = f"Ray node {lost_id[:12]}"
        for record in unfinished:
            assert record["status"] == "error"
            assert record["runtime"]["node_id"] == lost_id
            assert lost_name in record["message"]
        messages = [r["message"] for r in unfinished]
        assert any("was lost while this case ran" in m for m in messages), messages
        assert f"{lost_name} " in output_text
        assert "Traceback" not in output_text
        assert driver.returncode == 1
    # Nothing of ours keeps running: no simulated server, no Ray worker running a group.
    deadline = time.monotonic() + 15
    while (sim_processes(ports) or running_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sim_processes(ports)
    assert not running_groups()


MARKED_TEST = """
import pytest

@pytest.mark.profllm(
    server={"model": "Qwen/Qwen3-8B", "max_num_seqs": [4, 8]},
    benchmark={"num_prompts": 4, "random_input_len": 16, "random_output_len": 4},
)
def test_marked(profllm_result):
    # The test's own assert fails one case: the record says failed there, in both runs.
    assert profllm_result.case.server["max_num_seqs"] == 4
"""
SUITE_GATES = """
server:
  model: Qwen/Qwen3-8B
  tensor_parallel_size: [1, 2]
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: [8, 16]
thresholds:
  total_output_tokens: {max: 60}
"""


@pytest.mark.ray
@needs_ray
# -x stops at the first failure, the same one in both runs (cases run in the same order).
@pytest.mark.parametrize("selection", [[], ["-k", "tp2 or marked", "-x"]], ids=["all", "k-x"])
def test_same_cases_ids_and_verdicts_with_and_without_ray(
    pytester: pytest.Pytester, ports: str, own_pool: Path, selection: list[str]
) -> None:
    pytester.makefile(".yaml", bench_gates=SUITE_GATES)
    pytester.makepyfile(test_marked=MARKED_TEST)

    def outcome(ray: list[str]) -> tuple[dict[str, int], dict[str, Any]]:
        result = run_suites(pytester, ports, "-rA", *ray, *selection, cache=False)
        verdicts = {
            r["nodeid"]: (
                r["case_id"],
                r["status"],
                [(v["metric"], v["bound"], v["passed"]) for v in r["threshold_results"]],
            )
            for r in run_records(pytester)
        }
        result.stdout.no_fnmatch_line("*Traceback*")
        for path in (pytester.path / "results").iterdir():
            if path.is_file():
                path.unlink()
        return result.parseoutcomes(), verdicts

    started = time.time()
    here = outcome([])
    on_ray = outcome(["--profllm-ray=local"])
    assert on_ray == here
    assert here[1]  # something ran, and something failed on a threshold or an assert
    assert any(status == "failed" for _, status, _ in here[1].values())
    assert not orphaned_ray_daemons(started)


def orphaned_ray_daemons(since: float) -> list[psutil.Process]:
    """Ray daemons started since then whose starter is gone (a `local` cluster left behind)."""
    found = []
    for process in psutil.process_iter(["name", "create_time"]):
        if process.info["name"] not in ("raylet", "gcs_server"):
            continue
        if process.info["create_time"] < since:
            continue
        try:
            parents = process.parents()
        except psutil.Error:
            continue
        if not any("pytest" in " ".join(p.cmdline()) for p in parents if _readable(p)):
            found.append(process)
    return found


def _readable(process: psutil.Process) -> bool:
    try:
        process.cmdline()
    except psutil.Error:
        return False
    return True


def test_ray_option_without_ray_installed_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("import sys\nsys.modules['ray'] = None  # as if not installed\n")
    result = pytester.runpytest_subprocess("--profllm-ray=local")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --profllm-ray needs Ray in this environment: pip install -e '.[ray]' in the "
         "pytest-profllm clone"]
    )


@needs_ray
def test_ray_with_xdist_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--profllm-ray=local", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --profllm-ray: the Ray cluster runs the server groups*"])


def test_datasette_facets_on_the_node_where_records_name_one(tmp_path: Path) -> None:
    import asyncio

    from datasette.app import Datasette
    from test_datasette import make_record

    from pytest_profllm.results.store import load_records

    on_ray = make_record("r1", "s1", "bench_a.yaml::m::w", "2026-01-01T00:00:00")
    on_ray["runtime"]["node_id"] = "a1b2c3"
    load_records(tmp_path / "ray.db", [on_ray])
    # A database loaded before records named their node has no such column.
    with sqlite3.connect(tmp_path / "old.db") as db:
        db.execute(
            "create table benchmark_runs (run_id text primary key, suite text, "
            "engine text, status text, server_model text, timestamp text)"
        )
        db.execute("insert into benchmark_runs values ('r0', 's', 'sim', 'passed', 'm', 't')")

    async def facets(name: str) -> tuple[int, set[str]]:
        datasette = Datasette([str(tmp_path / f"{name}.db")])
        response = await datasette.client.get(f"/{name}/benchmark_runs.json")
        return response.status_code, set(response.json().get("facet_results", {}))

    status, ray_facets = asyncio.run(facets("ray"))
    assert status == 200 and "runtime_node_id" in ray_facets
    status, old_facets = asyncio.run(facets("old"))
    assert status == 200 and "runtime_node_id" not in old_facets and "status" in old_facets


SUITE_TRACED = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 4
  request_rate: 24
"""


@pytest.mark.ray
@needs_ray
def test_a_node_joins_each_requests_server_span(
    pytester: pytest.Pytester, ports: str, two_nodes: LocalCluster
) -> None:
    # The node runs its group through the worker session, whose receiver the node's server
    # exports to (--profllm-trace-requests auto traces the simulated engine).
    pytester.makefile(".yaml", bench_traced=SUITE_TRACED)
    result = run_suites(pytester, ports, f"--profllm-ray={two_nodes.address}", cache=False)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["runtime"]["node_id"] in two_nodes.nodes
    view = record["server_view"]
    assert view["server_spans_joined_share"] == 1.0, view["spans_problem"]
    assert view["span_receiver"]["spans_kept"] == 6
    assert record["results"]["client_overhead_ttft_p99_ms"] is not None
    with gzip.open(pytester.path / "results" / f"{record['run_id']}.requests.jsonl.gz") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 6
    assert all(row["server_ttft_ms"] is not None and row["trace_id"] for row in rows)
