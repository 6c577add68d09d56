"""The "Running now" page of a results database (`/{database}/-/running`) and the JSON it
refreshes from every 2 s (`/{database}/-/running.json`): the cases a session runs now, read
from the live folder beside the database file (`live/`, load/live_status.py's files), with
their stage, progress and charts of their telemetry so far; and the cases that ended in the
last minute, each with a link to its run page.

The processes write their files by rename, so a read sees a whole file or the one before; a
file that vanished between the listing and the read (a client process that ended) is skipped.
A file is believed only as far as load/live_status.py's `read_live` checks it: one that fails
is left out with a note the page lists, and a case whose process died is not shown running.
Nothing here writes, and nothing reads the database but whether a finished run is loaded yet
(the session loads its records as it ends).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from datasette.utils import tilde_encode
from datasette.utils.asgi import Response

from pytest_profllm.browse import charts
from pytest_profllm.browse.pages import PageError, guarded, not_ours, render_page, visible
from pytest_profllm.load import live_status
from pytest_profllm.results.table import TABLE

REFRESH_MS = 2000
# The charts: id, title, the y axis, and the dataset the JSON gives it (one row a point).
CHARTS = (
    ("running-throughput", "Output throughput", "output tokens/s", "throughput"),
    ("running-ttft", "Median TTFT (last 256 requests)", "ms", "ttft"),
    ("running-kv", "KV-cache use", "KV cache used", "kv"),
    ("running-queue", "Running and waiting requests", "requests", "queue"),
)


def live_folder(database: Any) -> Path | None:
    path = getattr(database, "path", None)
    return Path(path).parent / live_status.LIVE_FOLDER if path else None


def running_now(folder: Path | None, now: float | None = None) -> dict[str, Any]:
    """What the page shows, from the live files in `folder`: the running cases, the finished
    ones of the last minute, and the charts' points (`case`, `t_s`, `series`, `value`)."""
    now = time.time() if now is None else now
    read = (live_status.read_live(folder) if folder is not None and folder.is_dir()
            else live_status.LiveRead())
    statuses = read.cases
    by_case: dict[str, list[dict[str, Any]]] = {}
    for status in statuses:
        by_case.setdefault(str(status.get("case")), []).append(status)
    running: list[dict[str, Any]] = []
    finished: list[dict[str, Any]] = []
    data: dict[str, list[dict[str, Any]]] = {name: [] for *_, name in CHARTS}
    for case, parts in sorted(by_case.items()):
        # The process that runs the case names its worker; its client processes do not.
        lead = max(parts, key=lambda part: (bool(part.get("worker")),
                                            len(part.get("history") or [])))
        if lead.get("stage") == live_status.FINISHED:
            ended = lead.get("ended") or lead.get("updated") or 0.0
            if now - ended <= live_status.FINISHED_KEEP_S and lead.get("run_id"):
                finished.append({"case": case, "run_id": lead["run_id"], "ended": ended})
                # Its whole series stays drawn for its minute: the curves its run page has.
                _points(f"{case} (ended)", lead, parts, data)
            continue
        running.append(_row(case, lead, parts, now))
        _points(case, lead, parts, data)
    return {"now": now, "refresh_ms": REFRESH_MS, "running": running,
            "finished": sorted(finished, key=lambda f: -f["ended"]), "data": data,
            "notes": read.notes}


def _row(case: str, lead: dict[str, Any], parts: list[dict[str, Any]], now: float
         ) -> dict[str, Any]:
    def total(name: str) -> int:
        return sum(p[name] for p in parts)

    ttfts = [p["median_ttft_ms"] for p in parts if p.get("median_ttft_ms") is not None]
    started = [p["load_started"] for p in parts if p.get("load_started") is not None]
    done = total("done")
    elapsed = now - min(started) if started else None
    # Each figure finite or null, whatever the files' numbers add up to: running.json stays
    # JSON (a NaN or an Infinity in it is not).
    return {name: charts.clean(value) for name, value in {
        "case": case,
        "worker": lead.get("worker", ""),
        "stage": lead.get("stage", ""),
        "detail": lead.get("detail", ""),
        "stage_for_s": max(0.0, now - (lead["stage_since"] or now)),
        "warming_up": any(p.get("warming_up") for p in parts),
        "total": total("total"),
        "done": done,
        "failed": total("failed"),
        "achieved_rate": done / elapsed if elapsed else None,
        "target_rate": lead.get("target_rate"),
        # A client process's share is a sample of the load: their medians' mean is near.
        "median_ttft_ms": sum(ttfts) / len(ttfts) if ttfts else None,
        "running": lead.get("running"),
        "waiting": lead.get("waiting"),
        "kv_cache_usage": lead.get("kv_cache_usage"),
    }.items()}


