"""README and the manual (docs/**/*.md, the MkDocs site) are the documentation: their
commands, options, files and suites must match what ships."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
OPTIONS_PAGE = REPO / "docs" / "options.md"
# Where a path the documentation names must exist (a bare `plan/case.py` is inside the package).
TOP_FOLDERS = ("benchmarks", "tests", "pytest_profllm", ".ci", "docs")


def pages() -> dict[str, str]:
    """README and every page of the manual, by their path in the repository."""
    found = {"README.md": README}
    for path in sorted((REPO / "docs").rglob("*.md")):
        found[str(path.relative_to(REPO))] = path.read_text()
    return found


def shell_blocks(text: str) -> list[str]:
    """The `sh` code blocks of a page, a line continued with a backslash joined to the next."""
    return [block.replace("\\\n", " ") for block in re.findall(r"```sh\n(.*?)```", text, re.S)]


def yaml_blocks(text: str) -> list[Any]:
    shown = []
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        with contextlib.suppress(yaml.YAMLError):  # an excerpt need not be a whole document
            shown.append(yaml.safe_load(block))
    return shown


def option_table_flags(text: str) -> set[str]:
    """The options named in the first cell of a Markdown table's rows."""
    return set(re.findall(r"^\| `(--profllm-[a-z-]+)", text, flags=re.M))


@functools.cache
def registered() -> tuple[frozenset[str], frozenset[str]]:
    """The `--profllm-*` flags and `profllm_*` ini keys the plugin registers, from pytest --help."""
    help_text = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    flags = frozenset(re.findall(r"--profllm-[a-z-]+", help_text))
    inis = frozenset(re.findall(r"^  (profllm_[a-z_]+)", help_text, flags=re.M))
    assert len(flags) >= 7 and len(inis) >= 8, help_text
    return flags, inis


def test_readme_has_the_two_setup_commands() -> None:
    commands = [line for block in shell_blocks(README) for line in block.splitlines()]
    assert any(
        "pip install -e ." in line and "pytest benchmarks/ -n 4 --profllm-out results/" in line
        for line in commands
    )
    assert any('pip install -e ".[test]"' in line for line in commands)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = next(
        line
        for block in shell_blocks(README)
        for line in block.splitlines()
        if 'pip install -e ".[test]"' in line
    )
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_ci_builds_the_manual_strictly() -> None:
    # A broken link or a page missing from the site fails CI, not a reader.
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert 'pip install -e ".[docs]"' in "\n".join(ci)
    assert any(line.strip().startswith("mkdocs build --strict") for line in ci)
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^\s*font: false", config, flags=re.M), "the theme must not fetch fonts"


def test_every_option_and_ini_key_is_on_the_options_page() -> None:
    flags, inis = registered()
    text = OPTIONS_PAGE.read_text()
    for flag in sorted(flags):
        assert f"`{flag}" in text, f"{flag} is not documented in docs/options.md"
    for ini in sorted(inis):
        assert f"`{ini}`" in text, f"ini option {ini} is not documented in docs/options.md"


def test_every_option_in_an_options_table_is_registered() -> None:
    flags, _ = registered()
    tables = {name: option_table_flags(text) for name, text in pages().items()}
    assert tables["README.md"], "README has no options table"
    assert tables[str(OPTIONS_PAGE.relative_to(REPO))], "docs/options.md has no options table"
    unknown = [f"{name}: {flag}" for name, shown in tables.items() for flag in shown - flags]
    assert unknown == [], "documented but not an option the plugin registers"


def test_the_option_table_check_sees_an_unknown_option() -> None:
    # The check above must be able to fail: a made-up row is caught.
    flags, _ = registered()
    assert option_table_flags("| `--profllm-no-such-thing N` | 1 | x |\n") - flags == {
        "--profllm-no-such-thing"
    }


def test_the_suites_the_docs_run_ship_as_they_show_them() -> None:
    # README's regression-gate example ran `pytest bench_gate.yaml`, a file the clone lacked.
    named = {
        (page, token)
        for page, text in pages().items()
        for block in shell_blocks(text)
        for line in block.splitlines()
        if "pytest " in line
        for token in line.split("#", 1)[0].split()
        if token.endswith((".yaml", ".yml"))
    }
    assert any(page == "README.md" for page, _ in named), "README runs no suite file by name"
    for page, path in sorted(named):
        assert (REPO / path).is_file(), f"{page} runs {path}, which is not in the repository"


def without_names(suite: Any) -> Any:
    """A suite as its cases see it: its name and description aside."""
    if not isinstance(suite, dict):
        return suite
    return {key: value for key, value in suite.items() if key not in ("name", "description")}


def shows(path: str, blocks: list[Any]) -> bool:
    suite = without_names(yaml.safe_load((REPO / path).read_text()))
    return suite in [without_names(block) for block in blocks]


def test_the_suites_the_docs_show_are_the_files() -> None:
    everywhere = [block for text in pages().values() for block in yaml_blocks(text)]
    assert shows("benchmarks/gate/bench_gate.yaml", everywhere), (
        "the manual's bench_gate.yaml differs from benchmarks/gate/bench_gate.yaml"
    )
    speculative = yaml_blocks(pages()["docs/writing-suites/speculative-decoding.md"])
    assert shows("benchmarks/bench_speculative.yaml", speculative), (
        "the manual's speculative decoding suite differs from "
        "benchmarks/bench_speculative.yaml"
    )
    assert shows("benchmarks/bench_smoke.yaml", yaml_blocks(README)), (
        "README's suite differs from benchmarks/bench_smoke.yaml"
    )


def test_every_file_the_docs_name_exists() -> None:
    # A renamed script or test file leaves its old path in a page nobody reruns.
    folders = "|".join(map(re.escape, TOP_FOLDERS))
    pattern = re.compile(rf"(?:^|[\s`(])((?:{folders})/[\w./*-]*[\w*])")
    missing = [
        f"{page}: {path}"
        for page, text in pages().items()
        for path in sorted(set(pattern.findall(text)))
        if not glob.glob(str(REPO / path))
    ]
    assert missing == []


def test_every_profllm_subcommand_the_docs_name_exists() -> None:
    help_text = subprocess.run(
        [str(Path(sys.executable).with_name("profllm")), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    named = {
        (page, command)
        for page, text in pages().items()
        for command in re.findall(r"`profllm ([a-z][a-z-]*)\b", text)
    }
    assert named
    unknown = [f"{page}: profllm {command}" for page, command in named if command not in help_text]
    assert unknown == []


def test_the_record_page_lists_every_field_the_schema_has() -> None:
    # The reference is the schema's top level, no more and no less: a field added to the
    # record shows up here as missing.
    schema = json.loads((REPO / "pytest_profllm" / "schema" / "record.schema.json").read_text())
    page = (REPO / "docs" / "reference" / "record.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", page, flags=re.M))
    assert listed == set(schema["properties"])
