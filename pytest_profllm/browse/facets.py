"""The facets of our two tables: Datasette's column facets, which on a page with no filter read
the counts the last load took (results/facet_counts.py) instead of grouping every run.

At a million runs each facet of an unfiltered page grouped a million index entries (about
0.1 s; the landing page has ten). A filtered page, or a database whose load took no counts,
groups its rows as Datasette's column facet does.
"""

from __future__ import annotations

from typing import Any

from datasette.database import QueryInterrupted
from datasette.facets import ColumnFacet
from datasette.utils import escape_sqlite, path_with_added_args, path_with_removed_args

from pytest_profllm.results.facet_counts import FACET_COUNTS

TYPE = "counted"


def counted(columns: list[str]) -> list[dict[str, str]]:
    """Facet configurations (table metadata's `facets`) of this type."""
    return [{TYPE: column} for column in columns]


class CountedFacet(ColumnFacet):  # type: ignore[misc]
    type = TYPE

    async def suggest(self) -> list[Any]:
        return []  # Datasette's own column facet suggests; this would repeat them

    async def facet_results(self) -> tuple[list[dict[str, Any]], list[str]]:
        if not self._unfiltered() or not await self.ds.get_database(
                self.database).table_exists(FACET_COUNTS):
            results: tuple[list[dict[str, Any]], list[str]] = await super().facet_results()
            return results
        # Datasette's column facet result, built from the kept counts: no hook lets a facet
        # supply its counts, so its format (ColumnFacet.facet_results) is followed here.
        facet_size = self.get_facet_size()
        pairs = self.get_querystring_pairs()
        shown, timed_out = [], []
        for source_and_config in self.get_configs():
            config = source_and_config["config"]
            column = config.get("column") or config["simple"]
            try:
                rows = await self._counts(column, facet_size)
            except QueryInterrupted:
                timed_out.append(column)
                continue
            values = []
            for value, count in rows[:facet_size]:
                name = f"{column}__exact" if column.startswith("_") else column
                selected = (name, str(value)) in pairs
                toggle = (path_with_removed_args(self.request, {name: str(value)}) if selected
                          else path_with_added_args(self.request, {name: value}))
                values.append({"value": value, "label": value, "count": count,
                               "toggle_url": self.ds.absolute_url(
                                   self.request, self.ds.urls.path(toggle)),
                               "selected": selected})
            shown.append({
                "name": column,
                "type": self.type,
                "hideable": source_and_config["source"] != "metadata",
                "toggle_url": self.ds.urls.path(
                    path_with_removed_args(self.request, {"_facet": column})),
                "results": values,
                "truncated": len(rows) > facet_size,
            })
        return shown, timed_out

    def _unfiltered(self) -> bool:
        # Datasette's facet SQL of a table page is "select ... from [table] " + its WHERE
        # clause: ending at the table's name, there is none.
        return bool(self.table) and not self.params and self.sql.rstrip().endswith(
            " from " + escape_sqlite(self.table))

    async def _counts(self, column: str, facet_size: int) -> list[tuple[Any, int]]:
        """The column's values and counts, most first: those the load kept, else (a column
        it did not count) grouped from the rows."""
        kept = await self.ds.execute(
            self.database,
            f"SELECT value, count FROM [{FACET_COUNTS}] WHERE table_name = ? AND "
            "column_name = ? ORDER BY value IS NULL DESC, count DESC, value LIMIT ?",
            [self.table, column, facet_size + 2])
        # The column's row of empty cells comes first: it says the load counted the column.
        if kept.rows and kept.rows[0]["value"] is None:
            return [(row["value"], row["count"]) for row in kept.rows[1:]]
        column_sql = escape_sqlite(column)
        grouped = await self.ds.execute(
            self.database,
            f"SELECT {column_sql} AS value, count(*) AS count FROM ({self.sql}) "
            f"WHERE {column_sql} IS NOT NULL GROUP BY {column_sql} "
            f"ORDER BY count DESC, value LIMIT {facet_size + 1}",
            self.params, custom_time_limit=self.ds.setting("facet_time_limit_ms"))
        return [(row["value"], row["count"]) for row in grouped.rows]