def _points(case: str, lead: dict[str, Any], parts: list[dict[str, Any]],
            data: dict[str, list[dict[str, Any]]]) -> None:
    """The case's telemetry series (its lead process samples the server) and its running
    median TTFT (from the process that measures most of it), one row a point."""
    for point in lead.get("series") or []:
        t_s = point.get("t_s")
        if t_s is None:
            continue
        for dataset, name, label in (("throughput", "output_throughput", case),
                                     ("kv", "kv_cache_usage", case),
                                     ("queue", "running", f"{case} running"),
                                     ("queue", "waiting", f"{case} waiting")):
            value = charts.clean(point.get(name))
            if value is not None:
                data[dataset].append({"case": case, "series": label, "t_s": t_s,
                                      "value": value})
    latency = max((p.get("latency") or [] for p in parts), key=len, default=[])
    for point in latency:
        value = charts.clean(point.get("median_ttft_ms"))
        if value is not None and point.get("t_s") is not None:
            data["ttft"].append({"case": case, "series": case, "t_s": point["t_s"],
                                 "value": value})


def chart_specs() -> dict[str, dict[str, Any]]:
    """The page's charts, their data named (the page's script replaces it as it refreshes)."""
    specs = {}
    for chart_id, title, axis, dataset in CHARTS:
        chart = charts.spec([], title=title, height=charts.SMALL_HEIGHT,
                            mark={"type": "line", "tooltip": True},
                            encoding={
                                "x": charts.field("t_s", "quantitative",
                                                  "seconds since sampling started",
                                                  scale={"zero": True}),
                                "y": charts.field("value", "quantitative", axis, **(
                                    {"axis": {"format": "%"}} if dataset == "kv" else {})),
                                "color": charts.field("series", "nominal", "")})
        chart["data"] = {"name": dataset}
        specs[chart_id] = chart
    return specs


def _loaded(connection: sqlite3.Connection, run_ids: list[str]) -> set[str]:
    if not run_ids:
        return set()
    exists = connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (TABLE,)).fetchone()
    if exists is None:
        return set()
    marks = ", ".join("?" for _ in run_ids)
    rows = connection.execute(f"SELECT run_id FROM [{TABLE}] WHERE run_id IN ({marks})",
                              run_ids)
    return {str(row[0]) for row in rows}


async def _database(datasette: Any, request: Any) -> tuple[str, Any]:
    """The served database the URL names, when the actor may see it (as every page of ours
    asks); it need not hold records yet: a first session loads its records as it ends."""
    name = request.url_vars["database"]
    database = datasette.databases.get(name)
    if database is None or name == "_internal":
        raise PageError(404, f"No database named {name!r} is served")
    if not await visible(datasette, request.actor, name):
        raise PageError(403, f"You do not have permission to view {name}")
    # No table yet is a first session's database; a table of another tool's is not ours.
    if await database.table_exists(TABLE) and (why := await not_ours(database)):
        raise PageError(404, f"{name} is not a results database: {why}")
    return name, database


async def _payload(datasette: Any, name: str, database: Any) -> dict[str, Any]:
    payload = running_now(live_folder(database))
    run_ids = [f["run_id"] for f in payload["finished"]]
    loaded = await database.execute_fn(lambda connection: _loaded(connection, run_ids))
    base = datasette.urls.database(name) + "/-/run/"
    for entry in payload["finished"]:
        entry["run_url"] = base + tilde_encode(entry["run_id"])
        entry["loaded"] = entry["run_id"] in loaded
    return payload


async def running_json(datasette: Any, request: Any) -> Response:
    name, database = await _database(datasette, request)
    return Response.json(await _payload(datasette, name, database),
                         headers={"cache-control": "no-store"})


async def running_view(datasette: Any, request: Any) -> Response:
    name, database = await _database(datasette, request)
    return await render_page(datasette, request, "profllm_running.html", {
        "database": name,
        "json_url": datasette.urls.database(name) + "/-/running.json",
        "specs": chart_specs(),
        "chart_ids": [chart_id for chart_id, *_ in CHARTS],
        "initial": await _payload(datasette, name, database),
        "folder": str(live_folder(database) or ""),
    })


ROUTES: list[tuple[str, Any]] = [
    (r"^/(?P<database>[^/]+)/-/running$", guarded(running_view)),
    # An unescaped dot: the permissions test turns each pattern into a path by its names.
    (r"^/(?P<database>[^/]+)/-/running.json$", guarded(running_json)),
]
