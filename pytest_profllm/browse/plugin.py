"""Datasette plugin: `datasette results.db` opens on the landing table `runs` (each run's
verdicts, the headline metrics rounded with units in the names, the axes its suite sweeps),
with default facets, column descriptions, canned queries, and links to the dashboards
(browse/dashboard_pages.py). The full table `benchmark_runs` is one click away. CSV exports
of both stream every row.

Every hook returns early for databases without our table.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import quote

from datasette import hookimpl
from datasette.utils import actor_matches_allow, tilde_decode, tilde_encode
from markupsafe import Markup

from pytest_profllm.browse import (
    change_points,
    compact_table,
    dashboard_pages,
    pages,
    run_views,
    running_page,
    sql_functions,
    upload_views,
)
from pytest_profllm.browse.dashboards import DASHBOARDS
from pytest_profllm.browse.facets import CountedFacet, counted
from pytest_profllm.browse.queries import TABLES_SHOWN
from pytest_profllm.browse.queries import canned_queries as canned_queries_for
from pytest_profllm.hosts.files import read_only_uri
from pytest_profllm.results.facet_counts import FACET_COUNTS
from pytest_profllm.results.gate_tables import SAMPLES, VERDICTS
from pytest_profllm.results.landing import LANDING, landing_axes, swept_axes
from pytest_profllm.results.summaries import SUMMARIES
from pytest_profllm.results.table import MEASURED_RUNS, TABLE, TABLE_FACETS

# Datasette lists column descriptions above the table: only the columns whose meaning is not
# plain from their name get one; the latency metrics are explained once in the description.
COLUMN_DESCRIPTIONS: dict[str, str] = {
    "case_id": "suite file :: server :: workload",
    "configuration": "the case without its workload: suite file :: server",
    "workload": "the case's workload, without its repeat number",
    "status": "passed; failed (threshold missed, or the test failed); invalid (the client fell "
    "behind its schedule: the figures measure the client); error (no measurement)",
    "engine": "vllm, or sim for the simulated engine: never compare the two",
    "duration": "seconds the benchmark's requests took, failed ones included (vLLM's duration)",
    "case_duration": "seconds the whole case took, server start included",
    "total_output_tokens": "output tokens of completed requests, from the usage chunk",
    "request_goodput": "requests per second that met every goodput SLO of the workload",
    "failed_verdicts": "metrics that missed their threshold (the thresholds)",
    "bench_kind": "serve (vllm bench serve against a server), capacity (the highest load within "
    "SLOs), accuracy (lm-eval against the server), or throughput / latency (offline: "
    "vllm bench throughput / latency, no server)",
    "acc": "accuracy case: lm-eval's accuracy on the task (acc_stderr: its standard error)",
    "exact_match": "accuracy case: lm-eval's exact-match rate of generated answers",
    "accuracy_plumbing_check": "1: the simulated engine answered: the accuracy checks the path, "
    "not a model (near chance)",
    "tokens_per_second": "offline throughput: prompt and output tokens per second",
    "avg_latency_ms": "offline latency: mean time of one batch, end to end",
    "regression": "the regression gate's decision per gated metric against the baseline (JSON)",
    "verdicts": "each threshold's result: metric, bound, limit, value, passed (JSON; the store's "
    "first name for the record's threshold_results)",
    "device": "the GPUs the case ran on (count x model); cpu: vLLM's CPU build on the host's "
    "cores; virtual: the simulated engine",
    "p99_schedule_lag_ms": "how late the client sent requests against their intended times",
    "achieved_request_rate": "requests per second the client actually sent (target_request_rate: "
    "the schedule's)",
    "client_cpu_percent": "the client event loop's CPU use during the load (100 = one core)",
    "bench_request_rate": "requests per second the workload offers; Infinity (shown as inf, "
    "null in JSON) = all requests at once",
    "req_per_s": "request_throughput: completed requests per second",
    "output_tok_per_s": "output_throughput: output tokens per second",
    "failed_requests": "requests that failed (vLLM's failed)",
    "runtime_node_id": "the Ray node the case ran on (--profllm-ray); empty on one host",
}
DESCRIPTION = (
    "One row per benchmark case, written by pytest-profllm. server_* columns are vLLM engine "
    "arguments, bench_* the workload, system_* and runtime_* where and how it ran, cost_* what "
    "its load cost at a GPU-hour price (--profllm-gpu-hour-price). Metrics keep "
    "the names and definitions of vllm bench serve, latencies in ms: ttft = time to first token, "
    "tpot = time per output token after the first, itl = gaps between streamed messages (pooled "
    "over requests), e2el = end-to-end latency; each as mean_, median_, std_ and pNN_."
)
LANDING_DESCRIPTION = (
    "Newest first: each run's status, the regression gate's decision (gate; what moved in "
    "gate_changes), whether its figures are a valid measurement, the headline metrics "
    "(req_per_s, output_tok_per_s; latencies in ms; an accuracy case's acc and exact_match) "
    "and the axes its suite sweeps. A run_id "
    "opens its page; every column is in benchmark_runs (the cog)."
)
# Where a run used --profllm-ray: the node each case ran on. Only for tables that have the
# column (a database loaded before records named their node has not): a facet on a missing
# column fails the whole page.
NODE_FACET = "runtime_node_id"

# Axes faceted on the landing page (the rest are a click on a column's cog away).
FACETED_AXES = 4
DEFAULT_FACETS = [name for name in TABLE_FACETS if name != NODE_FACET]
# Datasette's max_csv_mb default: a streamed CSV stops there, silently. We lift it (0 = no
# limit) unless the user set a value of their own.
_DATASETTE_DEFAULT_MAX_CSV_MB = 100
# Long JSON cells (compilation_config) in one line each, cut with an ellipsis; the row page
# shows them whole.
_CSS = (
    "body.table td { max-width: 28em; white-space: nowrap; overflow: hidden; "
    "text-overflow: ellipsis; } "
    # The compare links of the landing table (static/compare.js): greyed until two are ticked.
    "#profllm-compare a:not([href]) { color: #888; } "
    "#profllm-compare a[href] { font-weight: bold; }"
)
_SCHEMA_CACHE_S = 2.0


@dataclass(frozen=True)
class _Schema:
    """What the metadata depends on in one database: its swept axes and the columns of our two
    tables (a facet on a missing column fails the whole page: an older table lacks some)."""

    swept: list[str]
    columns: frozenset[str]
    landing_columns: frozenset[str]
    # Landing columns that hold one value in every row (by the planner's statistics): a facet
    # of them says nothing, and at a million runs each facet costs ~40 ms.
    single_valued: frozenset[str] = frozenset()


_schema_cache: dict[str, tuple[float, _Schema]] = {}


def _facets(wanted: list[str], columns: frozenset[str] | None) -> list[str]:
    return [name for name in wanted if columns is None or name in columns]


def table_metadata(columns: frozenset[str] | None = None) -> dict[str, Any]:
    # No `units`: Datasette converts each such cell with pint (a third of the page's time) and
    # shows 1500 ms as 1.5 s; the unit is in the column's name.
    return {
        "title": "vLLM serving benchmarks: every column",
        "description": DESCRIPTION,
        # The indexed ones only: a facet on another column reads every 7 KB row. The swept
        # axes are faceted on the landing table.
        "facets": counted(_facets(DEFAULT_FACETS, columns)
                          + ([NODE_FACET] if columns is not None and NODE_FACET in columns
                             else [])),
        "sort_desc": "timestamp",
        # 400+ columns a row: 20 rows make a page of about 1 MB, not 5.
        "size": 20,
        "columns": COLUMN_DESCRIPTIONS,
    }


def dashboard_links_html(database: str | None) -> str:
    """The dashboards, one link each, for the top of the landing page."""
    if not database:
        return ""
    base = "/" + quote(tilde_encode(database)) + "/-/dashboards/"
    links = " · ".join(f'<a href="{base}{d.name}" title="{escape(d.question)}">'
                       f"{escape(d.title)}</a>" for d in DASHBOARDS)
    # What a session runs into this results folder now (browse/running_page.py).
    links += (f' · <a href="{base[:-len("dashboards/")]}running" title="The cases a session '
              'runs now, live">Running now</a>')
    return f'<p class="profllm-dashboard-links"><strong>Dashboards:</strong> {links}</p>'


# The landing table in the orders people open it in, one click each (then a run id opens the
# run's page): the slowest tail first, the fastest first, the gate's regressions. A ranking
# holds valid measurements only: an invalid run's figure (a client that fell behind, failed
# requests) is the host's, and it had come first as the "highest output tok/s". A run that
# failed a threshold is a measurement and stays, marked by its status column.
_ORDERS = (("slowest p99 TTFT", "validity=valid&_sort_desc=p99_ttft_ms"),
           ("highest output tok/s", "validity=valid&_sort_desc=output_tok_per_s"),
           ("regressed", "gate=regressed"))


def order_links_html(database: str | None) -> str:
    """Links to the landing table sorted or filtered as its first questions need."""
    if not database:
        return ""
    base = "/" + quote(tilde_encode(database)) + "/" + LANDING + "?"
    links = " · ".join(f'<a href="{escape(base + query)}">{escape(label)}</a>'
                       for label, query in _ORDERS)
    return f'<p class="profllm-order-links"><strong>First:</strong> {links}</p>'


def _single_valued(connection: sqlite3.Connection) -> frozenset[str]:
    """The landing columns whose index statistics say one value fills every row."""
    prefix = f"idx_{LANDING}_"
    try:
        rows = connection.execute("SELECT idx, stat FROM sqlite_stat1 WHERE tbl = ?",
                                  (LANDING,)).fetchall()
    except sqlite3.Error:  # not analysed yet
        return frozenset()
    single = set()
    for index, stat in rows:
        numbers = str(stat).split()
        if (isinstance(index, str) and index.startswith(prefix) and len(numbers) >= 2
                and numbers[0] == numbers[1] and numbers[0] != "0"):
            single.add(index.removeprefix(prefix))
    return frozenset(single)


def landing_metadata(swept: list[str], columns: frozenset[str] | None = None,
                     database: str | None = None,
                     single_valued: frozenset[str] = frozenset()) -> dict[str, Any]:
    # No column descriptions here: above a 30-column page they would fill the first screen.
    facets = _facets(["gate", *DEFAULT_FACETS, "validity"], columns) + [
        # The first axes only: each facet counts every row, ~40 ms at a million runs.
        c for c in landing_axes(swept) if c != "server_model"][:FACETED_AXES]
    return {
        "title": "vLLM serving benchmarks",
        "description_html": escape(LANDING_DESCRIPTION) + dashboard_links_html(database)
        + order_links_html(database),
        "sort_desc": "timestamp",
        # The gate's verdict first: a regression shows as a count before any row is read.
        # Never the gate's or a column's that holds one value everywhere.
        "facets": counted([c for c in facets if c == "gate" or c not in single_valued]),
    }


def _schema(datasette: Any, database: str) -> _Schema | None:
    """The database's swept axes and table columns, read at most every couple of seconds
    (metadata is asked for many times a page, and synchronously: get_metadata cannot await
    Datasette's own connection, so a read-only look of our own)."""
    db = datasette.databases.get(database)
    path = getattr(db, "path", None)
    if not path:
        return None
    now = time.monotonic()
    cached = _schema_cache.get(path)
    if cached is not None and now - cached[0] < _SCHEMA_CACHE_S:
        return cached[1]

    def columns(connection: sqlite3.Connection, table: str) -> frozenset[str]:
        return frozenset(row[1] for row in connection.execute(f"PRAGMA table_info([{table}])"))

    try:
        with contextlib.closing(sqlite3.connect(read_only_uri(path), uri=True)) as connection:
            schema = _Schema(
                swept_axes(connection), columns(connection, TABLE), columns(connection, LANDING),
                _single_valued(connection),
            )
    except sqlite3.Error:
        return None
    _schema_cache[path] = (now, schema)
    return schema


@hookimpl
def startup(datasette: Any) -> Any:
    async def lift_csv_limit() -> None:
        # Datasette has no public setter; its settings are a plain dict made at start-up. The
        # setting is the whole server's: it is lifted only where every database is ours.
        settings = getattr(datasette, "_settings", None)
        default = isinstance(settings, dict) and (
            settings.get("max_csv_mb") == _DATASETTE_DEFAULT_MAX_CSV_MB
        )
        if default and await _all_ours(datasette):
            settings["max_csv_mb"] = 0  # type: ignore[index]

    return lift_csv_limit


async def _all_ours(datasette: Any) -> bool:
    served = [db for name, db in datasette.databases.items() if name != "_internal"]
    return bool(served) and all([await db.table_exists(TABLE) for db in served])


@hookimpl
def register_facet_classes() -> list[type]:
    return [CountedFacet]


@hookimpl
def prepare_jinja2_environment(env: Any) -> None:
    compact_table.install(env)


@hookimpl
def prepare_connection(conn: sqlite3.Connection) -> None:
    sql_functions.register(conn)


@hookimpl
def asgi_wrapper(datasette: Any) -> Any:
    """Changes to requests, for our tables only (a database that has `benchmark_runs`):
    - `/` opens the landing table when one database served is a results database, and a
      landing row opens the full row;
    - no facet suggestions: Datasette tries every column for them, and with one column per
      engine argument (400+) that made the table page take seconds;
    - CSV streams every row (`_stream=on`), as if the user had asked for all of them, paged
      on the unique run id whatever the query string says (Datasette 0.65 pages a stream on
      (sort column, key): over a sort's ties, such as timestamps, it repeated and lost rows).

    Redirects are built by Datasette's own URL builder from a database it serves: never
    from the raw path, which may hold `\\evil.com` or a line break."""

    def wrap(app: Any) -> Any:
        async def ours(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope.get("type") == "http":
                path = scope.get("path", "")
                if path == "/" and (landing := await _landing_path(datasette)) is not None:
                    await _redirect(send, landing)
                    return
                if path == _THEIR_DASHBOARDS and not datasette.plugin_config(
                        "datasette-dashboards") and (
                        index := await _dashboards_path(datasette)) is not None:
                    await _redirect(send, index)
                    return
                parts = path.strip("/").split("/")
                database = datasette.databases.get(parts[0]) if parts[0] else None
                if database is not None and await database.table_exists(TABLE):
                    if len(parts) == 3 and parts[1] == LANDING and "." not in parts[2]:
                        # A run id on the landing table opens the run's page.
                        run_id = tilde_decode(parts[2])
                        await _redirect(send, run_views.run_url(datasette, parts[0], run_id))
                        return
                    if len(parts) == 2 and parts[1].split(".", 1)[0] in (TABLE, LANDING):
                        scope = {**scope, "query_string": _our_query(
                            parts[1], scope.get("query_string", b""))}
            await app(scope, receive, send)

        return ours

    return wrap


def _our_query(target: str, query: bytes) -> bytes:
    pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    names = {name for name, _ in pairs}
    if "_nosuggest" not in names:
        pairs.append(("_nosuggest", "1"))
    if target.endswith(".csv"):
        pairs = [(n, v) for n, v in pairs if n not in ("_sort", "_sort_desc", "_stream")]
        pairs += [("_stream", "on"), ("_sort", "run_id")]
    return urllib.parse.urlencode(pairs).encode("latin-1")


async def _redirect(send: Any, location: str) -> None:
    """Answers the request with a 302 to `location`."""
    await send({"type": "http.response.start", "status": 302,
                "headers": [(b"location", location.encode())]})
    await send({"type": "http.response.body", "body": b""})


async def _results_database(datasette: Any) -> str | None:
    """The one results database served (one that has `benchmark_runs`), if exactly one."""
    ours = []
    for name, db in datasette.databases.items():
        if name != "_internal" and await db.table_exists(TABLE):
            ours.append(name)
    return ours[0] if len(ours) == 1 else None


async def _landing_path(datasette: Any) -> str | None:
    name = await _results_database(datasette)
    if name is None:
        return None
    path: str = datasette.urls.table(name, LANDING)
    return path


# datasette-dashboards (whose Vega-Lite runtime our pages use) puts a "Dashboards" item in
# Datasette's menu that leads here: its own YAML dashboards, "No dashboards found" where none
# are configured. Then it leads to ours instead.
_THEIR_DASHBOARDS = "/-/dashboards"


async def _dashboards_path(datasette: Any) -> str | None:
    """The one results database's dashboards; where several are served, the instance's
    index, which lists them (each database's page links its dashboards); None where none."""
    ours = [name for name, db in datasette.databases.items()
            if name != "_internal" and await db.table_exists(TABLE)]
    if not ours:
        return None
    if len(ours) > 1:
        index: str = datasette.urls.instance()
        return index
    path: str = datasette.urls.database(ours[0]) + "/-/dashboards"
    return path




@hookimpl
def get_metadata(
    datasette: Any, key: Any, database: str | None, table: str | None
) -> dict[str, Any]:
    if table not in (None, TABLE, LANDING, *_DERIVED_TABLES) or (
            key is not None and key not in _OUR_KEYS):
        # Nothing of ours: Datasette asks for "plugins" once per text cell it renders (the
        # markdown plugin's configuration), 5,000 times on a 1,000-row query page.
        return {}
    names = [database] if database else [n for n in datasette.databases if n != "_internal"]
    databases = {}
    for name in names:
        schema = _schema(datasette, name)
        if schema is None or not schema.columns:
            continue  # not a results database: its own `runs` table keeps its own order
        # Built once per schema read: Datasette asks for metadata per cell rendered (the
        # markdown plugin does), 5,000 times for a 1,000-row query page, where building it
        # took 0.7 s. Each answer gets dicts of its own: Datasette merges into them.
        cached = _metadata_cache.get(name)
        if cached is None or cached[0] is not schema:
            cached = _metadata_cache[name] = (schema, {
                TABLE: table_metadata(schema.columns),
                LANDING: landing_metadata(
                    schema.swept, schema.landing_columns, name, schema.single_valued
                ),
            })
        databases[name] = {"tables": {table: dict(meta) for table, meta in cached[1].items()}
                           | {derived: {"hidden": True} for derived in _DERIVED_TABLES}}
    return {"databases": databases}


# The metadata keys ours sets, at any level; asked for another, the hook has nothing to say.
_OUR_KEYS = frozenset({"databases", "tables", "title", "description", "description_html",
                       "facets", "sort_desc", "size", "columns", "hidden"})
# Tables each load takes again from the runs (facet counts, the canned queries' summaries):
# hidden from the database's page, as Datasette hides its own search indexes.
_DERIVED_TABLES = (FACET_COUNTS, *SUMMARIES)


_metadata_cache: dict[str, tuple[_Schema, dict[str, dict[str, Any]]]] = {}


@hookimpl
def canned_queries(datasette: Any, database: str, actor: Any) -> Any:
    async def queries() -> dict[str, Any]:
        db = datasette.get_database(database)
        if not await db.table_exists(TABLE):
            return {}
        spans = "server_e2el_ms" in await db.table_columns(SAMPLES)
        return canned_queries_for(await db.table_exists(VERDICTS),
                                  all([await db.table_exists(name) for name in SUMMARIES]),
                                  spans)

    return queries


def dashboard_links(datasette: Any, database: str) -> list[dict[str, str]]:
    base = datasette.urls.database(database) + "/-/dashboards/"
    return [{"href": base + dashboard.name, "label": f"Dashboard: {dashboard.title}"}
            for dashboard in DASHBOARDS]


@hookimpl
def table_actions(datasette: Any, actor: Any, database: str, table: str, request: Any) -> Any:
    if table == TABLE:
        other = {"href": datasette.urls.table(database, LANDING),
                 "label": "Landing view: the columns that matter"}
    elif table == LANDING:
        other = {"href": datasette.urls.table(database, TABLE),
                 "label": "Every column (benchmark_runs)"}
    else:
        return None
    return [other, *dashboard_links(datasette, database)]


@hookimpl
def database_actions(datasette: Any, actor: Any, database: str, request: Any) -> Any:
    async def links() -> list[dict[str, str]]:
        if not await datasette.get_database(database).table_exists(TABLE):
            return []
        upload = ([{"href": datasette.urls.database(database) + "/-/upload",
                    "label": "Upload record files"}]
                  if await upload_views.may_upload(datasette, actor, database) else [])
        return [*dashboard_links(datasette, database), *upload]

    return links


@hookimpl
def extra_css_urls(database: str | None, table: str | None) -> list[str]:
    if table not in (TABLE, LANDING):
        return []
    return ["data:text/css," + quote(_CSS)]


@hookimpl
def extra_js_urls(datasette: Any, database: str | None, table: str | None) -> Any:
    """On our landing table: a box per run, and links that compare the two ticked runs or
    their sessions (the canned queries) in one click."""
    if table != LANDING or not database:
        return []

    async def urls() -> list[dict[str, Any]]:
        served = datasette.databases.get(database)
        if served is None or not await served.table_exists(TABLE):
            return []
        return [{"url": datasette.urls.static_plugins("pytest-profllm", "compare.js"),
                 "module": False}]

    return urls


@hookimpl
def register_routes() -> list[tuple[str, Any]]:
    # Our prepared pages, each module's own routes; then our 404 for the rest of our paths.
    return [*dashboard_pages.ROUTES, *run_views.ROUTES, *upload_views.ROUTES,
            *running_page.ROUTES, *pages.CATCH_ALL]


@hookimpl
def permission_allowed(datasette: Any, actor: Any, action: str, resource: Any) -> Any:
    """Writing to a results database from the web (uploads, saved filters) is the root
    actor's (`datasette --root`) and that of actors an allow block of the plugin's
    configuration matches (`plugins: {pytest-profllm: {upload: {allow: {id: [alice]}}}}`);
    everyone else reads only.

    Reading follows the tables' own `allow` blocks: a canned query of ours is refused to an
    actor who may not see each table whose rows it shows (the query's SQL runs as the
    plugin's, past any table's allow block), and a table derived from `benchmark_runs`
    (the facet counts, the queries' summaries, the measured runs) to an actor who may not
    see `benchmark_runs`. None: no opinion (Datasette's own rules decide)."""
    if action == "view-query" and isinstance(resource, (tuple, list)) and len(resource) == 2:
        return _query_allowed(datasette, actor, resource[0], resource[1])
    if (action == "view-table" and isinstance(resource, (tuple, list)) and len(resource) == 2
            and resource[1] in _FOLLOW_RUNS):
        return _derived_allowed(datasette, actor, resource[0])
    if action != dashboard_pages.WRITE_ACTION:
        return None
    if actor and actor.get("id") == "root":
        return True
    config = datasette.plugin_config("pytest-profllm") or {}
    allow = (config.get("upload") or {}).get("allow")
    return bool(allow is not None and actor_matches_allow(actor, allow))


# Our canned queries: the tables whose rows each shows (the first one present marks the query
# as ours: the hooks offer it only then).
_QUERY_TABLES = {**TABLES_SHOWN, **change_points.TABLES_SHOWN}
# Tables and views of runs' rows, taken from `benchmark_runs`: seen only by whoever sees it.
_FOLLOW_RUNS = frozenset({*_DERIVED_TABLES, MEASURED_RUNS})


async def _may_see_table(datasette: Any, actor: Any, database: str, table: str) -> bool:
    # The checks Datasette's own table page makes; the first with an opinion decides.
    seen, _ = await datasette.check_visibility(actor, permissions=[
        ("view-table", (database, table)), ("view-database", database), "view-instance"])
    return bool(seen)


def _query_allowed(datasette: Any, actor: Any, database: str, name: str) -> Any:
    """False where `name` is a canned query of ours that shows a table `actor` may not see.
    (Leaving the query out of the canned_queries hook instead breaks Datasette 0.65: it asks
    whether the anonymous actor may see a query that root sees, and asserts it exists.)"""
    shown = _QUERY_TABLES.get(name)
    if shown is None:
        return None

    async def allowed() -> bool | None:
        db = datasette.databases.get(database)
        if db is None or not await db.table_exists(shown[0]):
            return None  # not ours: a query of the same name in someone's metadata
        for table in shown:
            if await db.table_exists(table) and not await _may_see_table(
                    datasette, actor, database, table):
                return False
        return None

    return allowed


def _derived_allowed(datasette: Any, actor: Any, database: str) -> Any:
    async def allowed() -> bool | None:
        db = datasette.databases.get(database)
        if db is None or not await db.table_exists(TABLE):
            return None
        return None if await _may_see_table(datasette, actor, database, TABLE) else False

    return allowed


@hookimpl
def render_cell(value: Any, column: str, table: str | None, database: str, datasette: Any
                ) -> Any:
    """A run id in a canned query's result or a table of ours opens the run's page."""
    if column != "run_id" or not isinstance(value, str) or not value:
        return None
    if table not in (None, TABLE, LANDING, "gate_runs", "regression_verdicts",
                     "request_samples", "run_series"):
        return None

    async def link() -> Markup | None:
        served = datasette.databases.get(database)
        if served is None or not await served.table_exists(TABLE):
            return None
        href = run_views.run_url(datasette, database, value)
        return Markup(f'<a href="{escape(href)}">{escape(value)}</a>')

    return link
