"""`profllm history DB`: where a metric shifted in a results database's history, printed and
stored as change points (gates/history.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.gates import history
from pytest_profllm.plan.regression import parse_tolerance


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    history_ = commands.add_parser(
        "history",
        help="find where a metric shifted in a results database's history (change points)",
        description="For every fingerprint (server configuration, workload, engine and "
        "version, devices) in DB, find the sessions after which a metric's mean shifted "
        "(ruptures' PELT over per-session means), print them and store them in the "
        "change_points table, which Datasette shows.",
    )
    history_.add_argument("db", type=Path, metavar="DB", help="a results.db written by a run")
    history_.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="a result metric, repeatable (default: output_throughput, median_ttft_ms, "
        "median_tpot_ms)",
    )
    history_.add_argument(
        "--case", metavar="PATTERN", help="only case ids LIKE this SQL pattern (default: all)"
    )
    history_.add_argument(
        "--min-change",
        default="5%",
        metavar="PERCENT",
        help="smallest shift of the mean reported (default: 5%%)",
    )
    history_.add_argument(
        "--any-version",
        action="store_true",
        help="one history across engine versions (the version left out of the fingerprint)",
    )
    history_.set_defaults(handler=_history)


def _history(args: argparse.Namespace) -> int:
    refuse_newer_database(args.db)
    if not args.db.is_file():
        raise CliError(f"{args.db}: no such database")
    try:
        min_change = parse_tolerance(args.min_change)
    except ValueError as error:
        raise CliError(f"--min-change: {error}") from None
    found: list[history.Finding] = []
    for metric in args.metric or ["output_throughput", "median_ttft_ms", "median_tpot_ms"]:
        try:
            count, findings = history.analyse(
                args.db, metric, args.case, min_change, args.any_version
            )
        except ValueError as error:
            raise CliError(str(error)) from None
        for finding in findings:
            point = finding.change.point
            print(
                f"{finding.case_id} [{finding.fingerprint}] {metric}: "
                f"{finding.change.before:.4g} -> {finding.change.after:.4g} "
                f"({finding.change.change:+.1%}) from session {point.key} (run {point.run_id})"
            )
        print(f"{metric}: {len(findings)} change point(s) in {count} history(ies)")
        found += findings
    history.save(args.db, found)
    return 0
