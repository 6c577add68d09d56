"""The terminal summary: one line per case with the figures people look at first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytest_profllm.gates.summary import terminal_lines
from pytest_profllm.session.controller import ControllerSession

_WAIT_WORTH_SAYING_S = 0.5


def summary_lines(controller: ControllerSession, width: int | None = None) -> list[str]:
    """The summary, its table within `width` characters (the terminal's) where it can be."""
    records = controller.records
    # The same table as the Markdown summary: key metrics, and the gate where one ran.
    lines = terminal_lines(records, width)
    engine = controller.identity.engine
    lines.append(f"engine: {engine.name} ({engine.reason})")
    # Servers of this session: a resumed case's record tells of an earlier session's server.
    session = controller.identity.session_id
    ours = [r for r in records if r.get("session_id", session) == session]
    lost = [r for r in controller.lost_records if r.get("session_id", session) == session]
    lines += _server_lines(ours, lost) + _load_core_lines(ours) + _client_limit_lines(ours)
    settings = controller.settings
    if settings.out_dir is not None:
        unwritten, resumed = controller.unwritten, controller.resumed
        missing = f" ({unwritten} could not be written)" if unwritten else ""
        written = len(records) - unwritten - resumed
        lines.append(f"{written} record(s) in {settings.out_dir}{missing}")
        if resumed:
            lines.append(
                f"{resumed} case(s) resumed: already measured by an earlier session, their "
                "records are in this summary and the database"
            )
    if controller.interrupted_by is not None:
        lines.append(
            f"interrupted by {controller.interrupted_by}: every case that finished has its "
            "record; cases cut short are `error`"
        )
    if settings.db_path is not None and controller.loaded_rows is not None:
        lines.append(
            f"{controller.loaded_rows} row(s) loaded into {settings.db_path} "
            f"(table benchmark_runs); browse with: datasette {settings.db_path}"
        )
    return lines


def _server_lines(
    records: list[dict[str, Any]], lost: Sequence[dict[str, Any]] = ()
) -> list[str]:
    # The lease wait is the server's, shared by all its cases: count each server once. It is
    # reported here and kept out of every measurement (the load starts after the server is up).
    # A case whose worker crashed has the record built at its setup, before the server it may
    # have started: such servers cannot be counted, and the line says so.
    servers: dict[tuple[Any, ...], float] = {}
    for record in records:
        runtime = record.get("runtime") or {}
        if runtime.get("server_started_at") is None:
            continue
        lifetime = (runtime.get("worker"), runtime.get("server_key"), runtime["server_started_at"])
        servers[lifetime] = runtime.get("lease_wait_s") or 0.0
    crashed = sorted({
        str((record.get("runtime") or {}).get("worker") or "?")
        for record in lost
        if (record.get("runtime") or {}).get("server_started_at") is None
    })
    if not servers and not crashed:
        return []
    workers = {worker for worker, _, _ in servers}
    line = f"{len(servers)} server start(s) on {len(workers)} worker(s)"
    waited = [wait for wait in servers.values() if wait >= _WAIT_WORTH_SAYING_S]
    if waited:
        line += (
            f"; {len(waited)} waited for GPUs or ports, {sum(waited):.1f} s in all "
            f"(longest {max(waited):.1f} s), not counted in any measurement"
        )
    if crashed:
        line += (
            f"; not counted: any server crashed worker(s) {', '.join(crashed)} started in "
            "the case they crashed in"
        )
    return [line]


def _load_core_lines(records: list[dict[str, Any]]) -> list[str]:
    # Each case's load waited for its host cores (hosts/cores.py) before it was measured.
    waits = [(r.get("runtime") or {}).get("load_core_wait_s") or 0.0 for r in records]
    waited = [wait for wait in waits if wait >= _WAIT_WORTH_SAYING_S]
    if not waited:
        return []
    return [
        f"{len(waited)} load(s) waited for host cores, {sum(waited):.1f} s in all "
        f"(longest {max(waited):.1f} s), not counted in any measurement"
    ]


def _client_limit_lines(records: list[dict[str, Any]]) -> list[str]:
    # The client's open-file limit held some loads under the connections they would have
    # opened (hosts/descriptors.py): said once per distinct cap, with how many cases.
    limits: dict[str, int] = {}
    for record in records:
        if line := (record.get("runtime") or {}).get("client_limit"):
            limits[line] = limits.get(line, 0) + 1
    return [f"{line} ({count} case(s))" for line, count in limits.items()]
