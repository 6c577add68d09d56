"""`profllm sim MODEL [vllm serve arguments]`: the simulated engine, whose own parser
(sim/cli.py) reads everything after `sim`."""

from __future__ import annotations

import argparse

from pytest_profllm.sim.cli import main

NAME = "sim"
__all__ = ["NAME", "main", "register"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Only listed here, for `profllm --help`: main hands `profllm sim ...` to the simulator's
    # own parser before this one parses anything.
    commands.add_parser(
        NAME,
        help="run the simulated engine: profllm sim MODEL [vllm serve arguments] "
        "(profllm sim --help lists them)",
        add_help=False,
    )
