"""GPU discovery through NVML; an empty answer (never an error) where there is no NVIDIA GPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass


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
