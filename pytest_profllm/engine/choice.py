"""Which engine serves the benchmarks: real vLLM where it can serve here, else the simulator."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pytest_profllm
from pytest_profllm.engine.install import (
    SERVE_LAUNCHER,
    VllmInstall,
    VllmNotUsable,
    own_distribution,
    probe,
)
from pytest_profllm.hosts import nvml
from pytest_profllm.hosts.devices import DeviceKind

if TYPE_CHECKING:
    pass

EngineName = Literal["vllm", "sim"]
ENGINE_CHOICES = ("auto", "vllm", "sim")
# How the simulated engine keeps time: `real` (a server that sleeps each step) or `virtual`
# (its scheduler stepped in the worker's process, run/virtual.py). vLLM's clock is real.
Clock = Literal["real", "virtual"]
SIM_CLOCKS: tuple[Clock, ...] = ("real", "virtual")


class EngineUnavailable(Exception):
    """The engine asked for cannot run on this host; the message says why."""


@dataclass(frozen=True)
class EngineChoice:
    name: EngineName
    reason: str
    version: str | None
    vllm: VllmInstall | None = None  # where name is vllm
    clock: Clock = "real"

    @property
    def device_kind(self) -> DeviceKind:
        """`cpu` where vLLM runs on CPU (its platform says so), `virtual` for the simulator's
        devices, else `gpu`."""
        if self.name == "sim":
            return "virtual"
        return "cpu" if self.vllm is not None and self.vllm.on_cpu else "gpu"

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "name": self.name, "reason": self.reason, "version": self.version, "clock": self.clock,
        }
        if self.vllm is not None:
            record.update(
                distribution=self.vllm.distribution,
                device=self.vllm.device,
                python=self.vllm.python,
            )
        return record


def choose_engine(
    requested: str, gpu_count: int, vllm_python: str | None = None, clock: Clock = "real"
) -> EngineChoice:
    """`auto` takes vLLM where it is importable and can serve here: on a GPU NVML finds, or on
    CPU cores with a CPU build of vLLM (its platform says which); else the simulator.

    `vllm_python` names the Python of vLLM's environment; by default the plugin's own. The
    virtual clock is the simulator's alone: with it, `auto` is the simulator and `vllm` an
    EngineUnavailable.
    """
    if clock == "virtual":
        if requested == "vllm":
            raise EngineUnavailable(
                "--profllm-sim-clock virtual runs the simulated engine in-process: it cannot "
                "be used with --profllm-engine vllm (use sim or auto)"
            )
        return EngineChoice(
            "sim", "--profllm-sim-clock virtual: the simulated engine on a virtual clock",
            _own_version(), clock="virtual",
        )
    if requested == "sim":
        return EngineChoice("sim", "--profllm-engine sim", _own_version())
    try:
        install = find_vllm(vllm_python)
    except EngineUnavailable as error:
        if requested == "vllm":
            raise
        return EngineChoice("sim", f"auto: {error}, using the simulated engine", _own_version())
    if install is None:
        if requested == "vllm":
            raise EngineUnavailable(
                "--profllm-engine vllm: vLLM is not installed in this environment "
                "(pip install -e '.[vllm]' in the pytest-profllm clone on a GPU host, or name "
                "another environment's Python with --profllm-vllm-python)"
            )
        return EngineChoice(
            "sim", "auto: vLLM is not installed, using the simulated engine", _own_version()
        )
    problem = _cannot_serve(install, gpu_count)
    label = f"vLLM {install.version}" + (
        f" ({install.distribution})" if install.distribution not in (None, "vllm") else ""
    )
    if problem is not None:
        if requested == "vllm":
            raise EngineUnavailable(f"--profllm-engine vllm: {label}: {problem}")
        return EngineChoice("sim", f"auto: {label}: {problem}, using the simulated engine",
                            _own_version())
    where = "CPU cores" if install.on_cpu else f"{gpu_count} GPU(s)"
    reason = "--profllm-engine vllm" if requested == "vllm" else f"auto: {label} and {where}"
    return EngineChoice("vllm", reason, install.version, install)


def _cannot_serve(install: VllmInstall, gpu_count: int) -> str | None:
    if install.on_cpu:
        return None if install.can_serve else (install.why_not or "cannot serve on CPU")
    if gpu_count == 0:
        return "NVML reports no GPU on this host"
    return None


def find_vllm(python: str | None) -> VllmInstall | None:
    """The vLLM of `python` (probed in a subprocess, cached per install), or of the plugin's own
    Python; None where the plugin's own Python has none. A named Python without vLLM is an
    EngineUnavailable."""
    if python is None:
        # find_spec does not import vLLM (seconds, and CUDA initialisation) just to look.
        if importlib.util.find_spec("vllm") is None:
            return None
        distribution, version = own_distribution()
        if distribution == "vllm" and _nvml_gpu_count() > 0:
            # A GPU build on a GPU host: what the probe would say, without its seconds.
            return VllmInstall(
                sys.executable, distribution, version, "cuda", SERVE_LAUNCHER,
                None, True,
            )
        python = sys.executable
    try:
        return probe(python)
    except VllmNotUsable as error:
        raise EngineUnavailable(str(error)) from None


def _nvml_gpu_count() -> int:
    return len(nvml.discover().gpus)


def _own_version() -> str:
    return pytest_profllm.__version__
