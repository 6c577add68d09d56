"""The dashboards' pages: `/{database}/-/dashboards` (the list, and the saved filters) and
`/{database}/-/dashboards/{name}` (one dashboard under its filter panel). The SQL and the
charts are in browse/dashboards/; this module reads the request, runs them on Datasette's
connection and renders the page."""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from datasette.utils import tilde_encode
from datasette.utils.asgi import Response

from pytest_profllm.browse import dashboards, filters
from pytest_profllm.browse.filters import Schema, Selection
from pytest_profllm.browse.pages import PageError, guarded, render_page, results_database
from pytest_profllm.limits import MAX_QUERY_STRING_BYTES
from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import TABLE

# Who may write to a results database from the web (upload, saved filters): a permission
# Datasette's `permission_allowed` hooks answer (browse/plugin.py's allows the root actor).
WRITE_ACTION = "profllm-upload"

_memo = filters.DatabaseMemo()
PANEL_SESSIONS = 20


@dataclass(frozen=True)
class Option:
    value: str
    count: int
    selected: bool


@dataclass(frozen=True)
class FilterWidget:
    column: str
    label: str
    options: list[Option]


@dataclass(frozen=True)
class RangeWidget:
    column: str
    label: str
    low: str
    high: str


def schema_of(database: Any, connection: sqlite3.Connection) -> Schema:
    path = getattr(database, "path", None)
    if not path:
        return filters.read_schema(connection)
    return _memo.get(path, "schema", lambda: filters.read_schema(connection))


def _panel(connection: sqlite3.Connection, schema: Schema,
           selection: Selection) -> tuple[list[FilterWidget], list[RangeWidget]]:
    """The filter panel's widgets: a multi-select per categorical column and swept axis,
    offering the values found in the selected sessions (with all sessions selected, in the
    newest PANEL_SESSIONS of them: counting values over every run of a big database takes
    seconds)."""
    scoped = selection.scope(schema)
    if scoped is None:
        sessions = [s.session_id for s in schema.sessions[:PANEL_SESSIONS]]
        scoped = f"session_id IN ({', '.join('?' for _ in sessions)})", list(sessions)
    where, params = scoped
    columns = [*filters.FIXED_FILTERS]
    columns += [(axis, axis.removeprefix("server_").removeprefix("bench_"))
                for axis in schema.axes if axis not in dict(filters.FIXED_FILTERS)]
    widgets = []
    found = filters.option_values(connection, [column for column, _ in columns], where, params)
    for column, label in columns:
        chosen = set(selection.values.get(column, []))
        options = []
        for value, count in found[column]:
            text = filters.NONE_VALUE if value is None else _text(value)
            if len(text) > 80:  # a JSON value: not something to pick from a list
                continue
            options.append(Option(text, count, text in chosen))
        if len(options) > 1 or chosen:
            widgets.append(FilterWidget(column, label, options))
    ranges = [RangeWidget(column, label, _text(selection.low.get(column, "")),
                          _text(selection.high.get(column, "")))
              for column, label in filters.RANGE_FILTERS if column in schema.types]
    return widgets, ranges


def data_quality(connection: sqlite3.Connection, schema: Schema,
                 selection: Selection) -> list[str]:
    """What the selection holds that no chart draws: runs that are not a valid measurement
    (errors, failed requests, a client that fell behind), and runs skipped (never measured:
    not an invalid measurement), each counted, with a link's worth of words. Only for chosen
    sessions: counting over every session of a big database is a scan."""
    if selection.session_ids(schema) is None:
        return []
    where, params = selection.where(schema)
    row = connection.execute(
        f"SELECT count(*), sum(validity != 'valid' AND status IS NOT 'skipped'), "
        f"sum(status IS 'skipped') FROM [{TABLE}] WHERE {where}", params
    ).fetchone()
    total, invalid, skipped = row[0] or 0, row[1] or 0, row[2] or 0
    notes = []
    if invalid:
        notes.append(f"{invalid} of the {total} runs in this selection are not a valid "
                     "measurement and are left out of every chart (the landing table's "
                     "validity facet lists them).")
    if skipped:
        notes.append(f"{skipped} of the {total} runs in this selection were skipped, so "
                     "measured nothing (the landing table's status facet lists them).")
    return notes


def _text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _pairs(request: Any) -> list[tuple[str, str]]:
    return urllib.parse.parse_qsl(request.query_string, keep_blank_values=True)


async def dashboard_list(datasette: Any, request: Any) -> Response:
    name = request.url_vars["database"]
    database = await results_database(datasette, request, name)
    saved = await database.execute_fn(filters.presets)
    return await render_page(datasette, request, "profllm_dashboards.html", {
        "database": name,
        "landing_url": datasette.urls.table(name, LANDING),
        "dashboards": _links(datasette, name, ""),
        "presets": [_preset_link(datasette, name, p) for p in saved],
    })


