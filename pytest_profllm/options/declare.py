"""What one option of the `profllm` group is, and the three things made of its declaration:
its `addoption`, its `addini`, and its value in a session (`value_of`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pytest

from pytest_profllm.options.parsers import OneOf, parse_switch

T = TypeVar("T")

GROUP = "profllm"
GROUP_DESCRIPTION = "vLLM serving benchmarks (pytest-profllm)"


@dataclass(frozen=True)
class Option(Generic[T]):
    """One option: its flag, its ini key, the parser of its text (argparse's `type=`, and the
    ini value's), its default, and what it does."""

    flag: str | None  # `--profllm-...`; None: an ini key only
    ini: str | None  # `profllm_...`; None: the command line only
    parse: Callable[[str], T]  # OneOf: choices; parse_switch: an on/off flag
    default: T
    help: str  # plain text, for --help (which adds the ini key and the default)
    metavar: str | None = None
    # How --help and the docs word the default, where its value does not say it (Markdown).
    shown_default: str | None = None
    # docs/options.md's `meaning` cell (Markdown), where it says more than `help`.
    doc: str | None = None
    # An environment variable read after the command line and before the ini file.
    env: str | None = None
    # The value of the flag given alone, where it also takes one (`--flag` or `--flag=VALUE`).
    bare: T | None = None

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value in."""
        assert self.flag is not None
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.parse.choices if isinstance(self.parse, OneOf) else None

    @property
    def is_switch(self) -> bool:
        return self.parse is parse_switch

    def default_text(self) -> str:
        """The default as --help and the docs say it."""
        if self.shown_default is not None:
            return self.shown_default
        value: object = self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, int):
            return f"{value:,}"
        return "none" if value is None else str(value)

    def help_text(self) -> str:
        """`help`, then where else the value can come from and its default (its Markdown
        backticks, which the docs keep, left out)."""
        sources = [f"ini: {self.ini}"] if self.ini and self.flag else []
        sources += [f"env: {self.env}"] if self.env else []
        sources.append(f"default: {self.default_text().replace('`', '')}")
        return f"{self.help} ({'; '.join(sources)})"


def register(parser: pytest.Parser, options: Iterable[Option[Any]]) -> None:
    """Each option's `addoption` in the `profllm` group, and its `addini`."""
    group = parser.getgroup(GROUP, GROUP_DESCRIPTION)
    for option in options:
        if option.flag is not None:
            _add_flag(group, option)
        if option.ini is not None:
            if option.is_switch:
                parser.addini(option.ini, _ini_help(option), type="bool", default=option.default)
            else:  # read as text and parsed by value_of, so a bad value names the ini key
                parser.addini(option.ini, _ini_help(option), default=None)


def _add_flag(group: pytest.OptionGroup, option: Option[Any]) -> None:
    assert option.flag is not None
    help_text = option.help_text().replace("%", "%%")  # argparse formats help with %
    if option.is_switch:
        # None: not given, so the ini value applies; without an ini key, the default.
        default = None if option.ini is not None else option.default
        group.addoption(option.flag, action="store_true", default=default, help=help_text)
    elif option.bare is not None:
        group.addoption(
            option.flag, nargs="?", const=option.bare, type=option.parse, default=None,
            metavar=option.metavar, help=help_text,
        )
    elif option.choices is not None:
        # argparse checks the choices itself: its message lists them.
        group.addoption(option.flag, choices=option.choices, default=None, help=help_text)
    else:
        parse = None if option.parse is str else option.parse  # str: the text as given
        group.addoption(
            option.flag, metavar=option.metavar, type=parse, default=None, help=help_text
        )


def _ini_help(option: Option[Any]) -> str:
    return option.help_text() if option.flag is None else f"as {option.flag}"


def value_of(config: pytest.Config, option: Option[T]) -> T:
    """The command line's value (argparse parsed it), else the environment's, else the ini
    file's, each parsed by the option's parser (a bad one is a usage error naming where it came
    from), else the default."""
    if option.flag is not None:
        given = config.getoption(option.dest)
        if given is not None:
            return given  # type: ignore[no-any-return]  # argparse ran option.parse
    if option.env is not None:
        text = os.environ.get(option.env, "").strip()
        if text:
            return _parse(option, text, option.env)
    if option.ini is not None:
        raw = config.getini(option.ini)
        if isinstance(raw, bool):  # a switch: pytest read the word
            return raw  # type: ignore[return-value]
        if raw not in (None, ""):
            return _parse(option, str(raw), f"ini option {option.ini}")
    return option.default


def _parse(option: Option[T], text: str, source: str) -> T:
    try:
        return option.parse(text)
    except argparse.ArgumentTypeError as error:
        raise pytest.UsageError(f"{source}: {error}") from None
