"""Peak memory of `profllm ingest` and `profllm calibrate` on a hostile request file: one
record with a `.requests.jsonl.gz` that decompresses to --mib MiB of `{}` lines (1 GiB: the
limit a request file may reach, limits.MAX_REQUEST_FILE_BYTES; a few MB of gzip).

    python benchmarks/perf/request_file_memory.py [--mib 1024] [--record RUN.json]

Prints each command's one line and its "Maximum resident set size" from /usr/bin/time -v
(apt-get install time). Run on demand (not collected by pytest). Without --record it uses
tests/test_datasette.py's `make_record` (an engine-vllm, valid serving run).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def a_record(path: Path | None) -> dict[str, object]:
    if path is not None:
        loaded: dict[str, object] = json.loads(path.read_text())
        return loaded
    sys.path.insert(0, str(ROOT / "tests"))
    from test_datasette import make_record  # the tests' own record, only for this script

    record: dict[str, object] = make_record("run-hostile", "s1", "c1", "2026-11-28T00:00:00Z")
    # A real vLLM's run: calibrate reads only those (and then their request files).
    record["engine"] = {"name": "vllm", "reason": "test", "version": "0.33.0"}
    return record


def measure(command: list[str]) -> tuple[str, int]:
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                          check=False)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    said = (done.stdout + done.stderr).strip().splitlines()
    return (said[0] if said else ""), int(peak.group(1)) if peak else -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        record = a_record(args.record)
        records, beside_db = out / "records", out / "db"
        records.mkdir()
        beside_db.mkdir()
        (records / f"{record['run_id']}.json").write_text(json.dumps(record))
        # The record alone, for calibrate to read its request file beside the database.
        subprocess.run(["profllm", "ingest", str(beside_db / "results.db"), str(records)],
                       capture_output=True, check=True)
        hostile = records / f"{record['run_id']}.requests.jsonl.gz"
        chunk = b"{}\n" * (1 << 20)  # 3 MiB
        with gzip.open(hostile, "wb", compresslevel=6) as handle:
            for _ in range(args.mib // 3):
                handle.write(chunk)
        (beside_db / hostile.name).write_bytes(hostile.read_bytes())
        print(f"{hostile.stat().st_size:,} bytes of gzip, {args.mib // 3 * 3} MiB unpacked")
        for name, command in [
            ("ingest", ["profllm", "ingest", str(out / "fresh.db"), str(records)]),
            ("calibrate", ["profllm", "calibrate", "--base", "H100-SXM",
                           str(beside_db / "results.db")]),
        ]:
            line, peak_kb = measure(command)
            print(f"{name}: {peak_kb / 1024:.0f} MB peak RSS; said: {line}")

if __name__ == "__main__":
    main()
