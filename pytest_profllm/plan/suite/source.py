"""A suite's YAML file: read, refused where a key is given twice or aliases expand past
reason (before anything expands them), each key's line found, and a relative dataset_path
read from the suite's folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pytest_profllm.plan.suite.model import Suite
from pytest_profllm.plan.suite.problems import SuiteError, at_line
from pytest_profllm.plan.suite.validate import validate_suite

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry


def load_suite_file(
    path: Path, registry: Registry | None = None
) -> tuple[Suite, dict[tuple[Any, ...], int]]:
    """Read and validate a YAML suite; returns the suite and each key path's line (1-based)."""
    try:
        text = path.read_text()
        # Composing shares an alias's node (cheap even for a "billion laughs"); its size and
        # its keys are checked before anything expands it.
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_node(node, str(path))
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        raise SuiteError(_yaml_problem(error, str(path), text)) from None
    except (OSError, yaml.YAMLError) as error:
        raise SuiteError(f"{path}: cannot read suite: {error}") from None
    lines = _key_lines(node) if node is not None else {}
    if not isinstance(data, dict):
        raise SuiteError(f"{path}:1: a suite is a mapping with 'server:' and 'benchmark:' blocks")
    _paths_from(path.parent, data.get("benchmark"))
    return validate_suite(data, str(path), lines, registry), lines


# `dataset_path: profllm:trace_example.jsonl` names a file the package ships (load/data/),
# so an example suite works wherever it is copied.
SHIPPED_PREFIX = "profllm:"
SHIPPED_DATA = Path(__file__).resolve().parents[2] / "load" / "data"


def _paths_from(folder: Path, benchmark: object) -> None:
    """A relative `dataset_path` names a file beside the suite, wherever pytest runs from."""
    if not isinstance(benchmark, dict) or "dataset_path" not in benchmark:
        return
    value = benchmark["dataset_path"]

    def resolved(item: object) -> object:
        if isinstance(item, str) and item.startswith(SHIPPED_PREFIX):
            return str(SHIPPED_DATA / item.removeprefix(SHIPPED_PREFIX))
        if isinstance(item, str) and item and not Path(item).expanduser().is_absolute():
            return str(folder / item)
        return item

    benchmark["dataset_path"] = (
        [resolved(item) for item in value] if isinstance(value, list) else resolved(value)
    )


# A suite of this many values, aliases expanded, is no suite anyone wrote by hand.
MAX_SUITE_VALUES = 100_000


def _check_node(root: yaml.Node, where: str) -> None:
    """SuiteError for a suite whose aliases expand past MAX_SUITE_VALUES, or with a key given
    twice in one mapping (YAML keeps the last silently; a suite must not)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = 1  # an alias of an enclosing node (a cycle) counts once
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key, value in node.value:
                line = key.start_mark.line + 1
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise SuiteError(
                            f"{where}:{line}: key {key.value!r} appears twice in one mapping "
                            f"(first at line {seen[key.value]}): YAML would keep the last alone"
                        )
                    seen[key.value] = line
                total += size(key) + size(value)
                if total > MAX_SUITE_VALUES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_SUITE_VALUES:
                    break
        sizes[id(node)] = total
        if total > MAX_SUITE_VALUES:
            raise SuiteError(
                f"{at_line(where, node.start_mark.line + 1)}: the suite expands to more than "
                f"{MAX_SUITE_VALUES:,} values through YAML aliases; refused"
            )
        return total

    size(root)


def _yaml_problem(error: yaml.MarkedYAMLError, where: str, text: str) -> str:
    """`file:line: invalid YAML: ...` at the line of the mistake, saying what YAML expected.

    PyYAML marks where it gave up (problem_mark); for an unclosed bracket or quote, or a key
    without its colon, that is a later line, and the mistake is where the construct began
    (context_mark)."""
    problem = error.problem or "cannot parse"
    context = error.context or ""
    mark = error.problem_mark
    if problem == "mapping values are not allowed here" and mark is not None:
        # `model m` above `max_num_seqs: 4`: YAML reads the first line's text on into the
        # second and stops at its colon; the mistake is the line without one.
        source = text.splitlines()
        above = next((n for n in range(mark.line - 1, -1, -1) if source[n].strip()), None)
        line_above = source[above].strip() if above is not None else ""
        plain_text = ":" not in line_above and not line_above.startswith(("-", "#"))
        if above is not None and plain_text:
            return (
                f"{at_line(where, above + 1)}: invalid YAML: expected 'key: value', found "
                f"no ':' on this line (YAML read it on into line {mark.line + 1})"
            )
    starts = context.startswith(("while scanning", "while parsing a flow"))
    mark = error.context_mark if starts and error.context_mark else error.problem_mark
    line = mark.line + 1 if mark is not None else None
    message = f"invalid YAML: {problem}"
    if context and error.context_mark is not None:
        message += f" ({context} that began at line {error.context_mark.line + 1}"
        if error.problem_mark is not None:
            message += f"; YAML stopped at line {error.problem_mark.line + 1}"
        message += ")"
    return f"{at_line(where, line)}: {message}"


def _key_lines(node: yaml.Node, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    lines: dict[tuple[Any, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key_path = (*path, key_node.value)
            lines[key_path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, key_path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            lines.update(_key_lines(item, (*path, index)))
    return lines
