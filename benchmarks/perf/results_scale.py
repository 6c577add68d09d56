"""The results side at 100,000 runs: `profllm ingest` time and memory, then Datasette's pages.

Generates N realistic records (`scale_records.py`: every case measured on the simulator's
virtual clock, every engine argument of the registry with its default, every workload, system
and runtime field, every standard metric; swept model, device, max_num_seqs,
tensor_parallel_size, request rate or concurrency; nightly sessions of the same cases, a few
with one configuration slowed and gated against the session before), writes them as record
files, checks them (`check`: the count of records that break the record's rules), times
`profllm ingest` of the folder (wall time and peak memory of the process), then serves the
database with `datasette serve` on 127.0.0.1 and times the landing page with its facets, a page
filtered on three columns, every canned query, every dashboard (as it opens and with common
choices: all sessions, filters, a bound, a case), the run page, and a full CSV export
(`pages_to_time` lists them).

    python benchmarks/perf/results_scale.py [--records 100000] [--repeat 15] [--keep DIR]
                                            [--pages-only | --ingest-only] [--no-csv]
                                            [--processes 2]

Run on demand (not collected by pytest). Targets: ingest under 30 s on 2 cores at 100,000
records and under 5 minutes at 1,000,000, memory bounded; every page's p95 under 0.5 s at
both; landing page under 300 KB; every row in the CSV.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from scale_records import generate  # beside this script: the records, measured on the simulator

MODELS = ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B")
DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
RATES: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, float("inf"))
CONCURRENCIES = (8, 32, 128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=15, help="requests per page timed")
    parser.add_argument("--keep", type=Path, help="generate into (and keep) this folder")
    parser.add_argument("--pages-only", action="store_true",
                        help="time the pages of the database already in --keep")
    parser.add_argument("--ingest-only", action="store_true", help="time the ingest alone")
    parser.add_argument("--no-csv", action="store_true",
                        help="leave out the full CSV exports (minutes at a million rows)")
    parser.add_argument("--processes", type=int, default=2,
                        help="processes that simulate the cases")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="profllm-scale-"))
    try:
        if args.pages_only:
            with served(root / "results.db") as base:
                time_pages(base, args.repeat, csv_exports=not args.no_csv)
        else:
            run(root, args.records, args.repeat, pages=not args.ingest_only,
                csv_exports=not args.no_csv, processes=args.processes)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def run(root: Path, count: int, repeat: int, pages: bool = True,
        csv_exports: bool = True, processes: int = 2) -> None:
    records = root / "records"
    db_path = root / "results.db"
    for stale in (db_path, db_path.with_name(db_path.name + "-wal"),
                  db_path.with_name(db_path.name + "-shm")):
        stale.unlink(missing_ok=True)  # a WAL file left beside a new database would corrupt it
    if not records.is_dir() or len(list(records.glob("*.json"))) != count:
        started = time.perf_counter()
        counts, violations = generate(records, count, processes=processes)
        print(f"generated {count} records in {time.perf_counter() - started:.1f} s "
              f"({sum(p.stat().st_size for p in records.iterdir()) / 1e6:.0f} MB): "
              + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())))
        print(f"check: {sum(violations.values())} violations "
              + ", ".join(f"{n} {rule}" for rule, n in violations.items() if n))
    for label in ("ingest", "ingest again"):
        seconds, peak_mib, output = timed_ingest(db_path, records)
        print(f"{label}: {seconds:.1f} s, peak memory {peak_mib:.0f} MiB (largest process), "
              f"load average {os.getloadavg()[0]:.1f}: {output}")
    print(f"database: {db_path.stat().st_size / 1e6:.0f} MB")
    if not pages:
        return
    with served(db_path) as base:
        time_pages(base, repeat, csv_exports)


def timed_ingest(db_path: Path, records: Path) -> tuple[float, float, str]:
    code = (
        "import resource, sys; from pytest_profllm.cli.main import main; rc = main(sys.argv[1:]); "
        "me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, "
        "resource.RUSAGE_CHILDREN)); "
        "print('peak_kib', max(me.ru_maxrss, kids.ru_maxrss), file=sys.stderr); "
        "print('cpu_s', me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, "
        "file=sys.stderr); "
        "sys.exit(rc)"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "ingest", str(db_path), str(records)],
                          capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    figures = dict(line.split() for line in done.stderr.splitlines()
                   if line.startswith(("peak_kib", "cpu_s")))
    summary = f"{done.stdout.strip()} (CPU {float(figures['cpu_s']):.1f} s)"
    return seconds, int(figures["peak_kib"]) / 1024, summary


class served:
    """`datasette serve DB` on a free loopback port, stopped on exit."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path

    def __enter__(self) -> str:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "datasette", "serve", str(self.db_path), "--host",
             "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(base + "/-/versions.json", timeout=2)
                return base
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("datasette did not start")

    def __exit__(self, *exc: object) -> None:
        os.killpg(self.process.pid, 15)
        self.process.wait(timeout=10)


