"""`profllm calibrate DB`: the simulated engine's profile fitted to one host's real vLLM runs
(the fit is fit_runs.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pytest_profllm.cli.errors import CliError, refuse_newer_database
from pytest_profllm.cli.fit_runs import CalibrationError, calibrate, report_lines, write_profile


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    calibrate_ = commands.add_parser(
        "calibrate",
        help="fit the simulated engine's device profile to one host's own vLLM runs",
        description="Fit the simulator's overheads (matmul rate and bandwidth shares, cost "
        "per step, per running sequence and per streamed token, the API server's latency) "
        "to the valid vLLM runs in DB of one device, vLLM version and model, replaying each "
        "on the simulator's virtual clock. Prints every run's leave-one-configuration-out "
        "error on throughput, median TTFT, TPOT and ITL; refuses (exit status 1, one line) "
        "runs too few or too alike to fit, saying which runs would help. Use the profile "
        "with --profllm-sim-profile.",
    )
    calibrate_.add_argument("db", type=Path, metavar="DB", help="a results.db written by a run")
    calibrate_.add_argument(
        "--where",
        metavar="SQL",
        help="an SQL condition on benchmark_runs' columns that picks the runs (default: all "
        "valid vLLM runs)",
    )
    calibrate_.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="PROFILE.toml",
        help="write the fitted profile there (default: print the errors only)",
    )
    calibrate_.add_argument(
        "--base",
        metavar="NAME",
        help="the shipped profile to start from (default: the one the runs' GPU name matches)",
    )
    calibrate_.add_argument(
        "--hold-out",
        metavar="SQL",
        help="an SQL condition that picks runs to leave out of the fit and predict by it "
        "(say, the configurations you have not planned on), instead of leaving each "
        "configuration out in turn",
    )
    calibrate_.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    refuse_newer_database(args.db)
    if args.output is not None:
        _check_output(args.output)  # before the fit, which takes minutes
    try:
        calibration = calibrate(args.db, args.where, args.base, hold_out=args.hold_out)
    except CalibrationError as error:
        raise CliError(str(error), error.code) from None
    for line in report_lines(calibration):
        print(line)
    if args.output is not None:
        write_profile(calibration, args.output)
        print(f"profile written to {args.output}: --profllm-sim-profile {args.output}")
    return 0


def _check_output(path: Path) -> None:
    """A profile file may be written at `path`: not a folder, in a folder that exists (made
    by nobody but the user: a mistyped path must not become folders)."""
    if path.is_dir():
        raise CliError(f"-o {path}: is a folder; name the profile file to write")
    if not path.parent.is_dir():
        raise CliError(f"-o {path}: no such folder {path.parent}")
