"""The `profllm` command: each subcommand is a module of this package whose `register` adds
its parser and handler; main dispatches to the handler and turns its one error, CliError,
into one clean line on stderr and the exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Protocol

from pytest_profllm.cli import (
    backup,
    bench,
    calibrate,
    check,
    compare,
    engine_args,
    history,
    ingest,
    plan,
    rebuild,
    rerun,
    restore,
    schema,
    sim,
)
from pytest_profllm.cli.errors import (
    EXIT_INVALID,
    EXIT_NOTHING_MEASURED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)


class Command(Protocol):
    """A subcommand's module: `register` adds its parser to `profllm`'s and sets its
    `handler(args) -> exit status`, which raises CliError for what it cannot do."""

    def register(self, commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        ...


# Every subcommand, in the order `profllm --help` lists them: a new one is a module with a
# `register`, named here.
COMMANDS: tuple[Command, ...] = (
    plan, ingest, schema, engine_args, bench, history, compare, calibrate, check, rebuild,
    backup, restore, rerun, sim,
)

_EXIT_CODES = f"""exit status:
  {EXIT_OK}  success
  {EXIT_NOTHING_MEASURED}  bench: nothing was measured, or a request failed (a non-200 status, an
     error in its stream, a stream cut or stalled), or no output token;
     calibrate: the runs are too few or too alike to fit (the line says which would help)
     ingest, rebuild: a file was refused; check: a problem (the summary names the runs);
     compare: a metric regressed
  {EXIT_USAGE}  a usage error: a bad flag, a bad suite, a file that cannot be read
  {EXIT_INVALID}  bench: an invalid measurement (the client fell behind its schedule, or the
     server's token counts cannot be believed)
  {EXIT_UNREACHABLE}  bench: cannot connect to the server
  sim exits as a server does: 0 after SIGTERM or SIGINT, 1 or 2 when it cannot start"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profllm",
        description="vLLM serving benchmarks as pytest tests: tools around them.",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [sim.NAME]:
        # Everything after `sim` is the simulator's (its own -h/--help included): argparse's
        # REMAINDER would refuse an option first.
        return sim.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        result: int = args.handler(args)
    except CliError as error:
        prefix = f"profllm {args.command}: "
        print(prefix + str(error).replace("\n", "\n" + prefix), file=sys.stderr)
        return error.code
    return result


if __name__ == "__main__":
    sys.exit(main())
