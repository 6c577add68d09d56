"""The simulator's engine model against published vLLM runs: error per row, and the fit.

    python benchmarks/perf/sim_calibration.py          # each row: published, simulated, error
    python benchmarks/perf/sim_calibration.py --fit    # search the free overheads again

Rows are those of shared/data/published-vllm-benchmarks.md (`pytest_profllm/sim/calibration.py`
holds them), replayed on the virtual clock. The fit searches the overheads of
`sim/hardware.py:Overheads` (coordinate descent on the median absolute error of output
throughput and median TPOT together) and prints them; the chosen values live in the device
profiles' `[overheads]` tables and in `Overheads`' defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from pytest_profllm.sim.calibration import ROWS, RowResult, median_abs, reproduce
from pytest_profllm.sim.hardware import device_profile


def _fmt(error: float | None) -> str:
    return "      -" if error is None else f"{error * 100:+6.0f}%"


def run(
    overrides: dict[str, float] | None = None, devices: tuple[str, ...] = ()
) -> list[RowResult]:
    results = []
    for row in ROWS:
        engine = row.engine()
        if overrides and (not devices or row.device in devices):
            engine = dataclasses.replace(engine, device=engine.device.with_overheads(**overrides))
        results.append(reproduce(row, engine))
    return results


def score(results: list[RowResult]) -> float:
    throughput = median_abs([r.throughput_error for r in results])
    tpot = median_abs([r.tpot_error for r in results])
    mean = statistics.fmean(
        abs(e) for r in results for e in (r.throughput_error, r.tpot_error) if e is not None
    )
    return max(throughput, tpot) + 0.2 * mean


def report(results: list[RowResult]) -> None:
    print(
        f"{'row':>3} {'model':44} {'device':9} {'tp':>2} {'out tok/s':>9} {'sim':>8} {'err':>7}"
        f" {'TPOT ms':>8} {'sim':>7} {'err':>7}"
    )
    for r in results:
        row = r.row
        published_tpot = row.median_tpot_ms or row.median_itl_ms
        print(
            f"{row.number:3d} {row.model:44} {row.device:9} {row.tp:2d} "
            f"{row.output_throughput or float('nan'):9.1f} {r.output_throughput:8.1f} "
            f"{_fmt(r.throughput_error)} {published_tpot or float('nan'):8.2f} "
            f"{r.median_tpot_ms:7.2f} {_fmt(r.tpot_error)}{'  (ITL)' if row.median_itl_ms else ''}"
        )
    print(
        f"median absolute error: output throughput "
        f"{median_abs([r.throughput_error for r in results]) * 100:.1f} % "
        f"({sum(r.throughput_error is not None for r in results)} rows), median TPOT "
        f"{median_abs([r.tpot_error for r in results]) * 100:.1f} % "
        f"({sum(r.tpot_error is not None for r in results)} rows)"
    )


GRID = {
    "step_ms": (0.6, 0.9, 1.2, 1.6, 2.2),
    "bandwidth_efficiency": (0.65, 0.72, 0.8, 0.87),
    "compute_efficiency": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
    "frontend_token_us": (0.0, 60.0, 120.0, 180.0, 240.0, 300.0, 400.0),
    "moe_efficiency": (0.25, 0.35, 0.5, 0.7),
    "request_ms": (20.0, 40.0, 60.0),
}


def fit(devices: tuple[str, ...], passes: int) -> dict[str, float]:
    base = device_profile(devices[0]).overheads if devices else None
    current = {name: getattr(base, name) for name in GRID} if base else {}
    if not current:
        current = {name: getattr(device_profile("H100-SXM").overheads, name) for name in GRID}
    best = score(run(current, devices))
    for _ in range(passes):
        for name, values in GRID.items():
            for value in values:
                trial = {**current, name: value}
                got = score(run(trial, devices))
                if got < best - 1e-4:
                    best, current = got, trial
                    print(f"  {name}={value}: score {best:.3f}", flush=True)
    return current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="search the overheads")
    parser.add_argument("--devices", nargs="*", default=[], help="fit only these profiles' rows")
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    began = time.process_time()
    if args.fit:
        chosen = fit(tuple(args.devices), args.passes)
        print("fitted overheads:", chosen)
        report(run(chosen, tuple(args.devices)))
    else:
        report(run())
    print(f"CPU time: {time.process_time() - began:.1f} s")


if __name__ == "__main__":
    main()
