"""How well the virtual clock agrees with the real-time simulated engine, and how much faster.

    python benchmarks/perf/virtual_clock.py [--out DIR] [--part serve|capacity|both]

serve: the example suites the virtual clock runs (`benchmarks/bench_smoke.yaml`,
`bench_parallel.yaml`, `bench_trace.yaml`, `bench_engine_args.yaml`) once with
`--profllm-engine sim` (a server per configuration, sleeping each step, measured over HTTP)
and once with `--profllm-sim-clock virtual`; per case and headline metric the relative
difference, the real-time records the client did not keep up with marked (their figures
measure the host). Target: within 3 % where the client keeps up.

capacity: two configurations (Qwen3-8B, max_num_seqs 8 and 32) x two SLO sets, the capacity
and its bracket on both clocks, and each search's wall time. They agree where each clock's
capacity lies in the other's bracket (the brackets overlap).

Each session is a pytest run of its own (`-p no:cacheprovider`), so the figures are what a
user gets; run it under `nice` on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVE_SUITES = ("bench_smoke.yaml", "bench_parallel.yaml", "bench_trace.yaml",
                "bench_engine_args.yaml")
HEADLINE = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "p99_e2el_ms")
TARGET = 0.03
CAPACITY_SUITE = """\
name: capacity_{name}
description: "Qwen3-8B, max_num_seqs 8 and 32, capacity under {slo}"
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [8, 32]
  max_model_len: 4096
benchmark:
  kind: capacity
  dataset_name: random
  num_prompts: 60
  random_input_len: 256
  random_output_len: 32
  slo: {slo}
  search: {{over: request_rate, low: 4, high: 256, precision: 10%, min_duration_s: 3,
           max_time_s: 300}}
