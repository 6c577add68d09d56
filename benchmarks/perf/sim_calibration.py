"""The simulator's engine model against published vLLM runs: error per row, fitted and unseen.

    python benchmarks/perf/sim_calibration.py              # each row: published, simulated, error
    python benchmarks/perf/sim_calibration.py --cv         # and leave-one-source-out errors
    python benchmarks/perf/sim_calibration.py --fit --cv   # refit the overheads on every row too
    python benchmarks/perf/sim_calibration.py --per-source # one host's rows: fit all but one
    python benchmarks/perf/sim_calibration.py --cache-sweep 14,104  # rows against cache size

Rows are those of shared/data/published-vllm-benchmarks.md and published-vllm-benchmarks-2.md
(`pytest_profllm/sim/calibration.py` holds them), replayed on the virtual clock with the shipped
device profiles. `--cv` fits the free overheads (`calibration.GRID`, coordinate descent) on all
sources but one, predicts that one's rows, and repeats for every source: the figure that says
how the simulator does on runs it was never fitted to. `--fit` prints the fit on every row, the
values the profiles ship (`Overheads`' defaults). Rows a source marks as low trust are printed
apart and counted in neither.

`--per-source` is `profllm calibrate`'s case on published data: for every source with five or
more trusted rows of one host, the overheads are fitted on that host's rows alone
(`calibration.check_host`, `sim/fit_records.py`), and each row is predicted by a fit on the
others. It prints each row's error in sample and left out, and per source the median and
largest error on throughput and on TPOT (ITL where the source gives that), with the target:
a median of at most 5 % and no row over 15 %. Each row also says whether, under the fit,
it fills its KV cache (the simulator's peak usage, and preemptions): a run bound by the cache
turns on its size, which published rows do not give.

`--cache-sweep ROWS` replays those rows, under their host's fit on all its rows, with KV
caches from 70 % to 130 % of their server's (as the row's source shows it, else the
simulator's estimate from memory): how far a cache-bound row's figures move with a cache size
a source seldom publishes (a record of ours has it, `system.server_kv_cache_tokens`, which
`profllm calibrate` replays with).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from pytest_profllm.sim import fit_records
from pytest_profllm.sim.calibration import (
    BELOW_MEASURED_KERNELS,
    DISAGREE,
    PER_SOURCE_MIN_ROWS,
    ROWS,
    START,
    Evaluations,
    HostCheck,
    Row,
    RowResult,
    check_host,
    fit,
    leave_one_source_out,
    median_abs,
    observation_of,
    one_host_groups,
    reproduce,
)
from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.hardware import DeviceProfile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.profile_file import FittedOn, profile_toml
from pytest_profllm.sim.virtual import Outcome

# What published rows can pin: no TTFT (so no API latency), and the costs per sequence and per
# token left as shipped (a six-figure fit on S2's rows pinned neither); the roofline's
# sharpness freed, as S2's Qwen3-32B row asks for a softer one than its 8B and 14B rows.
PER_SOURCE_FREE = ("compute_efficiency", "bandwidth_efficiency", "step_ms", "roofline_sharpness")

_THROUGHPUT = ("output_throughput", "total_token_throughput")
_LATENCY = ("median_tpot_ms", "median_itl_ms")


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
            if row.number in DISAGREE:
                notes.append("sources disagree: " + DISAGREE[row.number])
            if row.number in BELOW_MEASURED_KERNELS:
                notes.append(BELOW_MEASURED_KERNELS[row.number])
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


def per_source(
    free: tuple[str, ...], jobs: int, max_evaluations: int, profiles: Path | None = None
) -> None:
    print(f"one host's rows, fitted on all but one (free: {', '.join(free)}):", flush=True)
    groups = list(one_host_groups().values())
    with multiprocessing.Pool(max(1, min(jobs, len(groups)))) as pool:
        tasks = [(rows, free, 1e-3, max_evaluations) for rows in groups]
        checks = pool.starmap(check_host, tasks)
    for rows, check in zip(groups, checks, strict=True):
        print_host(rows, check)
        if profiles is not None:
            print(f"  profile: {write_profile(profiles, rows, check, free)}")


def write_profile(
    folder: Path, rows: list[Row], check: HostCheck, free: tuple[str, ...]
) -> Path:
    """The host's fit on all its rows as a profile file, as `profllm calibrate` writes one
    (for `--profllm-sim-profile` and `plan_capacity.py --profile`)."""
    name = f"{check.source}-{check.device}"
    base = rows[0].engine().device
    profile = dataclasses.replace(check.fitted.profile(base), name=name, aliases=())
    fitted = FittedOn(
        run_ids=[f"published row {row.number}" for row in rows],
        device=f"{check.device} ({check.source}'s host)",
        vllm_version="",  # as the source ran it (shared/data's tables say which)
        model=", ".join(dict.fromkeys(row.model for row in rows)),
        date=datetime.date.today().isoformat(),
    )
    comments = [f"{check.source}'s {check.device} host, fitted on its {len(rows)} published rows "
                f"(benchmarks/perf/sim_calibration.py --per-source; free: "
                f"{', '.join(free)}; the rest as shipped)"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.lower()}.toml"
    path.write_text(profile_toml(profile, fitted, comments))
    return path


def cache_use(row: Row, profile: DeviceProfile, kv_tokens: int | None = None) -> Outcome:
    """The row replayed on `profile` as the per-source fit replays it (a KV cache of
    `kv_tokens`; None: the row's own, else the simulator's estimate from memory)."""
    observation = observation_of(row)
    if kv_tokens is not None:
        settings = observation.settings
        observation = dataclasses.replace(observation, settings=dataclasses.replace(
            settings, num_gpu_blocks=kv_tokens // settings.block_size))
    return fit_records.replay(observation, profile)


def print_host(rows: list[Row], check: HostCheck) -> None:
    source, device = check.source, check.device
    print(f"\n{source} on {device}, {len(rows)} rows; fit on all of them:")
    print("  " + ", ".join(f"{k} {v:.4g}" for k, v in check.fitted.params.items()))
    print(f"  pinned by the rows: {', '.join(check.fitted.pinned) or 'none'}")
    print(f"  {'row':>4} {'model':32} {'in sample':>22}   {'left out':>22}   KV cache (fit)")
    profile = check.fitted.profile(rows[0].engine().device)
    for inside, held in zip(check.in_sample, check.held_out, strict=True):
        row = next(r for r in rows if str(r.number) == held.observation.label)
        used = cache_use(row, profile)
        cache = f"peak {used.peak_kv_cache_usage:4.0%}, {used.preemptions} preempted"
        print(
            f"  {row.number:4d} {row.model[-32:]:32} {_pair(inside):>22}   "
            f"{_pair(held.errors):>22}   {cache}"
        )
    verdicts = []
    for label, names in (("throughput", _THROUGHPUT), ("TPOT", _LATENCY)):
        values = [_first(h.errors, names) for h in check.held_out]
        errors = [abs(v) for v in values if v is not None]
        if not errors:
            continue
        median, largest = statistics.median(errors), max(errors)
        ok = median <= 0.05 and largest <= 0.15
        verdicts.append(ok)
        print(
            f"  left out, {label}: median {median * 100:.1f} %, largest "
            f"{largest * 100:.1f} % ({len(errors)} rows) -> {'pass' if ok else 'FAIL'} "
            "(target: median <= 5 %, every row <= 15 %)"
        )
    print(f"  {source} on {device}: {'pass' if all(verdicts) else 'FAIL'}", flush=True)


def cache_sweep(numbers: list[int], free: tuple[str, ...], max_evaluations: int) -> None:
    """Each row's figures under its host's fit on all its rows, with KV caches of 70-130 % of
    its server's (the row's own, else the simulator's estimate)."""
    groups = one_host_groups()
    for number in numbers:
        rows = next((g for g in groups.values() if any(r.number == number for r in g)), None)
        if rows is None:
            raise SystemExit(f"--cache-sweep: row {number} is in no host of 5+ trusted rows")
        row = next(r for r in rows if r.number == number)
        base = rows[0].engine().device
        fitted = fit_records.fit([observation_of(r) for r in rows], base, free=free,
                                 steps=(0.05,), tolerance=1e-3, max_evaluations=max_evaluations)
        profile = fitted.profile(base)
        estimate = EngineModel(resolve_model(row.model), profile, row.tp,
                               kv_cache_dtype=row.kv_cache_dtype).kv_cache_tokens(
            row.settings.gpu_memory_utilization)
        shown = row.settings.num_gpu_blocks
        center = shown * row.settings.block_size if shown else estimate
        tpot = row.median_tpot_ms or row.median_itl_ms
        print(f"\nrow {number} ({row.source}, {row.model}, {row.workload}) under {row.source}'s "
              f"fit on its {len(rows)} rows; published {row.output_throughput} tok/s, "
              f"TPOT {tpot} ms; the simulator's cache estimate {estimate:,} tokens"
              + (f", the source's server's {center:,} (100 % below)" if shown else ""))
        for share in (0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3):
            outcome = cache_use(row, profile, int(center * share))
            summary = outcome.summary()
            figure = summary["median_tpot_ms"] if row.median_tpot_ms else summary["median_itl_ms"]
            throughput, published = summary["output_throughput"], row.output_throughput
            print(f"  cache {share:4.0%} ({int(center * share):>9,} tokens): "
                  f"{throughput:8.1f} tok/s "
                  f"({_fmt(throughput / published - 1) if published else '-'}), "
                  f"TPOT {figure:7.1f} ms ({_fmt(figure / tpot - 1) if tpot else '-'}), "
                  f"{outcome.preemptions} preempted")


