"""GPU discovery through NVML; an empty answer (never an error) where there is no NVIDIA GPU."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_BUSY_POLL_S = 1.0


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mib: float


@dataclass(frozen=True)
class GpuHost:
    gpus: tuple[Gpu, ...]
    driver_version: str | None


@functools.cache
def discover() -> GpuHost:
    """The host's NVIDIA GPUs in NVML order (which is what CUDA_VISIBLE_DEVICES indexes)."""
    try:
        import pynvml
    except ImportError:
        return GpuHost((), None)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return GpuHost((), None)
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                Gpu(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_total_mib=memory.total / 2**20,
                )
            )
        return GpuHost(tuple(gpus), _text(driver))
    except pynvml.NVMLError:
        return GpuHost((), None)
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else value


class GpuBusy(Exception):
    """A leased GPU holds memory of a process we did not start; the message names it."""


@dataclass(frozen=True)
class GpuProcess:
    gpu_uuid: str
    pid: int
    used_mib: float | None  # None where the driver does not say (e.g. in a container)


def compute_processes(uuids: Sequence[str]) -> list[GpuProcess]:
    """The processes NVML sees on these GPUs (by UUID); empty without NVML."""
    if not uuids:
        return []
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        found = []
        for uuid in uuids:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = process.usedGpuMemory
                mib = None if used is None else used / 2**20
                found.append(GpuProcess(uuid, int(process.pid), mib))
        return found
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def wait_until_idle(
    uuids: Sequence[str],
    wait: bool,
    timeout: float,
    probe: Callable[[Sequence[str]], list[GpuProcess]] = compute_processes,
) -> float:
    """Before a server starts on leased GPUs: no other process may hold memory there (a job
    outside profllm, or the orphaned engine of a killed server). Waits up to `timeout` seconds
    when `wait`, else fails at once. Returns the seconds waited."""
    started = time.monotonic()
    while True:
        holders = probe(uuids)
        if not holders:
            return time.monotonic() - started
        waited = time.monotonic() - started
        if not wait or waited >= timeout:
            shown = ", ".join(
                f"pid {p.pid} on {p.gpu_uuid}"
                + (f" ({p.used_mib:.0f} MiB)" if p.used_mib is not None else "")
                for p in holders
            )
            verdict = f"still there after {waited:.0f} s" if wait else "--profllm-busy-gpus fail"
            raise GpuBusy(
                f"leased GPU(s) in use by a process profllm did not start: {shown}; {verdict}"
            )
        time.sleep(_BUSY_POLL_S)
