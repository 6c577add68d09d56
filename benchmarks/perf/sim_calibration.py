"""The simulator's engine model against published vLLM runs: error per row, fitted and unseen.

    python benchmarks/perf/sim_calibration.py              # each row: published, simulated, error
    python benchmarks/perf/sim_calibration.py --cv         # and leave-one-source-out errors
    python benchmarks/perf/sim_calibration.py --fit --cv   # refit the overheads on every row too

Rows are those of shared/data/published-vllm-benchmarks.md and published-vllm-benchmarks-2.md
(`pytest_profllm/sim/calibration.py` holds them), replayed on the virtual clock with the shipped
device profiles. `--cv` fits the free overheads (`calibration.GRID`, coordinate descent) on all
sources but one, predicts that one's rows, and repeats for every source: the figure that says
how the simulator does on runs it was never fitted to. `--fit` prints the fit on every row, the
values the profiles ship (`Overheads`' defaults). Rows a source marks as low trust are printed
apart and counted in neither.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

from pytest_profllm.sim.calibration import (
    ROWS,
    START,
    Evaluations,
    RowResult,
    fit,
    leave_one_source_out,
    median_abs,
    reproduce,
)


def _fmt(error: float | None) -> str:
    return "      -" if error is None else f"{error * 100:+6.0f}%"


def report(title: str, results: list[RowResult]) -> None:
    print(f"\n{title}")
    print(
        f"{'row':>3} {'src':3} {'model':42} {'device':11} {'tp':>2} {'tok/s':>8} {'sim':>8} "
        f"{'err':>7} {'TPOT ms':>8} {'sim':>7} {'err':>7}"
    )
    for trusted in (True, False):
        group = [r for r in results if bool(r.row.low_trust) != trusted]
        if not trusted and group:
            print("low trust, counted in neither median:")
        for r in group:
            row = r.row
            published = row.total_throughput or row.output_throughput
            tpot = None if row.tpot_not_comparable else row.median_tpot_ms or row.median_itl_ms
            notes = []
            if row.total_throughput:
                notes.append("total tok/s")
            if row.median_itl_ms and not row.tpot_not_comparable:
                notes.append("ITL")
            notes += [text for text in (row.tpot_not_comparable, row.low_trust) if text]
            print(
                f"{row.number:3d} {row.source:3} {row.model[-42:]:42} {row.device:11} {row.tp:2d} "
                f"{published or float('nan'):8.1f} {r.output_throughput:8.1f} "
                f"{_fmt(r.throughput_error)} {tpot or float('nan'):8.2f} {r.median_tpot_ms:7.2f} "
                f"{_fmt(r.tpot_error)}{'  (' + '; '.join(notes) + ')' if notes else ''}"
            )
    trusted_rows = [r for r in results if not r.row.low_trust]
    far = sorted(
        r.row.number
        for r in trusted_rows
        if any(abs(e or 0) > 0.3 for e in (r.throughput_error, r.tpot_error))
    )
    throughput = [r.throughput_error for r in trusted_rows]
    tpot_errors = [r.tpot_error for r in trusted_rows]
    print(
        f"median absolute error: throughput {median_abs(throughput) * 100:.1f} % "
        f"({sum(e is not None for e in throughput)} rows), median TPOT "
        f"{median_abs(tpot_errors) * 100:.1f} % ({sum(e is not None for e in tpot_errors)} rows); "
        f"rows over 30 %: {far}"
    )
    # Where a source sits as a whole: a source the model over- or under-predicts on every row
    # is a difference between sources (their hardware, harness, settings), not noise.
    print("median signed error by source, throughput / TPOT (simulated / published - 1):")
    for source in sorted({r.row.source for r in trusted_rows}):
        rows = [r for r in trusted_rows if r.row.source == source]
        figures = [
            _signed([r.throughput_error for r in rows]),
            _signed([r.tpot_error for r in rows]),
        ]
        count = f"{len(rows)} row{'s' if len(rows) > 1 else ''}"
        print(f"  {source:3} {count:>7}: {figures[0]:>6} / {figures[1]:>6}")


def _signed(errors: list[float | None]) -> str:
    values = [e for e in errors if e is not None]
    return f"{statistics.median(values) * 100:+.0f} %" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the overheads on every row")
    parser.add_argument("--cv", action="store_true", help="leave-one-source-out errors")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one a core)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    report("shipped profiles (fitted on these rows)", [reproduce(row) for row in ROWS])
    with multiprocessing.Pool(args.jobs) as pool:
        run(args, Evaluations(pool=pool if args.jobs > 1 else None))
    print(f"wall time {time.perf_counter() - began:.0f} s ({args.jobs} processes)")


def run(args: argparse.Namespace, evaluate: Evaluations) -> None:
    if args.fit:
        everything = {row.source for row in ROWS if not row.low_trust}
        chosen = fit(evaluate, everything, args.passes)
        print("\nfitted on every source:", chosen, f"(from {START})", flush=True)
        report("refitted on every row", evaluate(chosen))
    if args.cv:
        predicted, fitted = leave_one_source_out(evaluate, args.passes)
        for source, params in fitted.items():
            print(f"fit without {source}: {params}")
        report("leave-one-source-out: each source predicted by a fit on the others", predicted)
    print(f"\n{evaluate.count} parameter sets evaluated")


if __name__ == "__main__":
    main()
