"""Seconds and peak memory of `profllm ingest` and `profllm rebuild` refusing a record file
that is not one to read: a 1.5 GB file (sparse, made with truncate: it costs no disk), a
`x.json -> /dev/zero` link and a FIFO named `x.json`, each alone in its folder beside one good
record.

    python benchmarks/perf/hostile_record_files.py [--gb 1.5]

Prints, per file and command, the seconds, the peak RSS and the refusal line. The manual's
"Limits on input" (docs/limits-and-faults.md) quotes the figures; each must stay under 10 s
and 300 MB. Before the record files were opened as regular files only and read no further than
the limit, the 1.5 GB file took 1.6 GB of memory, /dev/zero ended in MemoryError and the FIFO
hung. Run on demand (not collected by pytest).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each command is killed past this: a hang shows as a timeout, not as a script that never ends.
TIMEOUT_S = 120


def a_record(folder: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_store import make_record  # the tests' own record, only for this script

    from pytest_profllm.results.record_files import write_record

    write_record(folder, make_record("run-good"))


def measure(command: list[str]) -> tuple[float, float, str]:
    """Seconds, peak RSS in MB (of this command alone: run in a child of its own) and the
    refusal line."""
    measuring = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout="
        f"{TIMEOUT_S})\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(done.stderr.strip().splitlines()[0] if done.stderr.strip() else '')\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", measuring, *command], capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return seconds, -1.0, (done.stderr.strip().splitlines() or ["?"])[-1]
    peak_kb, line = [*done.stdout.splitlines(), "", ""][:2]
    return seconds, int(peak_kb) / 1024, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.5)
    args = parser.parse_args()
    profllm = [sys.executable, "-m", "pytest_profllm.cli"]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; before any command: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (this script)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        makers = {
            f"{args.gb:g} GB file": lambda path: os.truncate(_touch(path), int(args.gb * 1e9)),
            "link to /dev/zero": lambda path: path.symlink_to("/dev/zero"),
            "FIFO": os.mkfifo,
        }
        for what, make in makers.items():
            folder = out / what.replace(" ", "-").replace("/", "")
            folder.mkdir()
            a_record(folder)
            make(folder / "x.json")
            for name, command in [
                ("ingest", [*profllm, "ingest", str(folder / "ingested.db"), str(folder)]),
                ("rebuild", [*profllm, "rebuild", str(folder), "-o",
                             str(folder / "rebuilt.db")]),
            ]:
                seconds, peak_mb, line = measure(command)
                print(f"{what}, {name}: {seconds:.2f} s, {peak_mb:.0f} MB peak RSS; "
                      f"said: {line}")


def _touch(path: Path) -> Path:
    path.touch()
    return path


if __name__ == "__main__":
    main()
