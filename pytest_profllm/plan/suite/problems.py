"""A suite's problems: the error that stops it, and each problem as one line naming the
file, the line and the key, with what is allowed there."""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from pytest_profllm.engine.secrets import REDACTED, is_secret


class SuiteError(Exception):
    """A suite that cannot be run; the message has one line per problem, each naming file,
    line and key."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class _Problems:
    """The problems of one suite, reported together in line order."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[tuple[int, str]] = []

    def add(self, line: int | None, text: str) -> None:
        entry = (line or 0, f"{at_line(self.where, line)}: {text}")
        if entry not in self.found:
            self.found.append(entry)

    def error(self) -> SuiteError:
        return SuiteError([text for _, text in sorted(self.found, key=lambda e: e[0])])


def describe_error(
    error: ValidationError,
    where: str,
    lines: dict[tuple[Any, ...], int],
    model: type[BaseModel],
    prefix: tuple[Any, ...] = (),
) -> str:
    """The first validation error as one line: `file:line: key: what is wrong; what is allowed`."""
    line, text = describe_errors(error, lines, model, prefix)[0]
    return f"{at_line(where, line)}: {text}"


def describe_errors(
    error: ValidationError,
    lines: dict[tuple[Any, ...], int],
    model: type[BaseModel],
    prefix: tuple[Any, ...] = (),
) -> list[tuple[int | None, str]]:
    """Every validation error as (line, `key: what is wrong; what is allowed`)."""
    described = []
    for each in error.errors():
        loc = prefix + tuple(each["loc"])
        line = _nearest_line(lines, loc)
        key = ".".join(str(part) for part in loc) or "(top level)"
        if each["type"] == "extra_forbidden":
            allowed = _allowed_fields(model, loc[len(prefix) :])
            hint = did_you_mean(str(loc[-1]), allowed)
            described.append((line, f"unknown key '{key}'{hint}; allowed: {', '.join(allowed)}"))
            continue
        message = each["msg"].removeprefix("Value error, ")
        described.append((line, f"{key}: {message}{_shown_input(loc, each.get('input'))}"))
    return described


def _shown_input(loc: tuple[Any, ...], value: Any) -> str:
    # A whole block is too long to quote, and may hold an api_key; a secret is never shown.

    if isinstance(value, dict | list):
        return ""
    if any(isinstance(part, str) and is_secret(part) for part in loc):
        return f" (got {REDACTED})"
    shown = repr(value)
    if len(shown) > _MAX_SHOWN:  # a megabyte value is no part of one line
        shown = f"{shown[:_MAX_SHOWN]}... ({len(shown):,} characters)"
    return f" (got {shown})"


_MAX_SHOWN = 200


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed where an error points, walking nested models along its location."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        else:
            # Inside a dict[str, Model] or list[Model]: the key or index leads to the Model.
            args = get_args(current)
            current = args[-1] if args else None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return list(model.model_fields)


def did_you_mean(name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def at_line(where: str, line: int | None) -> str:
    """`file:line`, or just `file` where the line is unknown (a marker's dict)."""
    return f"{where}:{line}" if line else where


def _nearest_line(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None
