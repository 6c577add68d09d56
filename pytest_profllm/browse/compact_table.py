"""Datasette's table markup on our tables' pages, without its template's indentation.

Datasette's `_table.html` indents each cell by its loops' nesting, and each loop's block tags
leave a blank indented line per cell: at the landing table's 100 rows of 27 columns, 41 % of
the page (124 of 302 KB at 20,000 runs, against a 300 KB budget) was spaces and newlines. A
table page looks for `_table-<database>-<table>.html` before `_table.html`; for `runs` and
`benchmark_runs` this loader answers with the `_table.html` Datasette would use (its own, or
one in --template-dir), each line's indentation removed and each line holding only block tags
rendering nothing. The markup is the same; a template of that exact name in --template-dir
still comes first. Another database's `runs` table gets the same markup, only smaller.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from jinja2 import BaseLoader, ChoiceLoader, Environment, TemplateNotFound

from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import TABLE

# Datasette 0.65's names for a table's own template: `_table-DB-TABLE.html` and
# `_table-table-DB-TABLE.html` (the database's name, as a CSS class, may hold dashes).
_OURS = re.compile(rf"_table-.+-(?:{re.escape(LANDING)}|{re.escape(TABLE)})\.html")
_ONLY_BLOCK_TAGS = re.compile(r"(?:\{%.*?%\}[ \t]*)+")
_WHITESPACE_KEPT = re.compile(r"<(?:pre|textarea)\b", re.IGNORECASE)


def compact(source: str) -> str:
    """`source` with every line's leading spaces and tabs removed, and the lines that hold
    only block tags joined to the next; unchanged where whitespace is content (a <pre> or
    <textarea>, in a `_table.html` of --template-dir)."""
    if _WHITESPACE_KEPT.search(source):
        return source
    out = []
    for line in source.splitlines(keepends=True):
        text = line.lstrip(" \t")
        body = text.rstrip("\r\n")
        out.append(body if _ONLY_BLOCK_TAGS.fullmatch(body) else text)
    return "".join(out)


class CompactTableLoader(BaseLoader):
    """Our tables' `_table-...` template: `_table.html` as `inner` finds it, compacted."""

    def __init__(self, inner: BaseLoader) -> None:
        self.inner = inner

    def get_source(
        self, environment: Environment, template: str
    ) -> tuple[str, str | None, Callable[[], bool] | None]:
        if not _OURS.fullmatch(template):
            raise TemplateNotFound(template)
        source, filename, uptodate = self.inner.get_source(environment, "_table.html")
        return compact(source), filename, uptodate

    def list_templates(self) -> list[str]:
        # Its names are any database's: none to list (`datasette serve` lists the others).
        return []


def install(env: Environment) -> None:
    """After Datasette's own loaders, so a template of the exact name still wins."""
    if env.loader is not None and not isinstance(env.loader, CompactTableLoader):
        env.loader = ChoiceLoader([env.loader, CompactTableLoader(env.loader)])
