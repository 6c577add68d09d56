"""Profiling a case (`profile: true` in a suite): the server starts with vLLM's profiler on, and
a short run of the case's workload goes between `/start_profile` and `/stop_profile`.

vLLM 0.33.0 no longer reads `VLLM_TORCH_PROFILER_DIR` (it warns about it as an unknown vLLM
variable); the profiler is `--profiler-config '{"profiler": "torch", "torch_profiler_dir": DIR}'`,
and the two routes exist only when it is set (404 otherwise). `/start_profile` takes an
optional JSON body with `profile_prefix`, which begins the trace files' names; a second start
before a stop is 409. Traces are written by `/stop_profile`, as `*.pt.trace.json.gz`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The measured run is never profiled (the profiler slows the engine); a short run after it is.
PROFILE_PROMPTS = 8
_START_TIMEOUT_S = 60.0
# Writing a GPU trace of a few steps takes seconds to minutes.
_STOP_TIMEOUT_S = 600.0


class ProfilingFailed(Exception):
    """The server would not profile, or wrote no trace."""


def profile_prefix(name: str) -> str:
    """A trace-name prefix vLLM accepts: 1-128 ASCII letters, digits, '.', '_', '-'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).lstrip("._-")[:128]
    return cleaned or "profllm"


def run_profiled(
    base_url: str, trace_dir: Path, prefix: str, num_prompts: int, run: Callable[[], object]
) -> dict[str, Any]:
    """`run()` between /start_profile and /stop_profile; the record's `profiling` block."""
    # Deferred: requests takes about 0.1 s to import, on every pytest run otherwise.
    import requests

    before = _files(trace_dir)
    started = time.monotonic()
    try:
        response = requests.post(
            f"{base_url}/start_profile", json={"profile_prefix": prefix}, timeout=_START_TIMEOUT_S
        )
    except requests.RequestException as error:
        raise ProfilingFailed(f"/start_profile failed: {error}") from None
    if response.status_code != 200:
        hint = " (the server was started without a profiler)" if response.status_code == 404 else ""
        raise ProfilingFailed(
            f"/start_profile answered {response.status_code}{hint}: {response.text[:200]}"
        )
    try:
        run()
    finally:
        try:
            stopped = requests.post(f"{base_url}/stop_profile", timeout=_STOP_TIMEOUT_S)
        except requests.RequestException as error:
            raise ProfilingFailed(f"/stop_profile failed: {error}") from None
    if stopped.status_code != 200:
        raise ProfilingFailed(f"/stop_profile answered {stopped.status_code}: {stopped.text[:200]}")
    traces = sorted(path for path in _files(trace_dir) - before if path.name.startswith(prefix))
    if not traces:
        raise ProfilingFailed(f"the profiler wrote no trace named {prefix}* in {trace_dir}")
    sizes = [path.stat().st_size for path in traces]
    return {
        "profiler": "torch",
        "trace_dir": str(trace_dir.resolve()),
        "traces": [
            {"path": str(path), "size_bytes": size}
            for path, size in zip(traces, sizes, strict=True)
        ],
        "trace_bytes": sum(sizes),
        "num_prompts": num_prompts,
        "duration_s": time.monotonic() - started,
    }


def _files(directory: Path) -> set[Path]:
    if not directory.is_dir():
        return set()
    return {path for path in directory.rglob("*") if path.is_file()}
