"""The results side at 100,000 runs: `profllm ingest` time and memory, then Datasette's pages.

Generates N realistic records (every engine argument of the registry with its default, every
workload, system and runtime field, every standard metric; a few swept axes: model, device,
max_num_seqs, tensor_parallel_size, request rate or concurrency; nightly sessions of repeated
cases), writes them as record files, times `profllm ingest` of the folder (wall time and peak
memory of the process), then serves the database with `datasette serve` on 127.0.0.1 and times
the landing page with its facets, a page filtered on three columns, every canned query, every
dashboard (as it opens and with common choices: all sessions, filters, a bound, a case), the
run page, and a full CSV export (`pages_to_time` lists them).

    python benchmarks/perf/results_scale.py [--records 100000] [--repeat 15] [--keep DIR]
                                            [--pages-only | --ingest-only]

Run on demand (not collected by pytest). Targets: ingest under 30 s on 2 cores at 100,000
records and under 5 minutes at 1,000,000, memory bounded; every page's p95 under 0.5 s at
both; landing page under 300 KB; every row in the CSV.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import os
import random
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
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="profllm-scale-"))
    try:
        if args.pages_only:
            with served(root / "results.db") as base:
                time_pages(base, args.repeat, csv_exports=not args.no_csv)
        else:
            run(root, args.records, args.repeat, pages=not args.ingest_only,
                csv_exports=not args.no_csv)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def run(root: Path, count: int, repeat: int, pages: bool = True,
        csv_exports: bool = True) -> None:
    records = root / "records"
    db_path = root / "results.db"
    for stale in (db_path, db_path.with_name(db_path.name + "-wal"),
                  db_path.with_name(db_path.name + "-shm")):
        stale.unlink(missing_ok=True)  # a WAL file left beside a new database would corrupt it
    if not records.is_dir() or len(list(records.glob("*.json"))) != count:
        started = time.perf_counter()
        generate(records, count)
        print(f"generated {count} records in {time.perf_counter() - started:.1f} s "
              f"({sum(p.stat().st_size for p in records.iterdir()) / 1e6:.0f} MB)")
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


def generate(folder: Path, count: int) -> None:
    import orjson

    from pytest_profllm.engine.registry import bundled
    from pytest_profllm.plan.metric_names import LATENCY_METRICS, result_names
    from pytest_profllm.plan.suite import BenchmarkConfig
    from pytest_profllm.results.table import STANDARD_METRICS

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    registry = bundled()
    defaults = registry.defaults()
    bench_defaults = BenchmarkConfig().model_dump(mode="json")
    random.seed(0)
    cases = []
    for model, device, seqs, tp in itertools.product(MODELS, DEVICES, (64, 128, 256, 512),
                                                     (1, 2)):
        for load in [("rate", r) for r in RATES] + [("concurrency", c) for c in CONCURRENCIES]:
            cases.append((model, device, seqs, tp, load))
    per_session = len(cases)
    for index in range(count):
        session = index // per_session
        model, device, seqs, tp, (kind, value) = cases[index % per_session]
        server_label = f"{model.split('/')[-1].lower()}-seqs{seqs}-tp{tp}"
        workload = f"rate-{value}" if kind == "rate" else f"concurrency-{value}"
        benchmark = {**bench_defaults, "num_prompts": 200, "random_input_len": 1024,
                     "random_output_len": 256}
        if kind == "rate":
            benchmark["request_rate"] = "inf" if value == float("inf") else value
        else:
            benchmark["max_concurrency"] = value
        capacity = seqs * tp * (1.6 if "H100" in device else 1.0) / (4 if "32B" in model else 1)
        offered = value if kind == "rate" and value != float("inf") else capacity
        throughput = min(offered, capacity / 20) * random.uniform(0.9, 1.1)
        # The last session is slowed, and its gate says so.
        slowed = session == (count - 1) // per_session
        if slowed:
            throughput *= 0.8
        results: dict[str, Any] = {name: round(random.uniform(5, 500), 3)
                                   for name in STANDARD_METRICS}
        results.update(
            completed=200, failed=0, total_input_tokens=204_800, total_output_tokens=51_200,
            request_throughput=throughput, output_throughput=throughput * 256,
            total_token_throughput=throughput * 1280, request_goodput=throughput,
            duration=200 / max(throughput, 0.1),
        )
        for key in result_names(LATENCY_METRICS, (50.0, 90.0, 95.0, 99.0)):
            results.setdefault(key, round(random.uniform(5, 500), 3))
        gpus = [device] * tp
        status = "passed" if random.random() > 0.05 else random.choice(("failed", "error"))
        record = {
            "schema_version": 1,
            "run_id": f"s{session:05d}-{index:06d}",
            "session_id": f"2026{session:05d}-nightly",
            "suite": "nightly",
            "source": "benchmarks/bench_nightly.yaml",
            "case_id": f"bench_nightly.yaml::{server_label}::{workload}",
            "nodeid": f"benchmarks/bench_nightly.yaml::{server_label}::{workload}",
            "repeat_index": 0,
            "timestamp": f"2026-{1 + session // 600 % 12:02d}-{1 + session // 20 % 28:02d}T"
            f"{session % 20:02d}:{index % 60:02d}:00+00:00",
            "duration": 60.0,
            "status": status,
            "message": None if status == "passed" else f"{status}: median_ttft_ms over 200",
            "engine": {"name": "vllm", "reason": "--profllm-engine vllm", "version": "0.33.0"},
            "config": {
                "server": {**defaults, "model": model, "max_num_seqs": seqs,
                           "tensor_parallel_size": tp},
                "benchmark": benchmark,
                "engine_args": registry.describe(),
                "axes": ["server.model", "server.max_num_seqs", "server.tensor_parallel_size",
                         "benchmark.request_rate" if kind == "rate"
                         else "benchmark.max_concurrency"],
            },
            "results": results,
            "system": {
                "host": f"gpu-node-{session % 7}", "platform": "Linux-6.8-x86_64",
                "python": "3.12.3", "cpu_count": 96, "gpu_names": gpus,
                "gpu_uuids": [f"GPU-{session % 7}-{i}" for i in range(tp)],
                "driver_version": "570.124.06", "vllm_version": "0.33.0",
                **{name: round(random.uniform(1, 100), 2) for name in (
                    "peak_gpu_memory_mib", "mean_gpu_memory_mib", "mean_gpu_utilization",
                    "peak_gpu_utilization", "mean_gpu_power_w", "peak_gpu_power_w",
                    "mean_gpu_sm_clock_mhz", "peak_gpu_sm_clock_mhz", "mean_gpu_temperature_c",
                    "peak_gpu_temperature_c", "mean_server_cpu_percent",
                    "peak_server_cpu_percent", "mean_server_rss_mib", "peak_server_rss_mib",
                    "mean_client_cpu_percent", "peak_client_cpu_percent", "peak_client_rss_mib",
                    "mean_kv_cache_usage", "peak_kv_cache_usage", "server_num_preemptions",
                    "server_prefix_cache_queries", "server_prefix_cache_hits",
                    "server_prefix_cache_hit_rate", "telemetry_interval_s")},
                "peak_server_processes": 4, "telemetry_samples": 120,
            },
            "runtime": {
                "worker": f"gw{index % 4}", "server_key": f"{hash(server_label) & 0xffffff:06x}",
                "gpus": [str(i) for i in range(tp)], "gpu_uuids": [], "port": 24000 + index % 50,
                "server_started_at": 1.7e9 + index, "server_ready_at": 1.7e9 + index + 30,
                "server_stopped_at": 1.7e9 + index + 90, "lease_wait_s": 0.0,
            },
            "thresholds": {"median_ttft_ms": {"min": None, "max": 200.0}},
            "regression": [{"metric": "output_throughput", "verdict": "regressed",
                            "tolerance": 0.05, "higher_is_better": True, "baseline": 1.0,
                            "value": 0.8, "change": -0.2, "confidence": 0.99,
                            "baseline_session": f"2026{session - 1:05d}-nightly"}]
            if slowed else [],
            "verdicts": [{"metric": "median_ttft_ms", "bound": "max", "limit": 200.0,
                          "value": results["median_ttft_ms"],
                          "passed": status == "passed"}],
        }
        (folder / f"{record['run_id']}.json").write_bytes(orjson.dumps(record))


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
        times = []
        for _ in range(repeat):
            seconds, body = fetch(url)
            times.append(seconds)
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
