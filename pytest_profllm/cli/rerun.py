"""`profllm rerun RUN_ID`: one past case re-run from its record, gated against it (the suite
and the run are reproduce.py's)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pytest_profllm.cli.errors import CliError
from pytest_profllm.cli.reproduce import (
    Outcome,
    Rerun,
    RerunError,
    find_record,
    fingerprint_of,
    plan_rerun,
    rerun_command,
    run,
    session_repeats,
    write_suite,
)
from pytest_profllm.plan.suite import SuiteError


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rerun_ = commands.add_parser(
        "rerun",
        help="re-run one past case from its record, gated against it",
        description="Write the suite that reproduces one run's case from its record (server, "
        "workload with its seed, thresholds, regression, engine and simulated device), name "
        "each way this host differs from the record's, then run it with pytest, gated "
        "against the run's database (or records). Exit status 0 where the new run has the "
        "same fingerprint and every gated metric is unchanged, 1 where not, 2 where the run "
        "cannot be re-run (one line says why).",
    )
    rerun_.add_argument("run_id", metavar="RUN_ID", help="the run's id (benchmark_runs.run_id)")
    rerun_.add_argument(
        "--db", type=Path, metavar="DB",
        help="the results.db that holds the run; its records are looked for beside it",
    )
    rerun_.add_argument(
        "--records", type=Path, metavar="DIR",
        help="the folder of the run's record (default: the database's folder)",
    )
    rerun_.add_argument(
        "--write-suite", type=Path, metavar="FILE",
        help="write the suite there, a new file unless --force (default: "
        "OUT/bench_rerun_RUN_ID.yaml); it is its owner's alone (0600)",
    )
    rerun_.add_argument(
        "--force", action="store_true",
        help="replace the --write-suite FILE where it exists (default: refuse)",
    )
    rerun_.add_argument(
        "--no-run", action="store_true",
        help="only write the suite (and print the differences and the command), run nothing",
    )
    rerun_.add_argument(
        "--out", type=Path, metavar="DIR",
        help="the re-run's --profllm-out (default: rerun-RUN_ID in the current folder)",
    )
    rerun_.add_argument(
        "--pytest-option", action="append", default=[], metavar="OPTION",
        help="one more option for the pytest run, repeatable: "
        "--pytest-option=--profllm-ports=43000-43099",
    )
    rerun_.add_argument(
        "--secret", action="append", default=[], metavar="NAME=VALUE",
        help="the value of a server argument the record redacted (***), repeatable; "
        "api_key and hf_token also come from VLLM_API_KEY and HF_TOKEN",
    )
    rerun_.set_defaults(handler=_rerun)


def _rerun(args: argparse.Namespace) -> int:
    """0 where the re-run is a valid measurement with the record's fingerprint and no gated
    metric changed, 1 where not, CliError (2) where it cannot be re-run."""
    try:
        record = find_record(args.run_id, args.db, args.records)
        folder = args.records if args.records is not None else args.db.parent if args.db else None
        repeats = session_repeats(record, args.db, folder)
        plan = plan_rerun(record, _secrets(args.secret), repeats)
    except RerunError as error:
        raise CliError(str(error)) from None
    out = args.out or Path(f"rerun-{args.run_id}")
    suite = args.write_suite or out / f"bench_rerun_{args.run_id}.yaml"
    if suite.is_dir():
        raise CliError(f"--write-suite {suite}: is a folder; name the suite file to write")
    # A file the user named may be theirs: replaced only when they say so. The default one,
    # in OUT, is this command's own.
    if args.write_suite is not None and os.path.lexists(suite) and not args.force:
        raise CliError(f"--write-suite {suite}: exists; name a new file, or pass --force to "
                       "replace it")
    try:
        write_suite(plan, suite)
    except SuiteError as error:
        first = str(error).splitlines()[0]
        raise CliError(f"the suite written does not read back: {first}") from None
    except OSError as error:
        raise CliError(f"--write-suite {suite}: {error}") from None
    baseline = args.db if args.db is not None else args.records
    record = plan.record
    print(f"run {record['run_id']}: {record['case_id']} ({plan.kind}, engine "
          f"{record['engine']['name']}, fingerprint {fingerprint_of(record)})")
    for line in plan.differences:
        print(f"differs: {line}")
    if not plan.differences:
        print("this host: no difference from the record's environment")
    if repeats >= 2:
        print(f"repeats: {repeats}, as the record's session ran the case (the baseline: "
              "all its runs of the fingerprint)")
    for line in plan.notes:
        print(line)
    print(f"suite: {suite}")
    print("command: " + " ".join(rerun_command(plan, suite, out, baseline, args.pytest_option)[2:]))
    if args.no_run:
        return 0
    return _report(plan, run(plan, suite, out, baseline, args.pytest_option))


def _report(plan: Rerun, outcome: Outcome) -> int:
    """Prints the new run and the regression gate's decisions; the command's exit status."""
    if outcome.record is None:
        print(f"the re-run wrote no record (pytest exit status {outcome.returncode})")
        return 1
    new = outcome.record
    runs = f" (the last of {outcome.runs} repeats)" if outcome.runs > 1 else ""
    print(f"new run {new['run_id']}{runs}: {new['status']}, {new.get('validity') or 'valid'}, "
          f"fingerprint {fingerprint_of(new)} "
          + ("(the same)" if outcome.same_fingerprint else "(differs)"))
    figures = {v["metric"]: v for v in new.get("regression") or []}
    for metric, decision in outcome.decisions.items():
        print(f"gate {metric}: {decision}{_figures(figures.get(metric) or {})}")
    if not outcome.decisions:
        if not plan.suite.get("regression"):
            why = plan.notes[0] if plan.notes else (
                f"nothing the record gated or a {plan.kind} case's default gates name was "
                "measured by it")
        else:
            why = "the new run measured none of the gated metrics validly"
        print(f"gate: nothing judged ({why})")
    changed = any(decision != "unchanged" for decision in outcome.decisions.values())
    # A skipped or invalid re-run reproduced nothing, whatever pytest's status.
    measured = (new.get("validity") or "valid") == "valid"
    same = outcome.same_fingerprint and not changed and measured
    return 0 if same and outcome.returncode == 0 else 1


def _figures(item: dict[str, Any]) -> str:
    """`, old -> new (+x.x %)` where the regression item has both figures."""
    old, new, change = item.get("baseline"), item.get("value"), item.get("change")
    if not isinstance(old, int | float) or not isinstance(new, int | float):
        return ""
    text = f" ({old:.6g} -> {new:.6g}"
    if isinstance(change, int | float):
        text += f", {change:+.1%}"
    return text + ")"


def _secrets(pairs: list[str]) -> dict[str, str]:
    """--secret NAME=VALUE, each."""
    found = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise CliError(f"--secret {pair.split('=')[0]!r}: expected NAME=VALUE")
        found[name] = value
    return found