def _first(errors: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((errors[name] for name in names if name in errors), None)


def _pair(errors: dict[str, float]) -> str:
    throughput, latency = _first(errors, _THROUGHPUT), _first(errors, _LATENCY)

    def one(error: float | None) -> str:
        return "     -" if error is None else f"{error * 100:+5.1f}%"

    return f"{one(throughput)} / {one(latency)}"


def _signed(errors: list[float | None]) -> str:
    values = [e for e in errors if e is not None]
    return f"{statistics.median(values) * 100:+.0f} %" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the overheads on every row")
    parser.add_argument("--cv", action="store_true", help="leave-one-source-out errors")
    parser.add_argument(
        "--per-source",
        action="store_true",
        help=f"each source's host with {PER_SOURCE_MIN_ROWS}+ rows: fit on all rows but one",
    )
    parser.add_argument(
        "--free",
        default=",".join(PER_SOURCE_FREE),
        help="--per-source: the overheads fitted (default: %(default)s)",
    )
    parser.add_argument(
        "--max-evaluations",
        type=int,
        default=60,
        help="--per-source: parameter sets a fit on all rows may try (each fold: half)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        help="--per-source: write each host's fit on all its rows as a profile file here",
    )
    parser.add_argument(
        "--cache-sweep",
        metavar="ROWS",
        help="rows (comma-separated) replayed under their host's fit with KV caches of 70-130 %% "
        "of their server's",
    )
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one a core)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    if args.cache_sweep:
        numbers = [int(text) for text in args.cache_sweep.split(",")]
        cache_sweep(numbers, tuple(args.free.split(",")), args.max_evaluations)
        print(f"wall time {time.perf_counter() - began:.0f} s")
        return
    if args.per_source:
        per_source(tuple(args.free.split(",")), args.jobs, args.max_evaluations, args.profiles)
        print(f"wall time {time.perf_counter() - began:.0f} s")
        return
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