"""
SLO_SETS = {
    "median": "{median_ttft_ms: 200, median_tpot_ms: 20}",
    "p90": "{p90_ttft_ms: 400, p90_tpot_ms: 25}",
}


LAG_MS: float | None = None  # --max-schedule-lag
REUSE = False  # --reuse: summarise the records already in --out, run nothing


def run_session(paths: list[Path], out: Path, clock: str) -> float:
    """One pytest session over `paths` into `out`; its wall time in seconds."""
    if REUSE and list(out.glob("*.json")):
        return float("nan")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, paths),
            "--profllm-out", str(out), "--profllm-engine", "sim", "--profllm-sim-clock", clock,
            "--profllm-no-saturation-stop"]
    if LAG_MS is not None:
        argv += ["--profllm-max-schedule-lag", f"{LAG_MS:g}"]
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - began
    if done.returncode not in (0, 1) or not list(out.glob("*.json")):
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit(f"pytest exited {done.returncode}")
    return wall


def records(out: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for path in out.glob("*.json"):
        record = json.loads(path.read_text())
        found[record["case_id"]] = record
    return found


def relative(virtual: float | None, real: float | None) -> float | None:
    if virtual is None or real is None or real == 0:
        return None
    return virtual / real - 1


def serve_part(work: Path) -> None:
    paths = [ROOT / "benchmarks" / name for name in SERVE_SUITES]
    walls = {clock: run_session(paths, work / f"serve-{clock}", clock)
             for clock in ("virtual", "real")}
    real, virtual = records(work / "serve-real"), records(work / "serve-virtual")
    print(f"serve: {len(real)} cases; wall time real-time {walls['real']:.1f} s, virtual "
          f"{walls['virtual']:.1f} s (whole pytest sessions)")
    print(f"{'case':58} {'metric':20} {'real':>10} {'virtual':>10} {'diff':>7}")
    kept_up, behind = [], []
    by_metric: dict[str, list[float]] = {metric: [] for metric in HEADLINE}
    for case_id in sorted(real):
        measured, predicted = real[case_id], virtual.get(case_id)
        if predicted is None or predicted.get("status") == "skipped":
            why = predicted.get("message") if predicted else "no virtual record"
            print(f"{case_id:58} skipped on the virtual clock: {why}")
            continue
        valid = measured.get("validity") == "valid"
        for metric in HEADLINE:
            a, b = measured["results"].get(metric), predicted["results"].get(metric)
            diff = relative(b, a)
            if diff is None:
                continue
            (kept_up if valid else behind).append(abs(diff))
            if valid:
                by_metric[metric].append(diff)
            mark = "" if valid else "  (real-time invalid: " + \
                "; ".join(measured.get("validity_reasons") or [])[:60] + ")"
            print(f"{case_id[-58:]:58} {metric:20} {a:10.4g} {b:10.4g} {diff:+7.1%}{mark}")
    print("per metric, where the client kept up: median difference [lowest, highest], "
          f"figures within {TARGET:.0%}")
    for metric, diffs in by_metric.items():
        if diffs:
            ordered = sorted(diffs)
            within = sum(1 for d in diffs if abs(d) <= TARGET)
            print(f"  {metric:20} {ordered[len(ordered) // 2]:+7.1%} [{ordered[0]:+.1%}, "
                  f"{ordered[-1]:+.1%}]  {within}/{len(diffs)}")
    for label, diffs in (("client kept up", kept_up), ("real-time run invalid", behind)):
        if diffs:
            within = sum(1 for d in diffs if d <= TARGET)
            print(f"{label}: {len(diffs)} figures, {within} within {TARGET:.0%}, worst "
                  f"{max(diffs):.1%}, median {sorted(diffs)[len(diffs) // 2]:.1%}")


def capacity_part(work: Path) -> None:
    suites = []
    for name, slo in SLO_SETS.items():
        path = work / f"bench_capacity_{name}.yaml"
        path.write_text(CAPACITY_SUITE.format(name=name, slo=slo))
        suites.append(path)
    walls = {clock: run_session(suites, work / f"capacity-{clock}", clock)
             for clock in ("virtual", "real")}
    real, virtual = records(work / "capacity-real"), records(work / "capacity-virtual")
    print(f"\ncapacity: wall time of both sessions: real-time {walls['real']:.1f} s, virtual "
          f"{walls['virtual']:.1f} s")
    print(f"{'case':52} {'real':>22} {'s':>6} {'virtual':>22} {'s':>6}  agree")
    for case_id in sorted(real):
        a, b = real[case_id].get("capacity") or {}, virtual.get(case_id, {}).get("capacity") or {}

        def shown(c: dict[str, Any]) -> str:
            low, high = (c.get("bracket") or [None, None])
            return f"{c.get('capacity') or 0:.3g} [{low or 0:.3g}, {high or 0:.3g}]"

        brackets = [c.get("bracket") or [None, None] for c in (a, b)]
        lows = [low for low, _ in brackets if low is not None]
        highs = [high for _, high in brackets if high is not None]
        agree = bool(lows) and (not highs or max(lows) <= min(highs))
        valid = "" if real[case_id].get("validity") == "valid" else " (real-time invalid)"
        print(f"{case_id[-52:]:52} {shown(a):>22} {a.get('elapsed_s', 0):6.1f} {shown(b):>22} "
              f"{b.get('elapsed_s', 0):6.1f}  {'yes' if agree else 'NO'}{valid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the records here")
    parser.add_argument("--part", choices=("serve", "capacity", "both"), default="both")
    parser.add_argument("--max-schedule-lag", type=float, default=None, metavar="MS",
                        help="the sessions' --profllm-max-schedule-lag (raise it on a host "
                        "too busy for the real-time client to keep 10 ms)")
    parser.add_argument("--reuse", action="store_true",
                        help="summarise the records already in --out; run only what is missing")
    args = parser.parse_args()
    global LAG_MS, REUSE
    LAG_MS, REUSE = args.max_schedule_lag, args.reuse
    work = args.out or Path(tempfile.mkdtemp(prefix="profllm-virtual-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"records in {work}")
    if args.part in ("serve", "both"):
        serve_part(work)
    if args.part in ("capacity", "both"):
        capacity_part(work)


if __name__ == "__main__":
    main()
