"""Writes one fixture: three records and their request files, made and ingested by the code of
an earlier commit (run with that commit's checkout first on PYTHONPATH; see README.md)."""

from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

from test_store import make_record  # the earlier commit's own test helper

from pytest_profllm.cli.main import main
from pytest_profllm.results.record_files import write_record, write_requests


def write(out: Path) -> None:
    records = out / "records"
    for index, status in enumerate(("passed", "passed", "failed")):
        run_id = f"20260101T000000-aaaaaa-00000000{index}"
        record = make_record(
            run_id, status=status, server={"model": "Qwen/Qwen3-8B", "max_num_seqs": 8 << index}
        )
        write_record(records, record)
        write_requests(
            records,
            run_id,
            [
                {
                    "index": at,
                    "success": True,
                    "ttft_s": 0.01 * (at + 1),
                    "latency_s": 0.1,
                    "output_tokens": 4,
                    "itl_s": [0.03, 0.03, 0.03],
                }
                for at in range(3)
            ],
        )
    db = out / "results.db"
    assert main(["ingest", str(db), str(records)]) == 0
    with db.open("rb") as source, gzip.open(out / "results.db.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    db.unlink()


if __name__ == "__main__":
    write(Path(sys.argv[1]))
