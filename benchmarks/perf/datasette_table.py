"""How long Datasette takes to show `benchmark_runs` with one column per engine argument.

Builds a results.db of N copies (new run ids) of one real record from the example suites, then
times the table page and its JSON in-process, with and without our plugin's suppression of
facet suggestions (`_nosuggest`), which Datasette would otherwise try on every column.

    python benchmarks/perf/datasette_table.py [--rows 2000] [--record results/x.json]

Run on demand (not collected by pytest). Without --record it runs bench_smoke.yaml once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--record", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profllm-datasette-") as tmp:
        root = Path(tmp)
        record = json.loads(args.record.read_text()) if args.record else one_record(root)
        records = [{**record, "run_id": f"{record['run_id']}-{i}"} for i in range(args.rows)]
        from pytest_profllm.results.store import load_records
        from pytest_profllm.results.table import TABLE

        db = root / "results.db"
        started = time.perf_counter()
        load_records(db, records)
        print(f"{args.rows} rows loaded in {time.perf_counter() - started:.2f} s")
        with sqlite3.connect(db) as connection:
            columns = len(connection.execute(f"pragma table_info({TABLE})").fetchall())
        print(f"{columns} columns")
        for label, suffix in (("as served (plugin)", ""), ("suggestions on", "?_nosuggest=")):
            timings = asyncio.run(time_pages(db, TABLE, suffix))
            print(f"{label:<20} " + "  ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
    return 0


async def time_pages(db: Path, table: str, suffix: str) -> dict[str, float]:
    """Seconds for the table page and its JSON. Our ASGI wrapper adds `_nosuggest=1` only to
    requests without a `_nosuggest` of their own, so an empty one turns suggestions back on."""
    from datasette.app import Datasette

    datasette = Datasette([str(db)])
    await datasette.invoke_startup()
    timings = {}
    for name, url in (("page", f"/results/{table}"), ("json", f"/results/{table}.json")):
        await datasette.client.get(url + suffix)  # warm: schema and counts cached
        started = time.perf_counter()
        response = await datasette.client.get(url + suffix)
        timings[name] = time.perf_counter() - started
        assert response.status_code == 200, response.status_code
    return timings


def one_record(root: Path) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "pytest", str(REPO / "benchmarks" / "bench_smoke.yaml"), "-q",
         "-p", "no:cacheprovider", f"--profllm-out={root / 'out'}", "--profllm-ports=23000-23099",
         "-k", "seqs16 and rate-inf"],
        check=True, capture_output=True,
    )
    return json.loads(next((root / "out").glob("*.json")).read_text())


if __name__ == "__main__":
    sys.exit(main())
