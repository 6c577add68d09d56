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


async def body_within(request: Any, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is known to be over `limit` bytes: by its
    Content-Length, or, for a chunked body, at the chunk that passes the limit. Datasette's
    `post_body` reads the whole body first (a 400 MB upload took the server to 864 MB)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = bool(message.get("more_body", False))
    return b"".join(chunks)


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
        body = await body_within(request, MAX_UPLOAD_BYTES)
        if body is None:
            return Response.json({"outcome": "refused", "reason": f"{filename or 'the file'}"
                                  f" is over the {MAX_UPLOAD_BYTES >> 20} MiB limit: not read "
                                  "further"}, status=413)
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