def _links(datasette: Any, database: str, query: str) -> list[dict[str, str]]:
    base = datasette.urls.database(database) + "/-/dashboards/"
    return [{"name": d.name, "title": d.title, "question": d.question,
             "href": base + d.name + (f"?{query}" if query else "")}
            for d in dashboards.DASHBOARDS]


def _preset_link(datasette: Any, database: str, preset: filters.Preset) -> dict[str, str]:
    href = (datasette.urls.database(database) + "/-/dashboards/" + preset.dashboard
            + (f"?{preset.query}" if preset.query else ""))
    return {"name": preset.name, "dashboard": preset.dashboard, "href": href,
            "saved_at": preset.saved_at, "saved_by": preset.saved_by or ""}


async def _dashboard_of(datasette: Any, request: Any) -> tuple[str, dashboards.Dashboard, Any]:
    """The URL's database name, its dashboard (a 404 where there is none) and the database."""
    name = request.url_vars["database"]
    dashboard = dashboards.BY_NAME.get(request.url_vars["dashboard"])
    if dashboard is None:
        raise PageError(404, "No dashboard named " + repr(request.url_vars["dashboard"]))
    return name, dashboard, await results_database(datasette, request, name)


async def dashboard_page(datasette: Any, request: Any) -> Response:
    name, dashboard, database = await _dashboard_of(datasette, request)
    pairs = _pairs(request)
    args: Mapping[str, str] = dict(pairs)

    def build(connection: sqlite3.Connection) -> dict[str, Any]:
        schema = schema_of(database, connection)
        selection = Selection.parse(pairs, schema)
        view = dashboard.build(connection, schema, selection, args)
        view.notes += data_quality(connection, schema, view.counted or selection)
        widgets, ranges = _panel(connection, schema, selection)
        return {"schema": schema, "selection": selection, "view": view, "filters": widgets,
                "ranges": ranges, "presets": filters.presets(connection)}

    built = await database.execute_fn(build)
    selection: Selection = built["selection"]
    view: dashboards.View = built["view"]
    query = selection.query_string()
    can_save = await datasette.permission_allowed(request.actor, WRITE_ACTION,
                                                  resource=name, default=False)
    return await render_page(datasette, request, "profllm_dashboard.html", {
        "database": name,
        "dashboard": dashboard,
        "dashboards": _links(datasette, name, query),
        "index_url": datasette.urls.database(name) + "/-/dashboards",
        "landing_url": datasette.urls.table(name, LANDING),
        "selection": selection,
        "described": selection.describe(),
        "panel_open": bool(selection.values or selection.low or selection.high
                            or selection.text),
        "sessions": built["schema"].sessions[:200],
        "filters": built["filters"],
        "ranges": built["ranges"],
        "presets": [_preset_link(datasette, name, p) for p in built["presets"]],
        "can_save": can_save,
        "save_url": datasette.urls.database(name) + "/-/dashboards/" + dashboard.name
        + "/presets",
        "query_string": query,
        "filter_pairs": selection.query_pairs(),
        "view": view,
        "tables": view.tables,
        "run_url": lambda run_id: datasette.urls.database(name) + "/-/run/"
        + tilde_encode(str(run_id)),
    }, charts=view.charts)


async def save_preset(datasette: Any, request: Any) -> Response:
    """POST: saves the filter of a dashboard under a name (an actor allowed to write only)."""
    name, dashboard, database = await _dashboard_of(datasette, request)
    if request.method != "POST":
        return Response.text("POST a preset's name and query", status=405)
    if not await datasette.permission_allowed(request.actor, WRITE_ACTION, resource=name,
                                              default=False):
        return Response.text("Saving a preset needs an actor allowed to write to "
                             f"{name} (for example: datasette --root)", status=403)
    form = await request.post_vars()
    if len(form.get("query", "").encode()) > MAX_QUERY_STRING_BYTES:
        # The preset becomes a link's query string: one a page would refuse.
        return Response.text(f"A preset's query is at most {MAX_QUERY_STRING_BYTES:,} bytes",
                             status=400)
    pairs = urllib.parse.parse_qsl(form.get("query", ""), keep_blank_values=True)
    actor = (request.actor or {}).get("id")
    try:
        preset = await database.execute_write_fn(
            lambda connection: filters.save_preset(connection, form.get("name", ""),
                                                   dashboard.name, pairs, actor),
            block=True)
    except ValueError as error:
        return Response.text(str(error), status=400)
    except sqlite3.Error as error:
        return Response.text(f"Could not save the preset in {name}: {error}", status=409)
    href = _preset_link(datasette, name, preset)["href"]
    return Response.redirect(href)


ROUTES: list[tuple[str, Any]] = [
    (r"^/(?P<database>[^/]+)/-/dashboards$", guarded(dashboard_list)),
    (r"^/(?P<database>[^/]+)/-/dashboards/(?P<dashboard>[a-z_]+)$", guarded(dashboard_page)),
    (r"^/(?P<database>[^/]+)/-/dashboards/(?P<dashboard>[a-z_]+)/presets$",
     guarded(save_preset)),
]
