"""The package's shape is a checked fact (docs/developing/architecture.md): the import-linter
contract in pyproject.toml holds and catches an upward import, no module takes part in an import
circle, and every import left inside a function says why."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
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


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of each import statement inside a function of `path`."""
    lines = path.read_text().splitlines()
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
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
