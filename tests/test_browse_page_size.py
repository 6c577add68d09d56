"""The table pages' size: our tables render Datasette's own markup without the indentation its
`_table.html` repeats on every cell (browse/compact_table.py), so the landing page keeps to
its 300 KB budget at 20,000 runs (benchmarks/perf/results_scale.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import jinja2
from datasette.app import Datasette
from generated_results import generate
from hypothesis import given, settings
from hypothesis import strategies as st
from test_datasette import get

from pytest_profllm.browse.compact_table import compact
from pytest_profllm.results.landing import LANDING
from pytest_profllm.results.table import TABLE


def _table_markup(page: str) -> str:
    return page[page.index("<table"):page.index("</table>")]


def test_our_table_pages_carry_no_indentation(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    generate(db, 150)
    landing, full, other = get([db], f"/results/{LANDING}", f"/results/{TABLE}",
                               "/results/gate_runs")
    for page in (landing, full):
        assert page.status_code == 200
        table = _table_markup(page.text)
        assert table.count("<tr>") > 10
        assert re.search(r"\n[ \t]", table) is None
        assert "\n\n" not in table
        # The cells themselves, not the whitespace between them (41 % of it before).
        between = sum(len(gap) for gap in re.findall(r"\n\s*", table))
        assert between < 0.05 * len(table), between / len(table)
    # Another table keeps Datasette's template as it is.
    assert re.search(r"\n {8,}<td", _table_markup(other.text))


def test_the_templates_are_still_listed(tmp_path: Path) -> None:
    """`datasette serve` lists every template at start-up."""
    db = tmp_path / "results.db"
    generate(db, 12)

    async def names() -> list[str]:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        return list(datasette.jinja_env.list_templates())

    assert "_table.html" in asyncio.run(names())


def test_a_template_whose_whitespace_is_content_is_left_alone() -> None:
    source = "<pre>\n    {% for x in xs %}\n    {{ x }}\n    {% endfor %}\n</pre>\n"
    assert compact(source) == source


_LINES = st.recursive(
    st.sampled_from(["<td>{{ v }}</td>", "text", "<th {% if v %}a{% endif %}>", ""]).map(
        lambda line: [line]
    ),
    lambda inner: st.tuples(st.sampled_from(["if v", "for v in vs"]), inner).map(
        lambda pair: [
            f"{{% {pair[0]} %}}",
            *pair[1],
            "{% endif %}" if pair[0] == "if v" else "{% endfor %}",
        ]
    ),
    max_leaves=12,
).flatmap(lambda lines: st.lists(st.just(lines), min_size=1, max_size=3))


@settings(max_examples=100, deadline=None)
@given(blocks=_LINES, indents=st.lists(st.integers(0, 12), min_size=60, max_size=60))
def test_compact_renders_the_same_markup(blocks: list[list[str]], indents: list[int]) -> None:
    """A `_table.html` can come from --template-dir: whatever its lines, compacting it keeps
    every character it renders but the whitespace between them."""
    lines = [line for block in blocks for line in block]
    source = "".join(" " * indents[i % 60] + line + "\n" for i, line in enumerate(lines))
    env = jinja2.Environment(autoescape=True)
    context = {"v": "<x>", "vs": ["a", "b"]}
    before = env.from_string(source).render(context)
    after = env.from_string(compact(source)).render(context)
    assert re.sub(r"\s+", "", after) == re.sub(r"\s+", "", before)
    assert len(after) <= len(before)
