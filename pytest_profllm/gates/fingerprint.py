"""A run's fingerprint: what must be equal for two runs to be compared. The effective server
configuration, the workload, the engine and its version, and the device model and count.

The workload's `seed` is left out: it draws other prompts of the same distribution, which is
the noise a gate must tolerate, not another workload.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_NOT_THE_WORKLOAD = ("seed",)


def fingerprint(record: dict[str, Any], with_version: bool = True) -> dict[str, Any]:
    config = record.get("config") or {}
    engine = record.get("engine") or {}
    system = record.get("system") or {}
    runtime = record.get("runtime") or {}
    benchmark = {
        key: value
        for key, value in (config.get("benchmark") or {}).items()
        if key not in _NOT_THE_WORKLOAD
    }
    parts: dict[str, Any] = {
        "server": config.get("server") or {},
        "benchmark": benchmark,
        "engine": engine.get("name"),
        # The simulator has no device model: its GPUs are virtual.
        "device_model": sorted(set(system.get("gpu_names") or [])) or None,
        "device_count": len(runtime.get("gpus") or []),
    }
    if with_version:
        parts["engine_version"] = engine.get("version")
        parts["engine_args_version"] = (config.get("engine_args") or {}).get("vllm_version")
    return parts


def digest(parts: dict[str, Any]) -> str:
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def digests(record: dict[str, Any]) -> tuple[str, str]:
    """(with the engine version, without it)."""
    return digest(fingerprint(record, True)), digest(fingerprint(record, False))
