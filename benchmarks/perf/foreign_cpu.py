"""What a busy host does to a measurement, and whether the record sees it:
`python benchmarks/perf/foreign_cpu.py`.

Runs the smoke suite (benchmarks/bench_smoke.yaml: 4 cases on the simulated engine, real
time, load cores held) once on the host as it is, then once with a CPU hog pinned to each
usable core in turn (a process outside the session spinning on that core). Every run keeps
its figures whatever the verdict (`--profllm-max-foreign-cpu=1`, `--profllm-remeasure=0`,
the schedule-lag and client-overhead verdicts left on), and prints per case: the share of the
load's cores that others used (`system.host_foreign_cpu_share`), the load's cores, median and
p99 TTFT and output throughput against the same case without the hog, the client's mean TTFT
against the server's own (its `/metrics` histograms over the load's window), and whether another
verdict (schedule lag, client overhead) had already called the case invalid. Whether the
figures move where the share rises is what sets `--profllm-max-foreign-cpu`'s default (off)
and the gate's note over a share of 0.25 (hosts/foreign_cpu.py).
Not a pytest file: it prints figures; every session is bounded in time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SESSION_TIMEOUT_S = 600


@contextlib.contextmanager
def hog(core: int | None) -> Iterator[None]:
    """A process outside the session spinning on `core` (None: no hog)."""
    if core is None:
        yield
        return
    process = subprocess.Popen(
        [sys.executable, "-c",
         f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"],
        start_new_session=True,
    )
    try:
        time.sleep(0.5)
        yield
    finally:
        process.kill()
        process.wait()


def session(out: Path, ports: str, core: int | None, suite: str) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider",
            f"--profllm-out={out}", f"--profllm-ports={ports}", "--profllm-max-foreign-cpu=1",
            "--profllm-remeasure=0"]
    with hog(core):
        subprocess.run(argv, cwd=REPO, capture_output=True, timeout=SESSION_TIMEOUT_S,
                       check=False)
    return [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]


def _figures(record: dict[str, Any]) -> dict[str, Any]:
    results, system = record.get("results") or {}, record.get("system") or {}
    return {
        "share": system.get("host_foreign_cpu_share"),
        "cores": (record.get("runtime") or {}).get("load_cores"),
        "median_ttft_ms": results.get("median_ttft_ms"),
        "p99_ttft_ms": results.get("p99_ttft_ms"),
        "output_throughput": results.get("output_throughput"),
        "client_mean_ttft_ms": results.get("mean_ttft_ms"),
        # The server's own mean over the load's window (its /metrics histograms).
        "server_mean_ttft_ms": system.get("server_ttft_mean_ms"),
        "validity": record.get("validity"),
        "reason": (record.get("message") or "")[:60],
    }


def _change(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{(value - base) / base:+.1%}"


def _over_server(row: dict[str, Any]) -> str:
    client, server = row["client_mean_ttft_ms"], row["server_mean_ttft_ms"]
    if client is None or not server:
        return "-"
    return f"{client:.1f} / {server:.1f} ({(client - server) / server:+.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="benchmarks/bench_smoke.yaml")
    parser.add_argument("--ports", default="29000-29199")
    args = parser.parse_args()
    cores: list[int | None] = [None, *sorted(os.sched_getaffinity(0))]
    by_hog: dict[int | None, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for core in cores:
            records = session(Path(tmp) / f"hog-{core}", args.ports, core, args.suite)
            by_hog[core] = {r["case_id"]: _figures(r) for r in records}
    quiet = by_hog[None]
    print("| hog on core | case | foreign share | load cores | median TTFT (ms) | p99 TTFT | "
          "output tok/s | mean TTFT client / server (ms) | validity |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|")
    for core, cases in by_hog.items():
        for case, row in sorted(cases.items()):
            base = quiet.get(case, {})
            ttft, p99 = row["median_ttft_ms"], row["p99_ttft_ms"]
            tput = row["output_throughput"]
            print(
                f"| {'none' if core is None else core} | {case.split('::', 1)[-1]} | "
                f"{row['share'] if row['share'] is not None else '-'} | {row['cores']} | "
                f"{ttft:.1f} ({_change(ttft, base.get('median_ttft_ms'))}) | "
                f"{p99:.1f} ({_change(p99, base.get('p99_ttft_ms'))}) | "
                f"{tput:.0f} ({_change(tput, base.get('output_throughput'))}) | "
                f"{_over_server(row)} | {row['validity']} {row['reason']} |"
                if ttft is not None and p99 is not None and tput is not None
                else f"| {core} | {case} | {row['share']} | - | - | - | - | - | {row['validity']} |"
            )


if __name__ == "__main__":
    main()
