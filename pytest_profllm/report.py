"""The terminal summary: one line per case with the figures people look at first."""

from __future__ import annotations

from typing import Any

from pytest_profllm.session import ControllerSession

_WAIT_WORTH_SAYING_S = 0.5

_COLUMNS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.2f}"),
)


def summary_lines(controller: ControllerSession) -> list[str]:
    records = controller.records
    width = max(len(record["case_id"]) for record in records)
    header = f"{'case':<{width}}  {'status':<7}" + "".join(f"{name:>13}" for name, _, _ in _COLUMNS)
    lines = [header]
    for record in records:
        results = record.get("results") or {}
        offline = _offline_cells(record, results)
        if offline is not None:
            lines.append(f"{record['case_id']:<{width}}  {record['status']:<7}  {offline}")
            continue
        cells = "".join(
            f"{(fmt.format(results[key]) if results.get(key) is not None else '-'):>13}"
            for _, key, fmt in _COLUMNS
        )
        lines.append(f"{record['case_id']:<{width}}  {record['status']:<7}{cells}")
    engine = controller.identity.engine
    lines.append(f"engine: {engine.name} ({engine.reason})")
    lines += _server_lines(records)
    settings = controller.settings
    if settings.out_dir is not None:
        lines.append(f"{len(records)} record(s) in {settings.out_dir}")
    if settings.db_path is not None and controller.loaded_rows is not None:
        lines.append(
            f"{controller.loaded_rows} row(s) loaded into {settings.db_path} "
            f"(table benchmark_runs); browse with: datasette {settings.db_path}"
        )
    return lines


def _offline_cells(record: dict[str, Any], results: dict[str, Any]) -> str | None:
    """An offline case's own figures, in place of the serving columns it lacks."""
    kind = ((record.get("config") or {}).get("benchmark") or {}).get("kind", "serve")
    if kind == "throughput" and results.get("tokens_per_second") is not None:
        return (
            f"throughput: {results['tokens_per_second']:.1f} tok/s, "
            f"{results['requests_per_second']:.2f} req/s"
        )
    if kind == "latency" and results.get("avg_latency_ms") is not None:
        return (
            f"latency: avg {results['avg_latency_ms']:.1f} ms, "
            f"p99 {results['p99_latency_ms']:.1f} ms"
        )
    return None if kind == "serve" else f"{kind}: -"


def _server_lines(records: list[dict[str, Any]]) -> list[str]:
    # The lease wait is the server's, shared by all its cases: count each server once. It is
    # reported here and kept out of every measurement (the load starts after the server is up).
    servers: dict[tuple[Any, ...], float] = {}
    for record in records:
        runtime = record.get("runtime") or {}
        if runtime.get("server_started_at") is None:
            continue
        lifetime = (runtime.get("worker"), runtime.get("server_key"), runtime["server_started_at"])
        servers[lifetime] = runtime.get("lease_wait_s") or 0.0
    if not servers:
        return []
    workers = {worker for worker, _, _ in servers}
    line = f"{len(servers)} server start(s) on {len(workers)} worker(s)"
    waited = [wait for wait in servers.values() if wait >= _WAIT_WORTH_SAYING_S]
    if waited:
        line += (
            f"; {len(waited)} waited for GPUs or ports, {sum(waited):.1f} s in all "
            f"(longest {max(waited):.1f} s), not counted in any measurement"
        )
    return [line]
