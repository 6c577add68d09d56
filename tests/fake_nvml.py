"""A stand-in for `pynvml` (nvidia-ml-py) with the calls profllm makes, for hosts without a GPU.

Install it with `monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...))`; the code under test
imports `pynvml` lazily and gets this object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    utilization: int = 0
    memory_used: int = 0  # bytes
    power_mw: int | None = 0  # None: the board does not report power
    sm_clock: int = 0
    temperature: int = 0
    # Called on every query: pid -> bytes of the compute processes holding memory.
    holders: Callable[[], dict[int, int]] = dict


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=list)
    initialised: int = 0
    NVMLError: type[Exception] = NVMLError
    NVML_CLOCK_SM: int = 1
    NVML_TEMPERATURE_GPU: int = 0

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(gpu=gpu.utilization, memory=0)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(used=gpu.memory_used, total=80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        if gpu.power_mw is None:
            raise NVMLError("Not Supported")
        return gpu.power_mw

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, kind: int) -> int:
        assert kind == self.NVML_CLOCK_SM
        return gpu.sm_clock

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return gpu.temperature

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu.holders().items()]
