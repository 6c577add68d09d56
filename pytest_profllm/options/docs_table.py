"""docs/options.md's table of options, made from the table of declarations: the page's text
between its two markers is this table, and `python -m pytest_profllm.options` rewrites it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pytest_profllm.options.declare import Option
from pytest_profllm.options.table import OPTIONS

START = "<!-- options-table:start (python -m pytest_profllm.options writes it) -->"
END = "<!-- options-table:end -->"
PAGE = Path("docs") / "options.md"  # from the repository's root


def markdown_table(options: Iterable[Option[Any]] = OPTIONS) -> str:
    rows = ["| option | ini | default | meaning |", "|---|---|---|---|"]
    rows += [_row(option) for option in options]
    return "\n".join(rows) + "\n"


def _row(option: Option[Any]) -> str:
    if option.flag is None:
        flag = ""
    elif option.is_switch:
        flag = f"`{option.flag}`"
    elif option.bare is not None:
        flag = f"`{option.flag}[={option.metavar}]`"
    elif option.choices is not None:
        flag = f"`{option.flag} {{{','.join(option.choices)}}}`"
    else:
        flag = f"`{option.flag} {option.metavar}`"
    ini = f"`{option.ini}`" if option.ini else ""
    default = option.default_text()
    if option.shown_default is None and isinstance(option.default, str):
        default = f"`{default}`"  # a value as written, like `auto`
    return f"| {flag} | {ini} | {default} | {option.doc or option.help} |".replace("|  |", "| |")


def with_table(page: str, table: str) -> str:
    """`page` with the text between its markers replaced by `table`."""
    before, start, rest = page.partition(START)
    _, end, after = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page lacks the markers {START} and {END}")
    return f"{before}{START}\n{table}{END}{after}"


def write(page: Path = PAGE) -> bool:
    """Rewrite the table in `page`; whether it changed."""
    text = page.read_text()
    new = with_table(text, markdown_table())
    if new != text:
        page.write_text(new)
    return new != text
