"""The devices a server leases, by kind: GPUs (NVML, or virtual ones for the simulator), or CPU
core sets where vLLM runs on CPU (its platform says so). What a server's environment says
about its devices, and what the record calls the device.

A core set is to a CPU server what a GPU is to a GPU server: a server takes tensor x pipeline
x data parallel size of them, one per vLLM worker (`VLLM_CPU_OMP_THREADS_BIND`, ranks joined
by `|`), and no two servers share one. No set takes the first usable core: the load client
runs there (hosts/cores.py leases it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.pool import CPU_PREFIX, HostPool, Lease

DeviceKind = Literal["gpu", "cpu", "virtual"]
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_sets(text: str) -> int | tuple[str, ...]:
    """`2` splits the usable cores but the first (the client's) into 2 equal sets; `0-3/4-7`
    names the sets (each a list of cores like `0-3` or `0,2,4`, sets separated by `/`).
    ValueError says what is wrong."""
    text = text.strip()
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise ValueError("--profllm-cpus: a count of core sets must be at least 1")
        return count
    sets = tuple(part.strip() for part in text.split("/") if part.strip())
    if not sets:
        raise ValueError(
            f"--profllm-cpus: expected a count or core sets like 0-3/4-7, got {text!r}"
        )
    seen: set[int] = set()
    for core_set in sets:
        cores = cores_of(core_set)
        if seen & set(cores):
            raise ValueError(f"--profllm-cpus: core sets overlap in {text!r}")
        seen.update(cores)
    return sets


def cores_of(core_set: str) -> list[int]:
    """`0-3` or `0,2,5-6` as core ids, as vLLM reads VLLM_CPU_OMP_THREADS_BIND."""
    cores: list[int] = []
    for part in core_set.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"--profllm-cpus: {core_set!r} is not a core list like 0-3 or 0,2")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        if high < low:
            raise ValueError(f"--profllm-cpus: {part!r} runs backwards")
        cores.extend(range(low, high + 1))
    return cores


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, which a container or taskset sets)."""
    return sorted(os.sched_getaffinity(0))


def core_sets(spec: int | Sequence[str] | None, cores: Sequence[int]) -> tuple[str, ...]:
    """The pool's core sets, which never take the first usable core: it stays with the load
    client (a vLLM server starts pinned to its sets, its API process too: server/process.py;
    on a one-core host one set shares it). None: one set of
    every other usable core. A count splits the other cores into that many equal sets
    (left-over cores go to the client too). ValueError, with the fix, for more sets than that
    or sets that leave the client no core or name cores this process may not use."""
    servers = list(cores[1:]) if len(cores) > 1 else list(cores)
    if spec is None:
        return (_text(servers),)
    if isinstance(spec, int):
        if spec > len(servers):
            raise ValueError(
                f"--profllm-cpus {spec}: room for {len(servers)} core set(s) here "
                f"({len(cores)} usable core(s), core {cores[0]} stays with the load client): "
                f"use --profllm-cpus {len(servers)}"
            )
        size = len(servers) // spec
        return tuple(_text(servers[i * size : (i + 1) * size]) for i in range(spec))
    named = {c for s in spec for c in cores_of(s)}
    missing = sorted(named - set(cores))
    if missing:
        raise ValueError(
            f"--profllm-cpus: core(s) {', '.join(map(str, missing))} are not usable here "
            f"(usable: {_text(list(cores))})"
        )
    if len(cores) > 1 and named >= set(cores):
        raise ValueError(
            f"--profllm-cpus: the sets take every usable core ({_text(list(cores))}): leave "
            f"core {cores[0]} out of them for the load client"
        )
    return tuple(spec)


def _text(cores: Sequence[int]) -> str:
    """Core ids as the shortest list of ranges: [0, 1, 2, 5] -> `0-2,5`."""
    parts = []
    run: list[int] = []
    for core in sorted(cores):
        if run and core == run[-1] + 1:
            run.append(core)
            continue
        if run:
            parts.append(_run(run))
        run = [core]
    if run:
        parts.append(_run(run))
    return ",".join(parts)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def cpu_pool(directory: Path, spec: int | Sequence[str] | None, ports: range) -> HostPool:
    sets = core_sets(spec, usable_cores())
    return HostPool(directory, sets, tuple(f"{CPU_PREFIX}{s}" for s in sets), ports)


def device_env(kind: DeviceKind, lease: Lease) -> dict[str, str]:
    """What a server's environment says about its devices: the GPUs it may see, or the cores
    each of its CPU workers binds its OpenMP threads to."""
    if kind == "cpu":
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(lease.gpus)}
    return {"CUDA_VISIBLE_DEVICES": ",".join(lease.gpus)}


@functools.cache
def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (platform's answer elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def real_gpus(kind: DeviceKind) -> list[tuple[str, str]]:
    """(index, UUID) of the host's NVML GPUs that a pool of this device kind leases: vLLM's
    GPUs only. The simulator uses no GPU, so on a GPU host too its GPUs are virtual: it must
    neither hold a real GPU's lease nor wait for a job on one."""
    if kind != "gpu":
        return []
    return [(str(gpu.index), gpu.uuid) for gpu in nvml.discover().gpus]
