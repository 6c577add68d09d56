"""Device profiles: what the simulator's cost model knows of a GPU.

Each profile is a small TOML file in `sim/device_profiles/` with its figures and their sources
(datasheets), and the overheads fitted on published vLLM runs (which rows: in the file and in
docs/simulated-engine/calibration.md). `--sim-device NAME` picks one by name or alias.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).with_name("device_profiles")
DEFAULT_DEVICE = "H100-SXM"
GIB = 1024**3
# A large bf16 matmul's share of the datasheet peak where a profile gives no measurement: the
# H100 SXM's measured 792.1 of 989 TFLOP/s (stas00/ml-engineering, "Maximum Achievable Matmul
# FLOPS comparison table", CUDA 12.1).
MATMUL_FRACTION = 0.80


class UnknownDevice(ValueError):
    """A `--sim-device` no profile answers to."""


@dataclass(frozen=True)
class Overheads:
    """What a roofline leaves out, fitted on published runs (sim_calibration.py --fit).

    Defaults are the fit over every trusted calibration row (both files, 9 sources); a
    profile's `[overheads]` table overrides a figure for its device (PCIe all-reduce latency).
    """

    step_ms: float = 1.6  # per engine step: scheduling, sampling, launches
    # Per running sequence per step (bookkeeping, inputs, outputs), beside the GPU's work.
    seq_us: float = 20.0
    bandwidth_efficiency: float = 0.80  # achieved fraction of the datasheet bandwidth
    # Fraction of the device's achievable matmul rate (`DeviceProfile.matmul_flops`) a whole
    # forward pass's GEMMs reach (prefill, big batches): launch gaps, norms, shapes.
    compute_efficiency: float = 0.50
    # How sharply a GEMM turns from bandwidth- to compute-bound: its time is the p-norm of the
    # two (inf: the larger alone, a plain roofline). Near the ridge a kernel reaches neither
    # bound, since loading a tile and multiplying it overlap only in part.
    roofline_sharpness: float = 1.5
    # CPU of vLLM's API server per streamed token (detokenise, build and send the SSE
    # message): it works beside the engine, so it caps a server's token rate.
    frontend_token_us: float = 30.0
    request_ms: float = 40.0  # arrival to scheduler: HTTP, chat template, tokenisation
    allreduce_latency_us: float = 15.0  # one all-reduce of a tensor-parallel layer, small message
    # A mixture of experts' routed-expert kernels (vLLM's fused_moe: routing, grouped GEMMs)
    # reach this fraction of a dense GEMM's FLOPs, beyond the padding of each expert's tokens
    # to the kernel's block (cost.py counts that) ...
    moe_efficiency: float = 0.20
    # ... and stream the experts' weights at this fraction of the dense kernels' bandwidth.
    # (Together they give vLLM's own fused_moe kernel benchmark of DeepSeek-V3's experts on an
    # H100 within 35 %, which the fit never saw: tests/test_sim_cost.py.)
    moe_bandwidth_efficiency: float = 0.5
    # FP8 weights on a GPU without FP8 tensor cores (A100) run through weight-only kernels
    # (Marlin) that dequantise on the fly: this fraction of a dense GEMM's FLOPs.
    weight_only_fp8_efficiency: float = 0.8
    reserved_gib: float = 2.5  # memory neither weights nor KV cache: CUDA graphs, NCCL, context


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gib: float
    memory_bandwidth_gbs: float
    bf16_tflops: float
    fp8_tflops: float  # 0: no FP8 tensor cores (FP8 weights computed in bf16)
    interconnect_gbs: float  # one direction, per GPU
    default_max_num_seqs: int
    default_max_num_batched_tokens: int
    # The largest bf16 matmul rate measured on the device (TFLOP/s), as against the datasheet's
    # peak: where it is 0, no measurement is known and MATMUL_FRACTION of the peak is assumed.
    achieved_bf16_tflops: float = 0.0
    aliases: tuple[str, ...] = ()
    source: str = ""
    # The host's CPU against the hosts the overheads were fitted on (1.0): CPU-side costs
    # (per step, per sequence, per token, per request) are multiplied by it.
    host_cpu_factor: float = 1.0
    # The device is the host's own cores (vLLM's CPU build): the model's kernels, the host's
    # bookkeeping and the API server take turns on them, so their times add; on a GPU the
    # host prepares the next step and streams tokens while the device computes.
    serial_host: bool = False
    overheads: Overheads = field(default_factory=Overheads)
    # The figures of `overheads` the profile's file sets itself (measured on the device, or its
    # hardware's own, as a PCIe all-reduce): a fit over every device's runs leaves them.
    own_overheads: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, fp8: bool) -> float:
        tflops = self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops
        return tflops * 1e12

    @property
    def matmul_fraction(self) -> float:
        """The measured share of the datasheet's peak a large matmul reaches."""
        if self.achieved_bf16_tflops:
            return self.achieved_bf16_tflops / self.bf16_tflops
        return MATMUL_FRACTION

    def matmul_flops(self, fp8: bool) -> float:
        """The achievable matmul rate: the peak times the measured fraction (FP8 GEMMs are
        taken to reach the same share of their peak as bf16 ones)."""
        return self.peak_flops(fp8) * self.matmul_fraction

    def with_overheads(self, **changes: float) -> DeviceProfile:
        return replace(self, overheads=replace(self.overheads, **changes))

    def describe(self) -> dict[str, Any]:
        """What the record says of the device profile that produced the figures."""
        return {
            "name": self.name,
            "source": self.source,
            "memory_gib": self.memory_gib,
            "memory_bandwidth_gbs": self.memory_bandwidth_gbs,
            "bf16_tflops": self.bf16_tflops,
            "fp8_tflops": self.fp8_tflops,
            "achieved_bf16_tflops": self.achieved_bf16_tflops,
            "interconnect_gbs": self.interconnect_gbs,
            "host_cpu_factor": self.host_cpu_factor,
            "serial_host": self.serial_host,
            "overheads": {f.name: getattr(self.overheads, f.name) for f in fields(Overheads)},
        }


def _load(path: Path) -> DeviceProfile:
    data = tomllib.loads(path.read_text())
    own = data.pop("overheads", {})
    aliases = tuple(data.pop("aliases", ()))
    return DeviceProfile(
        **data,
        aliases=aliases,
        source=f"sim/device_profiles/{path.name}",
        overheads=Overheads(**own),
        own_overheads=tuple(own),
    )


@functools.cache
def profiles() -> dict[str, DeviceProfile]:
    loaded = (_load(path) for path in sorted(PROFILE_DIR.glob("*.toml")))
    return {profile.name: profile for profile in loaded}


def _key(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "-")


def device_profile(name: str | None = None) -> DeviceProfile:
    """The profile called `name` (or one of its aliases, any case); the default: H100 SXM."""
    wanted = _key(name or DEFAULT_DEVICE)
    for profile in profiles().values():
        if wanted in {_key(profile.name), *(_key(alias) for alias in profile.aliases)}:
            return profile
    raise UnknownDevice(
        f"unknown simulator device {name!r}; known devices: {', '.join(sorted(profiles()))}"
    )
