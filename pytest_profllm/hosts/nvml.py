"""Everything this package reads from NVML (nvidia-ml-py): the host's GPUs, the processes that
hold memory on them, and the leased GPUs' readings while a case runs. An empty answer (never
an error) where there is no NVIDIA GPU."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_BUSY_POLL_S = 1.0
_MIB = 2**20


def _initialised_nvml() -> Any | None:
    """pynvml, initialised; None where the package or the NVIDIA driver is missing."""
    # Imported at call time: most hosts have no NVIDIA driver, and the tests put a stand-in
    # pynvml into sys.modules.
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


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
    pynvml = _initialised_nvml()
    if pynvml is None:
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
                    memory_total_mib=memory.total / _MIB,
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
    pynvml = _initialised_nvml()
    if pynvml is None:
        return []
    try:
        found = []
        for uuid in uuids:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = process.usedGpuMemory
                mib = None if used is None else used / _MIB
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


@dataclass(frozen=True)
class GpuReading:
    index: int
    utilization: float | None  # percent of the sample period a kernel ran
    memory_used_mib: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    temperature_c: float | None


@dataclass(frozen=True)
class EnergyCount:
    """The leased GPUs' energy counters at one moment: millijoules since the driver loaded,
    one per GPU in lease order; or, in `problem`, why they could not all be read."""

    at: float  # perf_counter seconds
    millijoules: tuple[float, ...]
    problem: str | None = None


class NvmlGpus:
    """The leased GPUs through NVML (`pynvml`, from nvidia-ml-py), by CUDA device index."""

    def __init__(self, nvml: Any, indices: Sequence[int]) -> None:
        self.nvml = nvml
        self.indices = tuple(indices)
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in self.indices]

    @classmethod
    def open(cls, gpu_ids: Iterable[str]) -> NvmlGpus | None:
        """The GPUs, or None where NVML or the GPUs are absent (a CPU host, virtual GPU ids)."""
        try:
            indices = [int(gpu) for gpu in gpu_ids]
        except ValueError:
            return None
        if not indices:
            return None
        pynvml = _initialised_nvml()
        if pynvml is None:
            return None
        try:
            if any(index >= pynvml.nvmlDeviceGetCount() for index in indices):
                pynvml.nvmlShutdown()
                return None
            return cls(pynvml, indices)
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()
            return None

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()

    def read(self) -> tuple[GpuReading, ...]:
        return tuple(
            GpuReading(
                index=index,
                utilization=self._get(
                    lambda h: float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu), handle
                ),
                memory_used_mib=self._get(
                    lambda h: self.nvml.nvmlDeviceGetMemoryInfo(h).used / _MIB, handle
                ),
                # NVML reports milliwatts.
                power_w=self._get(lambda h: self.nvml.nvmlDeviceGetPowerUsage(h) / 1000, handle),
                sm_clock_mhz=self._get(
                    lambda h: float(self.nvml.nvmlDeviceGetClockInfo(h, self.nvml.NVML_CLOCK_SM)),
                    handle,
                ),
                temperature_c=self._get(
                    lambda h: float(
                        self.nvml.nvmlDeviceGetTemperature(h, self.nvml.NVML_TEMPERATURE_GPU)
                    ),
                    handle,
                ),
            )
            for index, handle in zip(self.indices, self.handles, strict=True)
        )

    def energy(self) -> EnergyCount:
        """The leased GPUs' total energy counters now (Volta and newer boards). A GPU whose
        counter cannot be read makes the whole count unknown: a sum without it would read as
        the server's energy and be too low."""
        at = time.perf_counter()
        millijoules = []
        for index, handle in zip(self.indices, self.handles, strict=True):
            try:
                millijoules.append(float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle)))
            except self.nvml.NVMLError as error:
                why = str(error) or type(error).__name__
                return EnergyCount(at, (), f"GPU {index}: NVML energy counter: {why}")
        return EnergyCount(at, tuple(millijoules), None)

    def memory_holders(self) -> dict[int, dict[int, float]]:
        """Per leased GPU index: pid -> MiB of every compute process holding memory on it."""
        held: dict[int, dict[int, float]] = {}
        for index, handle in zip(self.indices, self.handles, strict=True):
            processes = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            held[index] = {int(p.pid): (p.usedGpuMemory or 0) / _MIB for p in processes}
        return held

    def _get(self, read: Callable[[Any], float], handle: Any) -> float | None:
        # A GPU may not support a query (power on some boards): that field stays null.
        try:
            return read(handle)
        except self.nvml.NVMLError:
            return None


def wait_gpu_memory_released(
    gpus: NvmlGpus, pids: set[int], timeout: float, poll_s: float = 0.2
) -> str | None:
    """Wait until no process of `pids` holds memory on the leased GPUs; a problem, or None.

    The driver frees a dead process's memory shortly after it exits, not at once. NVML reports
    pids of the host's PID namespace: in a container they may not match ours, and then this
    check sees nothing to wait for.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = {
            index: {pid: mib for pid, mib in holders.items() if pid in pids}
            for index, holders in gpus.memory_holders().items()
        }
        left = {index: holders for index, holders in left.items() if holders}
        if not left:
            return None
        if time.monotonic() >= deadline:
            where = "; ".join(
                f"GPU {index}: "
                + ", ".join(f"pid {pid} {mib:.0f} MiB" for pid, mib in held.items())
                for index, held in sorted(left.items())
            )
            return f"GPU memory still held {timeout:.0f} s after the server stopped ({where})"
        time.sleep(poll_s)
