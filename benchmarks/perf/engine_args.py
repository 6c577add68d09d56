"""How long the engine-argument registry costs a pytest run, printed (no assertions).

    python benchmarks/perf/engine_args.py

The plugin is imported by every pytest run, so the registry loads on first use only; a suite's
collection pays for loading it, building the typed server model and checking values once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

BENCHMARKS = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def timed(label: str, function: Callable[[], T]) -> T:
    start = time.perf_counter()
    result = function()
    print(f"{label:<48} {1000 * (time.perf_counter() - start):8.1f} ms")
    return result


def main() -> None:
    plugin_import = (
        "import time; t = time.perf_counter(); import pytest_profllm.plugin; "
        "print(1000 * (time.perf_counter() - t))"
    )
    done = subprocess.run(
        [sys.executable, "-c", plugin_import], capture_output=True, text=True, check=True
    )
    print(f"{'import pytest_profllm.plugin (fresh process)':<48} {float(done.stdout):8.1f} ms")

    from pytest_profllm.engine.registry import bundled
    from pytest_profllm.plan.case import expand
    from pytest_profllm.plan.suite import load_suite_file

    registry = timed("load the bundled registry (JSON)", bundled)
    timed("build the typed server model", lambda: registry.server_model)
    path = BENCHMARKS / "bench_engine_args.yaml"
    suite, lines = timed("load and check bench_engine_args.yaml", lambda: load_suite_file(path))
    cases = timed("expand it", lambda: expand(suite, str(path), lines))
    timed("complete config.server (320 options)", lambda: registry.complete(cases[0].server))


if __name__ == "__main__":
    main()
