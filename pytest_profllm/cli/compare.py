"""`profllm compare A B`: two results, each a database or a folder of records, case by case,
judged by the regression gate (gates/compare.py)."""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.gates.baseline import is_database
from pytest_profllm.gates.compare import DEFAULT_METRICS, compare, table
from pytest_profllm.gates.regression import GateSettings
from pytest_profllm.options.parsers import parse_confidence

EXIT_REGRESSED = 1


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    compare_ = commands.add_parser(
        "compare",
        help="compare two results folders or databases case by case, as the regression gate "
        "would",
        description="Match the cases of A and B by fingerprint (server configuration, "
        "workload, engine and its version, devices), take each side's latest session of a "
        "case (all its repeats, valid measurements only, as a baseline is taken) and judge B "
        "against A with the regression gate: the change of each metric, its bootstrap "
        "interval and the decision (improved, unchanged, regressed, or not-judged with the "
        "reason). Exit status 0 where nothing regressed, 1 where a metric regressed, 2 where "
        "A or B cannot be read.",
    )
    compare_.add_argument("a", type=Path, metavar="A",
                          help="the baseline: a results.db or a folder of records")
    compare_.add_argument("b", type=Path, metavar="B",
                          help="the new run: a results.db or a folder of records")
    compare_.add_argument(
        "--metric", action="append", metavar="NAME",
        help="a metric the gate can judge, repeatable, at the gate's default tolerance "
        f"(default: {', '.join(DEFAULT_METRICS)}, each where the case measures it)",
    )
    compare_.add_argument(
        "--any-version", action="store_true",
        help="match cases across engine versions (the version left out of the fingerprint)",
    )
    compare_.add_argument(
        "--confidence", type=parse_confidence, default=GateSettings().confidence,
        metavar="LEVEL", help="the intervals' confidence level (default: %(default)s)",
    )
    compare_.add_argument("--json", action="store_true",
                          help="print the rows as a JSON list instead of a table")
    compare_.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace) -> int:
    for path in (args.a, args.b):
        if not path.exists():
            raise CliError(f"{path}: no such database or folder of records")
        if is_database(path):
            refuse_newer_database(path)
    try:
        rows = compare(args.a, args.b, args.metric, not args.any_version,
                       GateSettings(confidence=args.confidence))
    except (ValueError, OSError, sqlite3.Error) as error:
        raise CliError(str(error)) from None
    if args.json:
        print(json.dumps([row.as_json() for row in rows], indent=1))
    else:
        print("\n".join(table(rows)))
    return EXIT_REGRESSED if any(row.decision == "regressed" for row in rows) else 0
