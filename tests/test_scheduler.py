"""Grouping and ordering of cases by server, and the controller's view of server lifetimes,
as plain functions (the end-to-end proof under xdist is in test_grouping.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.pool import SessionTurns
from pytest_profllm.options import Settings
from pytest_profllm.session.controller import ControllerSession
from pytest_profllm.session.identity import RunIdentity
from pytest_profllm.session.report import summary_lines
from pytest_profllm.session.xdist_scheduling import (
    Scope,
    group_by_server,
    read_scopes,
    scope_name,
    server_ranks,
    work_order,
    write_scopes,
)


@dataclass
class FakeCase:
    server_key: str


@dataclass
class FakeItem:
    name: str
    key: str | None  # None: not a benchmark case


def case_of(item: FakeItem) -> Any:
    return None if item.key is None else FakeCase(item.key)


def names(items: list[FakeItem]) -> list[str]:
    return [item.name for item in items]


def test_group_by_server_moves_each_servers_cases_up_to_its_first() -> None:
    items = [
        FakeItem("a1", "A"),
        FakeItem("plain1", None),
        FakeItem("b1", "B"),
        FakeItem("a2", "A"),
        FakeItem("plain2", None),
        FakeItem("b2", "B"),
        FakeItem("a3", "A"),
    ]
    group_by_server(items, case_of)
    assert names(items) == ["a1", "a2", "a3", "plain1", "b1", "b2", "plain2"]


def test_group_by_server_keeps_an_already_grouped_order() -> None:
    items = [FakeItem("a1", "A"), FakeItem("a2", "A"), FakeItem("b1", "B")]
    group_by_server(items, case_of)
    assert names(items) == ["a1", "a2", "b1"]


def test_work_order_one_unit_per_server_largest_gpu_need_first() -> None:
    scopes = {
        "s.yaml::tp1::w1": Scope("k1", 1),
        "s.yaml::tp4::w1": Scope("k4", 4),
        "s.yaml::tp1::w2": Scope("k1", 1),
        "t.py::test_x[tp2]": Scope("k2", 2),
        "u.yaml::tp4-again::w1": Scope("k4", 4),  # same server from another file
    }
    nodeids = [*scopes, "t.py::test_plain"]
    units = work_order(nodeids, scopes)
    assert list(units.values()) == [
        ["s.yaml::tp4::w1", "u.yaml::tp4-again::w1"],
        ["t.py::test_x[tp2]"],
        ["s.yaml::tp1::w1", "s.yaml::tp1::w2"],
        ["t.py::test_plain"],
    ]


def test_without_a_scope_map_units_fall_back_to_the_parent() -> None:
    assert scope_name("s.yaml::server::workload", {}) == "s.yaml::server"
    assert scope_name("t.py::test_x[a/b]", {}) == "t.py"


def test_scope_map_round_trips_and_missing_means_empty(tmp_path: Path) -> None:
    assert read_scopes(None) == {}
    assert read_scopes(tmp_path) == {}
    write_scopes(tmp_path, "gw0", {"a::b": Scope("k", 2)})
    assert read_scopes(tmp_path) == {"a::b": Scope("k", 2)}
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_half_written_scope_map_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "gw0.json").write_text('{"a::b": ["k", ')
    write_scopes(tmp_path, "gw1", {"a::b": Scope("k", 1)})
    assert read_scopes(tmp_path) == {"a::b": Scope("k", 1)}


def record(case: str, started: float, stopped: float | None, wait: float = 0.0) -> dict[str, Any]:
    return {
        "run_id": case,
        "case_id": case,
        "status": "passed",
        "results": {},
        "runtime": {
            "worker": "gw0",
            "server_key": "k",
            "server_started_at": started,
            "server_stopped_at": stopped,
            "lease_wait_s": wait,
        },
    }


def controller(tmp_path: Path) -> ControllerSession:
    settings = Settings(
        out_dir=tmp_path,
        db_path=None,
        engine="sim",
        gpus=4,
        ports=range(20000, 20100),
        startup_timeout=10,
        lease_timeout=10,
        suite_glob="bench_*.yaml",
    )
    return ControllerSession(settings, RunIdentity("s", EngineChoice("sim", "test", None)))


def test_a_servers_stop_time_reaches_its_earlier_records_and_files(tmp_path: Path) -> None:
    session = controller(tmp_path)
    session.receive(record("c1", 100.0, None), None)
    session.receive(record("c2", 100.0, None), None)
    session.receive(record("other", 200.0, None), None)  # another start of the same key
    session.receive(record("c3", 100.0, 150.0), None)
    on_disk = {
        path.stem: json.loads(path.read_text())["runtime"]["server_stopped_at"]
        for path in tmp_path.glob("*.json")
    }
    assert on_disk == {"c1": 150.0, "c2": 150.0, "c3": 150.0, "other": None}


def test_summary_counts_each_server_once_and_reports_its_lease_wait(tmp_path: Path) -> None:
    session = controller(tmp_path)
    session.receive(record("c1", 100.0, None, wait=2.5), None)
    session.receive(record("c2", 100.0, 150.0, wait=2.5), None)
    lines = summary_lines(session)
    assert (
        "1 server start(s) on 1 worker(s); 1 waited for GPUs or ports, 2.5 s in all "
        "(longest 2.5 s), not counted in any measurement"
    ) in lines



def test_summary_says_it_cannot_count_the_server_a_crashed_worker_started(
    tmp_path: Path,
) -> None:
    # A crashed case's record was built at its setup, before the server it started: the
    # summary counts what it saw and names the worker whose start it could not see.
    session = controller(tmp_path)
    session.receive(record("c1", 100.0, 150.0), None)
    placeholder = record("victim", 0.0, None)
    placeholder["runtime"].update(worker="gw1", server_started_at=None)
    placeholder["timestamp"] = "2026-01-01T00:00:00+00:00"
    session.started("bench_x.yaml::victim", placeholder)
    session.lost("bench_x.yaml::victim", "worker 'gw1' crashed while running 'victim'")
    lines = summary_lines(session)
    assert (
        "1 server start(s) on 1 worker(s); not counted: any server crashed worker(s) gw1 "
        "started in the case they crashed in"
    ) in lines

def busy(pids: list[list[int]]) -> Any:
    answers = iter(pids)

    def probe(uuids: Any) -> list[nvml.GpuProcess]:
        return [nvml.GpuProcess("GPU-1", pid, 1024.0) for pid in next(answers)]

    return probe


def test_idle_gpus_start_at_once() -> None:
    assert nvml.wait_until_idle(["GPU-1"], True, 5, probe=busy([[]])) < 1


def test_a_foreign_process_fails_at_once_when_told_not_to_wait() -> None:
    with pytest.raises(nvml.GpuBusy, match=r"pid 4242 on GPU-1 \(1024 MiB\).*busy-gpus fail"):
        nvml.wait_until_idle(["GPU-1"], False, 5, probe=busy([[4242]]))


def test_a_foreign_process_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_BUSY_POLL_S", 0.01)
    waited = nvml.wait_until_idle(["GPU-1"], True, 5, probe=busy([[7], [7], []]))
    assert 0 < waited < 5


def test_a_foreign_process_that_stays_fails_after_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nvml, "_BUSY_POLL_S", 0.01)
    with pytest.raises(nvml.GpuBusy, match=r"pid 7 .*still there after"):
        nvml.wait_until_idle(["GPU-1"], True, 0.05, probe=busy([[7]] * 1000))


def test_no_nvml_means_no_processes() -> None:
    assert nvml.compute_processes([]) == []


def test_server_ranks_follow_the_work_order_and_skip_unleased_servers() -> None:
    scopes = {
        "s::tp1::a": Scope("k1", 1),
        "s::tp4::a": Scope("k4", 4),
        "s::tp2::a": Scope("k2", 2),
        "s::tp2::b": Scope("k2", 2),
    }
    nodeids = [*scopes, "t.py::test_plain"]
    assert server_ranks(nodeids, scopes, skipped=set()) == {"k4": 0, "k2": 1, "k1": 2}
    # A server whose cases are all skipped takes no lease, so no turn either.
    assert server_ranks(nodeids, scopes, skipped={"s::tp4::a"}) == {"k2": 0, "k1": 1}
    assert server_ranks(nodeids, scopes, skipped={"s::tp2::a"}) == {"k4": 0, "k2": 1, "k1": 2}


def test_a_turn_waits_for_the_one_before_it_and_no_longer_than_asked(tmp_path: Path) -> None:
    turns = SessionTurns(tmp_path / "turns" / "session")
    assert turns.wait_for(0, timeout=5) == 0.0
    assert 0.1 <= turns.wait_for(1, timeout=0.1) < 2  # rank 0 never came: capped
    turns.taken(0)
    assert turns.wait_for(1, timeout=5) < 0.1