def fetch(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - started, body


def pages_to_time(db: str, row: dict[str, Any]) -> dict[str, str]:
    """Every page a user opens, by label: the landing page, the full table, a filter, each
    canned query, each dashboard (as it opens, and with the choices people make), the run
    page. Extend this list with each new page."""
    from pytest_profllm.browse.dashboards import DASHBOARDS
    from pytest_profllm.browse.queries import CANNED_QUERIES

    case_id = f"{row['configuration']}::{row['workload']}"
    pages = {
        "landing page (/ -> runs, facets)": "/",
        "full table page (benchmark_runs, facets)": f"/{db}/benchmark_runs",
        "filtered on three columns": f"/{db}/runs?"
        + urlencode({"server_model": row["server_model"], "status": "passed",
                     "server_max_num_seqs": 128}),
        "landing page, regressed only (gate facet)": f"/{db}/runs?gate=regressed",
    }
    params = {"case_history": urlencode({"case_id": case_id}),
              "compare_runs": urlencode({"run_a": row["run_id"], "run_b": row["run_id"]}),
              "best_configuration": "max_p99_ttft_ms=400&max_p99_tpot_ms="}
    for name in CANNED_QUERIES:
        pages[f"canned query {name}"] = f"/{db}/{name}?{params.get(name, '')}"
    pages["dashboards (list)"] = f"/{db}/-/dashboards"
    for dashboard in DASHBOARDS:
        pages[f"dashboard {dashboard.name}"] = f"/{db}/-/dashboards/{dashboard.name}"
    pages["dashboard load, all sessions"] = f"/{db}/-/dashboards/load?session=all"
    pages["dashboard load, filtered (model, tp 2, ttft < 300)"] = (
        f"/{db}/-/dashboards/load?" + urlencode({
            "f.server_model": row["server_model"], "f.server_tensor_parallel_size": 2,
            "max.p99_ttft_ms": 300, "session": "all"}))
    pages["dashboard pareto, p99 TTFT bound"] = f"/{db}/-/dashboards/pareto?max_p99_ttft_ms=300"
    pages["dashboard history of a case"] = (
        f"/{db}/-/dashboards/history?" + urlencode({"case_id": case_id}))
    pages["run page"] = f"/{db}/-/run/{row['run_id']}"
    return pages


def time_pages(base: str, repeat: int, csv_exports: bool = True) -> None:
    import json

    db = "results"
    first = fetch(f"{base}/{db}/runs.json?_shape=objects&_size=1")[1]
    row = json.loads(first)["rows"][0]
    pages = pages_to_time(db, row)
    print(f"\n{'page':<58} {'median':>8} {'p95':>8} {'size':>9}")
    for label, path in pages.items():
        url = base + path.split("#")[0].replace(" ", "%20")
        try:
            fetch(url)  # warm: schema, counts
        except urllib.error.HTTPError as error:
            print(f"{label:<58} not available (HTTP {error.code})")
            continue
        times, refused = [], 0
        for _ in range(repeat):
            try:
                seconds, body = fetch(url)
            except urllib.error.HTTPError:  # a query over Datasette's time limit: a 400
                refused += 1
                continue
            times.append(seconds)
        if refused:
            print(f"{label:<58} HTTP 400 (over Datasette's 1 s SQL time limit) in {refused} "
                  f"of {repeat}")
        if not times:
            continue
        times.sort()
        p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
        print(f"{label:<58} {statistics.median(times):>7.3f}s {p95:>7.3f}s "
              f"{len(body) / 1024:>7.0f}KB")
    exports = (("full CSV export, benchmark_runs", f"/{db}/benchmark_runs.csv"),
               ("full CSV export, landing table runs", f"/{db}/runs.csv"))
    for label, path in exports if csv_exports else ():
        started = time.perf_counter()
        with urllib.request.urlopen(base + path, timeout=1800) as response:
            counted = _Counted(response)
            text = io.TextIOWrapper(io.BufferedReader(counted), encoding="utf-8", newline="")
            rows = sum(1 for _ in csv.reader(text)) - 1
        seconds = time.perf_counter() - started
        print(f"{label}: {rows} rows, {counted.size / 1e6:.0f} MB in {seconds:.1f} s")


class _Counted(io.RawIOBase):
    """A response read in chunks, its size counted (a full export is hundreds of MB)."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.response.read(len(buffer))
        buffer[: len(data)] = data
        self.size += len(data)
        return len(data)


if __name__ == "__main__":
    sys.exit(main())
