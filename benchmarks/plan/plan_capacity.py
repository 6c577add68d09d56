"""What-if planning: which GPU, tensor-parallel size and batch limit carries the most load
under an SLO for a workload, and at what cost per million output tokens. Predictions of the
simulated engine on the virtual clock, never measurements.

    python benchmarks/plan/plan_capacity.py --out plan [--device H100-SXM --device H200 ...]
        [--profile my-h100.toml ...] [--price H100-SXM=2.99 ...] [--tp 1 --tp 2]
        [--max-num-seqs 64 --max-num-seqs 256]

For each device a suite (`bench_plan_<device>.yaml` in OUT: the capacity search below over the tp x
batch-limit matrix) runs in a pytest session of its own with `--profllm-sim-clock virtual
--profllm-sim-device DEVICE`, and for each `--profile` file (a host's own profile, as `profllm
calibrate` writes it) with `--profllm-sim-profile FILE`; a device priced by `--price` is named
as its profile names it. All go into OUT (records and results.db: `datasette OUT/results.db`,
dashboard `capacity`, shows each configuration's capacity and bracket). Then a table: the
capacity with its bracket and limiting SLO, the output throughput at it, the GPUs it takes,
and the cost per million output tokens at `--price` (US dollars per GPU-hour; the defaults are
examples, give your own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen3-8B"
DEVICES = ("H100-SXM", "H200", "A100-80GB")
# Example on-demand prices per GPU-hour (US dollars), for the table's arithmetic only: pass
# your own with --price DEVICE=USD.
PRICES = {"H100-SXM": 3.00, "H200": 3.80, "A100-80GB": 1.80}
SLO = "{p99_ttft_ms: 500, p99_tpot_ms: 50}"
SUITE = """\
name: plan_{slug}
description: "What-if on {device}: {model} capacity under {slo} (virtual clock)"
server:
  model: {model}
  tensor_parallel_size: {tp}
  max_num_seqs: {seqs}
  max_model_len: 4096
benchmark:
  kind: capacity
  dataset_name: random
  num_prompts: 1000
  random_input_len: 512
  random_output_len: 64
  random_range_ratio: 0.5
  slo: {slo}
  search: {{over: request_rate, low: 1, high: 400, precision: 5%, max_probes: 14}}
