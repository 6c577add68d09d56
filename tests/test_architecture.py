"""The package's shape is a checked fact (docs/developing/architecture.md): the import-linter
contract in pyproject.toml holds and catches an upward import, no module takes part in an import
circle, and every import left inside a function says why. Its prose cannot rot: every file a
comment or docstring names exists, tests name their subject rather than an issue number, and
every test file is on the map of tests by stage (docs/developing/tests.md)."""

from __future__ import annotations

import ast
import functools
import glob
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_profllm"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the package under `root`, with `root`'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_layers_contract_holds() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    # A copy of the package in which the lease pool (hosts, the lowest layer) imports the
    # worker session (near the top): the contract must name it.
    shutil.copytree(PACKAGE, tmp_path / "pytest_profllm", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pool = tmp_path / "pytest_profllm" / "hosts" / "pool.py"
    pool.write_text(pool.read_text() + "\nfrom pytest_profllm.session import worker  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout
    assert "Layers follow the data path BROKEN" in done.stdout
    assert "pytest_profllm.hosts.pool -> pytest_profllm.session.worker" in done.stdout


def test_no_module_takes_part_in_an_import_circle() -> None:
    graph = grimp.build_graph("pytest_profllm", cache_dir=None)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    circles = [
        (module, other)
        for module, imported in imports.items()
        for other in imported
        if module != other and graph.chain_exists(importer=other, imported=module)
    ]
    assert circles == []


def statements(node: ast.AST) -> Iterator[ast.AST]:
    """`node` and every statement under it: what holds a docstring (a module, class or
    function) or an import is a statement, so expressions are not walked into."""
    yield node
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, ()):
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                yield from statements(child)


@functools.cache
def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of each import statement inside a function of `path`."""
    lines = path.read_text().splitlines()
    found: dict[int, str] = {}
    for node in statements(ast.parse("\n".join(lines))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in statements(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    found[inner.lineno] = lines[inner.lineno - 1]
    return sorted(found.items())


def test_every_import_inside_a_function_says_why() -> None:
    # Kept only to defer a heavy or optional dependency, or in a script that runs in vLLM's
    # Python: a comment on the line, or just above it (a `try:` may stand between), says which.
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for lineno, line in function_level_imports(path):
            above = [text.strip() for text in lines[max(0, lineno - 4) : lineno - 1]]
            if "#" not in line and not any(text.startswith("#") for text in above):
                unexplained.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert unexplained == []


def test_the_map_names_every_package_and_top_level_module() -> None:
    # docs/developing/architecture.md is the map: a subpackage or top-level module that is not
    # in its table of layers is a room the map leaves out.
    page = (ROOT / "docs" / "developing" / "architecture.md").read_text()
    table = "\n".join(line for line in page.splitlines() if line.startswith("| "))
    packages = [f"`{path.parent.name}/`" for path in PACKAGE.glob("*/__init__.py")]
    entry_points = ("__init__.py", "__main__.py")
    modules = [path.stem for path in PACKAGE.glob("*.py") if path.name not in entry_points]
    missing = [name for name in packages if name not in table]
    missing += [
        name for name in modules if f"`{name}`" not in table and f"`{name}.py`" not in table
    ]
    assert missing == []


# The Python files whose prose is checked: the package, the tests, the root conftest.py and the
# benchmark scripts.
SOURCES = sorted(
    [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        ROOT / "conftest.py",
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
)


@functools.cache
def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring of `path`
    (read once a session: two tests read every file's)."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in statements(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((first.lineno, first.value.value))
    return found


# What counts as a path of this repository, in prose: a token of letters, digits and `_.*-`
# with at least one `/` inside, not starting with one (`/metrics`, `/proc/stat` are routes and
# host files), that ends with one of FILE_ENDINGS or starts with one of TOP_FOLDERS. A token
# without a slash (`limits.py`, `test_sim_cost.py`) is not checked: it names a module the
# reader finds by its name. Trailing `.` and `,` are punctuation.
TOP_FOLDERS = ("benchmarks/", "docs/", "pytest_profllm/", "tests/", ".ci/")
FILE_ENDINGS = (".py", ".md", ".yaml", ".yml", ".toml", ".json")
PATH_TOKEN = re.compile(r"(?<![\w./*-])([\w.*-]+(?:/[\w.*-]*)+)")
# Other projects' files, named where we follow them: vLLM's source (`vllm/v1/metrics/...`) and
# its own benchmarks folder, pytest's and xdist's (`src/_pytest/...`, `xdist/...`),
# Datasette's, and shared/, the folder of published runs and tools kept beside the clone.
FOREIGN = ("vllm/", "benchmarks/kernels/", "src/", "xdist/", "datasette/", "shared/")


def named_paths(text: str) -> list[str]:
    """The repository paths `text` names, by the rule above (foreign ones included)."""
    paths = (token.rstrip(".,") for token in PATH_TOKEN.findall(text))
    return [path for path in paths if path.endswith(FILE_ENDINGS) or path.startswith(TOP_FOLDERS)]


def is_example(path: str) -> bool:
    """A made-up path, for illustration: a part named `x`, ending `_x` or in capitals
    (`x/bench.yaml`, `benchmarks/bench_x.yaml`, `tests/data/schema_versions/NAME`)."""
    stems = [part.split(".")[0] for part in path.split("/") if part not in ("", ".ci")]
    return any(stem == "x" or stem.endswith("_x") or stem.isupper() for stem in stems)


def exists(path: str, beside: Path) -> bool:
    """Whether `path` is a file or folder (a glob may match several) under the repository's
    root, under the package (`run/serve.py`) or beside the file that names it (engine/'s
    modules name the scripts of its `in_vllm/` folder so). `x/y.py` also exists as the package
    `x/y/`, for a module split into one."""
    candidates = [path, path.removesuffix(".py")] if path.endswith(".py") else [path]
    return any(
        glob.glob(str(base / candidate))
        for base in (ROOT, PACKAGE, beside)
        for candidate in candidates
    )


def dangling(path: Path, text: str) -> list[str]:
    """The paths `text` (prose of the file `path`) names that are not in the repository."""
    return [
        named
        for named in named_paths(text)
        if not (named.startswith(FOREIGN) or is_example(named) or exists(named, path.parent))
    ]


def test_every_file_a_comment_or_docstring_names_exists() -> None:
    # A renamed or split module leaves its old name in the prose that pointed at it.
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {named}"
        for path in SOURCES
        for line, text in prose(path)
        for named in dangling(path, text)
    ]
    assert missing == []


def test_the_path_check_sees_a_missing_file_and_passes_over_the_rest() -> None:
    beside = PACKAGE / "load" / "bench.py"
    text = (
        "Re-measured in run/remeasure.py (now load/attempts.py), see tests/test_suite.py,"
        " docs/options.md, .ci/run and `tests/test_capacity*.py`; vLLM's"
        " vllm/v1/metrics/loggers.py; served at /metrics; in and out: 32/16 tokens; an example"
        " x/bench.yaml; the package plan/suite.py, split or not; beside it, server_state.py."
    )
    assert named_paths(text) == [
        "run/remeasure.py",
        "load/attempts.py",
        "tests/test_suite.py",
        "docs/options.md",
        ".ci/run",
        "tests/test_capacity*.py",
        "vllm/v1/metrics/loggers.py",
        "x/bench.yaml",
        "plan/suite.py",
    ]
    assert dangling(beside, text) == ["run/remeasure.py"]
    assert exists("data/accuracy", PACKAGE / "load")
    assert exists("pytest_profllm/sim.py", ROOT)  # the module as the package it was split into


# This project's issues are named by subject, never by number: a bare "issue N" or "issue #N"
# (or "issues N"). Another project's is `<project> #N` (xdist #1386, vLLM PR #13932), which
# this does not match.
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_test_docstring_or_comment_names_an_issue_number() -> None:
    tests = [path for path in SOURCES if not path.is_relative_to(PACKAGE)]
    named = [
        f"{path.relative_to(ROOT)}:{line}: {match}"
        for path in tests
        for line, text in prose(path)
        for match in ISSUE_NUMBER.findall(text)
    ]
    assert named == []
    assert ISSUE_NUMBER.findall("Issue 38. Before: (issue #22) xdist #1386") == [
        "Issue 38",
        "issue #22",
    ]


def test_every_test_file_is_on_the_map_of_tests_by_stage() -> None:
    # docs/developing/tests.md says which test files exercise which stage; a test file not in
    # its table, or a row naming a file that is gone, is the map gone stale.
    page = (ROOT / "docs" / "developing" / "tests.md").read_text()
    table = "\n".join(line for line in page.splitlines() if line.startswith("| "))
    mapped = re.findall(r"`(test_\w+\.py)`", table)
    files = sorted(path.name for path in (ROOT / "tests").glob("test_*.py"))
    assert sorted(set(files) - set(mapped)) == [], "test files missing from the map"
    assert sorted(set(mapped) - set(files)) == [], "the map names test files that are gone"
    assert len(mapped) == len(set(mapped)), "a test file is under two stages"
