"""What every prepared page shares: the database a request names (only one the visitor may
see and that holds our table), rendering a template of ours with its charts, and the guard
every route of ours runs behind, which answers what went wrong in one line.

A route raises `PageError` for a condition it can name; the guard renders it as Datasette's
own error page (or JSON) itself. Datasette's exception hook is not used for these: with
`rich` installed it prints every exception, a 404 included, as a traceback of a thousand
lines with every local, into the server's log."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from datasette.utils.asgi import Response

from pytest_profllm.browse.charts import charts_json
from pytest_profllm.browse.filters import PRESETS_TABLE
from pytest_profllm.limits import MAX_QUERY_STRING_BYTES
from pytest_profllm.results.gate_tables import RUNS, SAMPLES, SERIES, VERDICTS
from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import TABLE

# The tables our pages read. A visitor must be allowed to see each that the database holds,
# as Datasette's own table pages ask: a page of ours shows rows of all of them.
OUR_TABLES = (TABLE, LANDING, RUNS, VERDICTS, SAMPLES, SERIES, PRESETS_TABLE)
# The columns a `benchmark_runs` has in every version we wrote: a table of that name without
# them is someone else's.
IDENTITY_COLUMNS = ("run_id", "session_id", "case_id", "suite", "timestamp", "status")

View = Callable[[Any, Any], Awaitable[Response]]


class PageError(Exception):
    """A request our pages cannot answer, said in one line, with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def visible(datasette: Any, actor: Any, name: str) -> bool:
    """Whether `actor` may see database `name` and each table of ours in it: the checks
    Datasette's own table page makes (view-table, then view-database, then view-instance;
    the first that has an opinion decides)."""
    database = datasette.databases[name]
    tables = [table for table in OUR_TABLES if await database.table_exists(table)]
    chains: list[list[Any]] = [
        [("view-table", (name, table)), ("view-database", name), "view-instance"]
        for table in tables
    ] or [[("view-database", name), "view-instance"]]
    for chain in chains:
        seen, _ = await datasette.check_visibility(actor, permissions=chain)
        if not seen:
            return False
    return True


async def results_database(datasette: Any, request: Any, name: str) -> Any:
    """The served database `name`, when the request's actor may see it and it holds our
    table; else a PageError (404 or 403, as Datasette's own pages answer). Nothing of the
    database is read before the permission check but its table names."""
    database = datasette.databases.get(name)
    if database is None or name == "_internal":
        raise PageError(404, f"No database named {name!r} is served")
    if not await visible(datasette, request.actor, name):
        raise PageError(403, f"You do not have permission to view {name}")
    why = await not_ours(database)
    if why:
        raise PageError(404, f"{name} is not a results database: {why}")
    return database


async def not_ours(database: Any) -> str | None:
    """Why `database` is not a results database of ours (None where it is)."""
    if not await database.table_exists(TABLE):
        return f"it has no {TABLE} table"
    columns = set(await database.table_columns(TABLE))
    missing = [column for column in IDENTITY_COLUMNS if column not in columns]
    if missing:
        return (f"its {TABLE} table has no {', '.join(missing)} column (not one "
                "pytest-profllm wrote)")
    return None


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line, cut to `limit` characters: what a message quotes from outside."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


async def error_page(datasette: Any, request: Any, status: int, message: str,
                     as_json: bool = False) -> Response:
    """Datasette's error page (or a JSON object) with one line of what went wrong."""
    if as_json:
        return Response.json({"ok": False, "outcome": "refused", "error": message,
                              "reason": message, "status": status}, status=status)
    html = await datasette.render_template(
        ["error.html"], {"ok": False, "error": message, "status": status, "title": None},
        request=request)
    return Response.html(html, status=status)


def guarded(view: View, json_posts: bool = False) -> View:
    """`view` behind the checks every route of ours shares: a query string within
    limits.MAX_QUERY_STRING_BYTES, and a PageError (or a database that cannot be read as
    the page needs) answered in one line, never a traceback. `json_posts`: a POST is
    answered in JSON (a script sent it)."""

    @functools.wraps(view)
    async def route(datasette: Any, request: Any) -> Response:
        as_json = json_posts and request.method == "POST"
        size = len(request.scope.get("query_string", b""))
        if size > MAX_QUERY_STRING_BYTES:
            return await error_page(datasette, request, 414, (
                f"The query string is {size:,} bytes, over the limit of "
                f"{MAX_QUERY_STRING_BYTES:,}: choose fewer filters"), as_json)
        try:
            return await view(datasette, request)
        except PageError as error:
            return await error_page(datasette, request, error.status, error.message, as_json)
        except sqlite3.Error as error:
            # A database of ours by its identity columns that still lacks what the page
            # reads (an odd or damaged copy), or one busy past Datasette's time limit.
            name = request.url_vars.get("database", "the database")
            return await error_page(datasette, request, 409, one_line(
                f"This page could not read {name}: {error} (is it a results database "
                "pytest-profllm wrote?)"), as_json)

    return route


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


async def no_page(datasette: Any, request: Any) -> Response:
    """A path under one of our prefixes that no page of ours has: our 404, in one line.
    Datasette's own 404 of it would go through its exception hook (see the module's
    docstring); a private database still answers 403 first."""
    name = request.url_vars.get("database")
    if name is None:  # /api/export/traces/...: the one results database served, if any
        ours = [n for n, db in datasette.databases.items()
                if n != "_internal" and await not_ours(db) is None]
        name = ours[0] if len(ours) == 1 else None
    if name is not None:
        await results_database(datasette, request, name)
    raise PageError(404, one_line(f"No page at {request.path}", 200))


# Last of our routes: everything under our prefixes is answered by us.
CATCH_ALL: list[tuple[str, Any]] = [
    (r"^/(?P<database>[^/]+)/-/(?P<page>run|dashboards|upload)/(?P<rest>.*[^/])$",
     guarded(no_page)),
    (r"^/api/export/traces/(?P<rest>.*[^/])$", guarded(no_page)),
]
