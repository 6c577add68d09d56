"""The upload page's route, `/{database}/-/upload`: GET shows the drop zone (or, to an actor
who may not write, how to get that right); POST takes one file as its body, named in the
`x-profllm-filename` header, and answers what became of it as JSON (browse/upload.py)."""

from __future__ import annotations

import asyncio
import urllib.parse
from pathlib import Path
from typing import Any

from datasette.utils.asgi import Response

from pytest_profllm.browse import upload
from pytest_profllm.browse.dashboard_pages import WRITE_ACTION
from pytest_profllm.browse.pages import guarded, render_page, results_database
from pytest_profllm.limits import MAX_UPLOAD_BYTES
from pytest_profllm.results.landing import LANDING


async def may_upload(datasette: Any, actor: Any, database: str) -> bool:
    allowed: bool = await datasette.permission_allowed(actor, WRITE_ACTION, resource=database,
                                                       default=False)
    return allowed


async def upload_view(datasette: Any, request: Any) -> Response:
    name = request.url_vars["database"]
    database = await results_database(datasette, request, name)
    allowed = await may_upload(datasette, request.actor, name)
    if request.method == "POST":
        if not allowed:
            return Response.json({"outcome": "refused", "reason": "uploading needs an actor "
                                  f"allowed to write to {name}"}, status=403)
        path = getattr(database, "path", None)
        if not path or database.is_memory or not database.is_mutable:
            return Response.json({"outcome": "refused", "reason": f"{name} is served "
                                  "read-only (immutable or in memory)"}, status=409)
        filename = urllib.parse.unquote(request.headers.get("x-profllm-filename", ""))
        body = await request.post_body()
        result = await asyncio.to_thread(upload.upload, Path(path), filename, body)
        return Response.json(result.as_json(), status=200 if result.outcome != "refused"
                             else 422)
    return await render_page(datasette, request, "profllm_upload.html", {
        "database": name,
        "allowed": allowed,
        "landing_url": datasette.urls.table(name, LANDING),
        "upload_url": datasette.urls.database(name) + "/-/upload",
        "max_mib": MAX_UPLOAD_BYTES >> 20,
    }, status=200 if allowed else 403)


ROUTES: list[tuple[str, Any]] = [
    (r"^/(?P<database>[^/]+)/-/upload$", guarded(upload_view, json_posts=True)),
]
