"""The `profllm` command's one error: a line (or lines) to report, with the exit status; and
the exit statuses every command shares."""

from __future__ import annotations

from pathlib import Path

from pytest_profllm.results.schema_version import NewerSchema, refuse_newer_file

# The exit statuses of every command, listed in `profllm --help` (main.py).
EXIT_OK = 0
EXIT_NOTHING_MEASURED = 1
EXIT_USAGE = 2
EXIT_INVALID = 3
EXIT_UNREACHABLE = 4


class CliError(Exception):
    """A problem to report (one line per problem) with an exit status, 2 unless given.

    Command handlers raise it, turning the library's own exceptions into it, and main prints
    it: no other exception is the command's way of failing."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def refuse_newer_database(db: Path) -> None:
    """A database a newer plugin wrote: one line, before a command reads it."""
    try:
        refuse_newer_file(db)
    except NewerSchema as error:
        raise CliError(str(error)) from None