"""


def price_of(text: str) -> tuple[str, float]:
    device, _, price = text.partition("=")
    try:
        return device, float(price)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DEVICE=USD, got {text!r}") from None


def plan(
    out: Path, devices: list[str], tps: list[int], seqs: list[int], files: list[Path]
) -> dict[str, float]:
    """One pytest session per device and per profile file; each one's wall time."""
    walls = {}
    chosen = [(device, ["--profllm-sim-device", device]) for device in devices]
    chosen += [(file.stem, ["--profllm-sim-profile", str(file.resolve())]) for file in files]
    for device, option in chosen:
        slug = device.lower().replace(" ", "-").replace(".", "-")
        suite = out / f"bench_plan_{slug}.yaml"
        suite.write_text(SUITE.format(slug=slug, device=device, model=MODEL, slo=SLO,
                                      tp=list(tps), seqs=list(seqs)))
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite),
                "--profllm-sim-clock", "virtual", *option,
                "--profllm-out", str(out), "-n", "2"]
        began = time.perf_counter()
        done = subprocess.run(argv, cwd=out, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        walls[device] = time.perf_counter() - began
        if done.returncode not in (0, 1):
            print(done.stdout[-3000:], done.stderr[-3000:])
            raise SystemExit(f"pytest on {device} exited {done.returncode}")
    return walls


def table(out: Path, prices: dict[str, float]) -> None:
    rows: list[dict[str, Any]] = []
    profiles = {}
    for path in out.glob("*.json"):
        record = json.loads(path.read_text())
        if record.get("capacity") is None or record["engine"].get("clock") != "virtual":
            continue
        sim = record["engine"].get("sim") or {}
        device = sim["device"]["name"]
        profiles[device] = sim["device"]["source"]
        server = record["config"]["server"]
        gpus = server["tensor_parallel_size"] * server["pipeline_parallel_size"]
        capacity = record["capacity"]
        tokens = record["results"].get("output_throughput") if capacity["capacity"] else None
        hourly = prices.get(device)
        cost = hourly * gpus / (tokens * 3600) * 1e6 if hourly and tokens else None
        rows.append({"device": device, "tp": server["tensor_parallel_size"],
                     "seqs": server["max_num_seqs"], "gpus": gpus, "capacity": capacity,
                     "tokens": tokens, "cost": cost, "valid": record["validity"] == "valid"})
    print(f"PREDICTIONS, not measurements: the simulated engine on the virtual clock, "
          f"{MODEL}, random 512 in / 64 out (+-50 %), SLO {SLO}; device profiles: "
          + ", ".join(f"{d} ({s})" for d, s in sorted(profiles.items())))
    width = max([10, *(len(r["device"]) for r in rows)])
    print(f"{'device':{width}} {'tp':>2} {'seqs':>4} {'capacity req/s [bracket]':>28} "
          f"{'limit':12} {'out tok/s':>9} {'$/GPU-h':>7} {'$/M out tok':>11}")
    rows.sort(key=lambda r: (r["device"], r["tp"], r["seqs"]))
    for row in rows:
        c = row["capacity"]
        low, high = c["bracket"]
        shown = (f"{c['capacity']:.3g} [{low:.3g}, {high:.3g}]" if c["capacity"] and high
                 else f">= {c['capacity']:.3g}" if c["capacity"] else "none")
        print(f"{row['device']:{width}} {row['tp']:>2} {row['seqs']:>4} {shown:>28} "
              f"{c['limit'] or '-':12} {row['tokens'] or 0:9.0f} "
              f"{prices.get(row['device'], float('nan')):7.2f} "
              f"{row['cost'] if row['cost'] is not None else float('nan'):11.3f}"
              + ("" if row["valid"] else "  (invalid)"))
    carried = [r for r in rows if r["capacity"]["capacity"] and r["valid"]]
    if not carried:
        return

    def named(chosen: list[dict[str, Any]]) -> str:
        return " and ".join(f"{r['device']} tp {r['tp']} max_num_seqs {r['seqs']}"
                            for r in chosen)

    def best(key: Any, lowest: bool = False) -> list[dict[str, Any]]:
        # Every configuration at the best value: ties are said, not broken by order.
        value = (min if lowest else max)(key(r) for r in carried)
        return [r for r in carried if key(r) == value]

    most = best(lambda r: round(r["capacity"]["capacity"], 6))
    print(f"most load: {named(most)}, {most[0]['capacity']['capacity']:.3g} req/s")
    per_gpu = best(lambda r: round(r["capacity"]["capacity"] / r["gpus"], 6))
    print(f"most load per GPU: {named(per_gpu)}, "
          f"{per_gpu[0]['capacity']['capacity'] / per_gpu[0]['gpus']:.3g} req/s per GPU")
    priced = [r for r in carried if r["cost"] is not None]
    if priced:
        cheapest = min(priced, key=lambda r: r["cost"])
        print(f"cheapest per million output tokens: {named([cheapest])}, "
              f"${cheapest['cost']:.3f} at ${prices[cheapest['device']]:.2f}/GPU-hour")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", action="append", default=None,
                        help=f"a shipped profile (default: {', '.join(DEVICES)}, unless "
                        "--profile is given)")
    parser.add_argument("--profile", action="append", type=Path, default=[],
                        help="a profile file (profllm calibrate writes one)")
    parser.add_argument("--tp", action="append", type=int, default=None)
    parser.add_argument("--max-num-seqs", action="append", type=int, default=None)
    parser.add_argument("--price", action="append", type=price_of, default=[],
                        help="DEVICE=USD per GPU-hour (defaults: "
                        + ", ".join(f"{d}={p}" for d, p in PRICES.items()) + ")")
    parser.add_argument("--reuse", action="store_true",
                        help="print the table of the records already in --out; run nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    began = time.perf_counter()
    devices = args.device if args.device is not None else [] if args.profile else list(DEVICES)
    walls = {} if args.reuse else plan(out, devices, args.tp or [1, 2],
                                        args.max_num_seqs or [64, 256], args.profile)
    table(out, {**PRICES, **dict(args.price)})
    if walls:
        print("wall time: " + ", ".join(f"{d} {s:.1f} s" for d, s in walls.items())
              + f"; all {time.perf_counter() - began:.1f} s (pytest -n 2, this host)")


if __name__ == "__main__":
    main()
