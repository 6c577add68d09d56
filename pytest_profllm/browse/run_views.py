"""The run page's routes: the page (`/{database}/-/run/{run_id}`), a file of the run
(`/{database}/-/run/{run_id}/files/{name}`), and all its profiler traces as one download
(`/api/export/traces/{run_id}`, the seed's address, where one results database is served).

Files are served only from the results folder (the database file's folder), and only those
that browse/run_files.py's `run_files` lists for the run: a name from the URL is looked up in
that list, never joined to a path."""

from __future__ import annotations

import io
import urllib.parse
import zipfile
from pathlib import Path
from typing import Any

from datasette.utils import tilde_decode, tilde_encode
from datasette.utils.asgi import Response

from pytest_profllm.browse import request_timeline, run_files, run_page, run_values
from pytest_profllm.browse.pages import (
    PageError,
    guarded,
    not_ours,
    render_page,
    results_database,
)
from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import TABLE

# Bigger traces are not zipped in memory: each is downloaded on its own.
MAX_ZIP_BYTES = 512 * 2**20
_TYPES = {".json": "application/json", ".gz": "application/gzip", ".log": "text/plain",
          ".txt": "text/plain"}


def _results_dir(database: Any) -> Path | None:
    path = getattr(database, "path", None)
    return Path(path).parent if path else None


def run_url(datasette: Any, database: str, run_id: str) -> str:
    return f"{datasette.urls.database(database)}/-/run/{tilde_encode(run_id)}"


async def _page_and_files(datasette: Any, request: Any, name: str, encoded: str
                          ) -> tuple[Any, run_page.RunPage, list[run_files.RunFile]]:
    database = await results_database(datasette, request, name)
    run_id = tilde_decode(encoded)
    page = await database.execute_fn(lambda connection: run_page.run_page(connection, run_id))
    if page is None:
        raise PageError(404, f"No run {run_id!r} in {name}")
    folder = _results_dir(database)
    files = run_files.run_files(folder, page.row) if folder is not None else []
    return database, page, files


async def run_view(datasette: Any, request: Any) -> Response:
    name = request.url_vars["database"]
    database, page, files = await _page_and_files(
        datasette, request, name, request.url_vars["run_id"]
    )
    base = run_url(datasette, name, page.run_id)
    path = getattr(database, "path", None)
    return await render_page(datasette, request, "profllm_run.html", {
        "database": name,
        "page": page,
        "row": page.row,
        "files": [{"kind": f.kind, "name": f.name, "size": f.size,
                   "href": f"{base}/files/{tilde_encode(f.name)}"} for f in files],
        "landing_url": datasette.urls.table(name, LANDING),
        "row_url": datasette.urls.row(name, TABLE, tilde_encode(page.run_id)),
        "dashboards_url": datasette.urls.database(name) + "/-/dashboards",
        "history_url": datasette.urls.database(name) + "/-/dashboards/history?case_id="
        + tilde_encode(str(page.row.get("case_id") or "")).replace("~", "%7E"),
        "baseline_urls": [(r, run_url(datasette, name, r)) for r in page.baseline_runs],
        "rerun_command": run_page.rerun_command(page.run_id, Path(path) if path else None),
        "parts": request_timeline.PARTS,
        "adapter_columns": run_page.ADAPTER_COLUMNS,
        "shown": run_values.shown,
        "requests_query_url": datasette.urls.database(name) + "/run_requests?run_id="
        + urllib.parse.quote(page.run_id, safe=""),
        "traces_url": f"/api/export/traces/{tilde_encode(page.run_id)}"
        if any(f.kind == "trace" for f in files) else None,
    }, charts=page.charts)


async def file_view(datasette: Any, request: Any) -> Response:
    name = request.url_vars["database"]
    _, page, files = await _page_and_files(datasette, request, name, request.url_vars["run_id"])
    wanted = tilde_decode(request.url_vars["file"])
    found = next((f for f in files if f.name == wanted), None)
    if found is None:
        raise PageError(404, f"No file {wanted!r} of run {page.run_id} in the results folder")
    return _file_response(found.path, found.path.name)


def _file_response(path: Path, filename: str) -> Response:
    body = path.read_bytes()
    kind = _TYPES.get(path.suffix, "application/octet-stream")
    return Response(body, content_type=kind, headers={
        "content-disposition": f'attachment; filename="{_safe(filename)}"'})


def _safe(filename: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in filename)


async def traces_export(datasette: Any, request: Any) -> Response:
    """The seed's `/api/export/traces/{id}`: the run's profiler traces, the one file as it
    is or several zipped, from the one results database served."""
    ours = [n for n, db in datasette.databases.items()
            if n != "_internal" and await not_ours(db) is None]
    if len(ours) != 1:
        raise PageError(404, "/api/export/traces needs exactly one results database served; use "
                       "/{database}/-/run/{run_id} for one of several")
    _, page, files = await _page_and_files(datasette, request, ours[0], request.url_vars["run_id"])
    traces = [f for f in files if f.kind == "trace"]
    if not traces:
        raise PageError(404, f"Run {page.run_id} has no profiler trace in the results folder")
    if len(traces) == 1:
        return _file_response(traces[0].path, traces[0].path.name)
    if sum(f.size for f in traces) > MAX_ZIP_BYTES:
        return Response.text(f"Run {page.run_id}'s traces are over {MAX_ZIP_BYTES >> 20} MiB: "
                             "download them one at a time from its page", status=413)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for trace in traces:
            archive.write(trace.path, trace.name)
    return Response(buffer.getvalue(), content_type="application/zip", headers={
        "content-disposition": f'attachment; filename="{_safe(page.run_id)}-traces.zip"'})


ROUTES: list[tuple[str, Any]] = [
    (r"^/(?P<database>[^/]+)/-/run/(?P<run_id>[^/]+)$", guarded(run_view)),
    (r"^/(?P<database>[^/]+)/-/run/(?P<run_id>[^/]+)/files/(?P<file>[^/]+)$",
     guarded(file_view)),
    (r"^/api/export/traces/(?P<run_id>[^/]+)$", guarded(traces_export)),
]
