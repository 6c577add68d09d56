"""What every prepared page shares: rendering a template of ours with its charts, and the
database a request names (only one that holds our table)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from datasette.utils.asgi import NotFound, Response

from pytest_profllm.browse.charts import charts_json
from pytest_profllm.results.table import TABLE


async def results_database(datasette: Any, name: str) -> Any:
    """The served database `name`, when it holds our table; else a 404."""
    database = datasette.databases.get(name)
    if database is None or name == "_internal" or not await database.table_exists(TABLE):
        raise NotFound(f"No results database named {name!r}")
    return database


async def render_page(
    datasette: Any,
    request: Any,
    template: str,
    context: Mapping[str, Any],
    charts: Mapping[str, Mapping[str, Any]] | None = None,
    status: int = 200,
) -> Response:
    html = await datasette.render_template(
        template, {**context, "charts_json": charts_json(charts or {})}, request=request
    )
    return Response.html(html, status=status)
