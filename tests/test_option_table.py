"""The table of option declarations: what each entry makes (its addoption, its addini, its value
in a session), docs/options.md's table made from it, and the parsers only the table uses."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_profllm.options import Settings, Table, parse_max_cases, parse_seconds, value_of
from pytest_profllm.options.declare import Option, register
from pytest_profllm.options.docs_table import END, START, markdown_table, with_table
from pytest_profllm.options.parsers import OneOf, parse_switch
from pytest_profllm.options.table import OPTIONS

REPO = Path(__file__).resolve().parent.parent
OPTIONS_PAGE = REPO / "docs" / "options.md"


def test_the_options_page_shows_the_declared_options() -> None:
    page = OPTIONS_PAGE.read_text()
    assert with_table(page, markdown_table()) == page, (
        "docs/options.md's options table is not the table of declarations "
        "(pytest_profllm/options/table.py): run `python -m pytest_profllm.options` from the "
        "repository's root to write it"
    )


def test_the_table_is_rewritten_between_its_markers_only(tmp_path: Path) -> None:
    page = tmp_path / "options.md"
    page.write_text(f"# Options\n\n{START}\n| stale |\n{END}\n\nProse stays.\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_profllm.options", str(page)],
        capture_output=True, text=True, check=True,
    )
    assert "rewritten" in done.stdout
    assert page.read_text() == f"# Options\n\n{START}\n{markdown_table()}{END}\n\nProse stays.\n"
    with pytest.raises(ValueError, match="lacks the markers"):
        with_table("# Options\n", markdown_table())


def test_a_row_per_declaration_with_its_flag_ini_key_and_default() -> None:
    rows = markdown_table().splitlines()[2:]
    assert len(rows) == len(OPTIONS)
    assert "| `--profllm-engine {auto,vllm,sim}` | `profllm_engine` | `auto` |" in rows[2]
    assert "| `--profllm-ports START-END` | `profllm_ports` | `20000-21999` |" in rows[6]
    assert rows[-1].startswith("| | `profllm_suite_glob` | `bench_*.yaml` |")
    assert any(row.startswith("| `--profllm-no-load-cores` | | off |") for row in rows)


def test_each_flag_and_ini_key_is_declared_once_and_named_alike() -> None:
    flags = [option.flag for option in OPTIONS if option.flag]
    inis = [option.ini for option in OPTIONS if option.ini]
    assert len(set(flags)) == len(flags) and len(set(inis)) == len(inis)
    assert all(flag.startswith("--profllm-") for flag in flags)
    for option in OPTIONS:
        if option.flag and option.ini:
            assert option.ini == option.dest, option.flag
        # Values that take a text need a metavar for --help and the docs.
        if option.flag and not option.is_switch and option.choices is None:
            assert option.metavar, option.flag


def test_every_parser_of_the_table_has_a_unit_test() -> None:
    tests = "\n".join(path.read_text() for path in (REPO / "tests").glob("test_*.py"))
    parsers = {option.parse for option in OPTIONS if option.parse is not str}
    untested = sorted(
        parse.__name__ for parse in parsers
        if not isinstance(parse, OneOf) and f"{parse.__name__}(" not in tests
    )
    assert untested == []


# --- what an entry makes ------------------------------------------------------------------

_EXAMPLE = Option(
    "--profllm-example-seconds", "profllm_example_seconds", parse_seconds, 5.0,
    "an example", metavar="SECONDS", env="PROFLLM_EXAMPLE_SECONDS",
)
_EXAMPLE_CHOICE = Option(
    "--profllm-example-mode", "profllm_example_mode", OneOf(("fast", "slow")), "fast", "a mode"
)
_EXAMPLE_SWITCH = Option(
    "--profllm-example-switch", "profllm_example_switch", parse_switch, False, "a switch"
)


class _ExamplePlugin:
    @staticmethod
    def pytest_addoption(parser: pytest.Parser) -> None:
        register(parser, [_EXAMPLE, _EXAMPLE_CHOICE, _EXAMPLE_SWITCH])


@pytest.fixture
def example(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("PROFLLM_EXAMPLE_SECONDS", raising=False)
    pytester.plugins.append(_ExamplePlugin())
    return pytester


def test_the_command_line_then_the_environment_then_the_ini_file_then_the_default(
    example: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    example.makeini("[pytest]\n")
    assert value_of(example.parseconfig(), _EXAMPLE) == 5.0
    example.makeini("[pytest]\nprofllm_example_seconds = 7\n")
    assert value_of(example.parseconfig(), _EXAMPLE) == 7.0
    monkeypatch.setenv("PROFLLM_EXAMPLE_SECONDS", "8")
    assert value_of(example.parseconfig(), _EXAMPLE) == 8.0
    assert value_of(example.parseconfig("--profllm-example-seconds=9"), _EXAMPLE) == 9.0


@pytest.mark.parametrize(
    ("ini", "env", "message"),
    [
        ("profllm_example_seconds = soon", "", "ini option profllm_example_seconds: expected "
         "seconds, got 'soon'"),
        ("", "-1", "PROFLLM_EXAMPLE_SECONDS: expected a positive number of seconds, got '-1'"),
        ("profllm_example_mode = medium", "", "ini option profllm_example_mode: 'medium' is not "
         "one of fast, slow"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_where_it_came_from(
    example: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ini: str, env: str, message: str
) -> None:
    example.makeini(f"[pytest]\n{ini}\n")
    monkeypatch.setenv("PROFLLM_EXAMPLE_SECONDS", env)
    config = example.parseconfig()
    with pytest.raises(pytest.UsageError) as error:
        value_of(config, _EXAMPLE)
        value_of(config, _EXAMPLE_CHOICE)
    assert str(error.value) == message


def test_choices_are_checked_by_argparse_on_the_command_line(example: pytest.Pytester) -> None:
    example.makeini("[pytest]\n")
    with pytest.raises(pytest.UsageError, match=r"invalid choice: 'medium' \(choose from"):
        example.parseconfig("--profllm-example-mode", "medium")
    assert value_of(example.parseconfig("--profllm-example-mode=slow"), _EXAMPLE_CHOICE) == "slow"


def test_a_switch_is_a_flag_and_a_bool_ini_key(example: pytest.Pytester) -> None:
    example.makeini("[pytest]\n")
    assert value_of(example.parseconfig(), _EXAMPLE_SWITCH) is False
    assert value_of(example.parseconfig("--profllm-example-switch"), _EXAMPLE_SWITCH) is True
    example.makeini("[pytest]\nprofllm_example_switch = yes\n")
    assert value_of(example.parseconfig(), _EXAMPLE_SWITCH) is True


def test_help_states_the_ini_key_the_environment_and_the_default(
    example: pytest.Pytester,
) -> None:
    example.makeini("[pytest]\n")
    result = example.runpytest("--help", plugins=[_ExamplePlugin()])
    text = " ".join(result.stdout.str().split())
    assert (
        "an example (ini: profllm_example_seconds; env: PROFLLM_EXAMPLE_SECONDS; default: 5)"
        in text
    )
    assert "a switch (ini: profllm_example_switch; default: off)" in text
    assert "profllm_example_seconds (string): as --profllm-example-seconds" in text


def test_declared_defaults_are_the_settings_defaults(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    settings = Settings.from_config(pytester.parseconfig())
    assert settings.ports == Table.ports.default
    assert settings.max_cases == Table.max_cases.default
    assert settings.remeasure == Table.remeasure.default
    assert settings.saturation_margin == Table.saturation_margin.default


# --- the parsers only the table uses ------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("1", 1), ("10000", 10000), (" 3 ", 3)])
def test_parse_max_cases_accepts_counts(text: str, expected: int) -> None:
    assert parse_max_cases(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "many", ""])
def test_parse_max_cases_rejects_anything_else(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--profllm-max-cases: expected a count"):
        parse_max_cases(text)


def test_one_of_keeps_the_word_and_lists_the_choices() -> None:
    parse = OneOf(("on", "off", "auto"))
    assert parse("off") == "off"
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'On' is not one of on, off, auto$"):
        parse("On")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("YES", True), (" 1 ", True), ("off", False), ("0", False)],
)
def test_parse_switch_reads_the_words_pytest_reads(text: str, expected: bool) -> None:
    assert parse_switch(text) is expected


def test_parse_switch_refuses_other_words() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid truth value 'maybe'"):
        parse_switch("maybe")
