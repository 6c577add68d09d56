"""A device profile from a file of the user's: `--sim-profile PATH` (the plugin's
`--profllm-sim-profile`), in place of a shipped profile.

The file has a shipped profile's TOML shape (`sim/device_profiles/*.toml`) plus a `[fitted]`
table that names the runs it was fitted on (`profllm calibrate` writes one). A record priced
by it says so by the file's name and the sha256 of its bytes (`identity`), and the regression
gate's fingerprint carries that digest: runs priced by two profiles are never compared.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
)

from pytest_profllm.hosts.files import write_atomic
from pytest_profllm.sim.hardware import DeviceProfile, Overheads


class ProfileFileError(ValueError):
    """A profile file that cannot be read or is not a profile: one line, naming the file."""


class FittedOn(BaseModel):
    """Which runs a profile was fitted on (`profllm calibrate`)."""

    model_config = ConfigDict(extra="forbid")
    run_ids: list[str] = Field(default_factory=list)
    device: str = ""
    vllm_version: str = ""
    model: str = ""
    date: str = ""


def _within(low: float, high: float, *, low_open: bool = False) -> Any:
    """A float from `low` (excluded where `low_open`) to `high`, NaN and infinity refused."""
    bound = Field(gt=low, le=high) if low_open else Field(ge=low, le=high)
    return Annotated[float, bound, AllowInfNan(False)]


# What a profile may say, each within a range no device comes near the ends of (a datasheet's
# figures are within a factor of 1,000 of the shipped ones). Past them the engine model's
# arithmetic leaves a float's range: `bf16_tflops = inf` priced a case at 0 tokens/s and
# ended the session (INTERNALERROR), `host_cpu_factor = inf` failed a case as out of KV cache.
_FRACTION = _within(0.01, 2.0)  # an efficiency: fitted ones reach 1.5
OVERHEAD_RANGES: dict[str, Any] = {
    "step_ms": _within(0.0, 10_000.0),
    "seq_us": _within(0.0, 1e6),
    "bandwidth_efficiency": _FRACTION,
    "compute_efficiency": _FRACTION,
    "frontend_token_us": _within(0.0, 1e6),
    "request_ms": _within(0.0, 1e6),
    "allreduce_latency_us": _within(0.0, 1e6),
    "moe_efficiency": _FRACTION,
    "moe_bandwidth_efficiency": _FRACTION,
    "weight_only_fp8_efficiency": _FRACTION,
    "reserved_gib": _within(0.0, 100_000.0),
}


def _sharpness(value: float) -> float:
    # inf is meaningful here (a plain roofline, what calibrate may write); a finite p-norm
    # past 64 is the same as inf to a float's precision.
    if not (value == math.inf or 1.0 <= value <= 64.0):
        raise ValueError("should be from 1 to 64, or inf (a plain roofline)")
    return value


# Every figure of `Overheads` may be given, none other (a misspelt one would be ignored).
OverheadsTable: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "OverheadsTable",
    __config__=ConfigDict(extra="forbid"),
    roofline_sharpness=(Annotated[float, AfterValidator(_sharpness)] | None, None),
    **{f.name: (OVERHEAD_RANGES[f.name] | None, None) for f in fields(Overheads)
       if f.name != "roofline_sharpness"},
)


class ProfileFile(BaseModel):
    """The TOML file: a shipped profile's keys, and `[fitted]`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    memory_gib: _within(0.0, 100_000.0, low_open=True)  # type: ignore[valid-type]
    memory_bandwidth_gbs: _within(1.0, 1e6)  # type: ignore[valid-type]
    bf16_tflops: _within(0.01, 1e6)  # type: ignore[valid-type]
    fp8_tflops: _within(0.0, 1e6) = 0.0  # type: ignore[valid-type]
    achieved_bf16_tflops: _within(0.0, 1e6) = 0.0  # type: ignore[valid-type]
    interconnect_gbs: _within(0.1, 1e6)  # type: ignore[valid-type]
    default_max_num_seqs: int = Field(ge=1, le=1 << 20)
    default_max_num_batched_tokens: int = Field(ge=1, le=1 << 24)
    host_cpu_factor: _within(0.01, 100.0) = 1.0  # type: ignore[valid-type]
    serial_host: bool = False
    overheads: OverheadsTable = Field(default_factory=OverheadsTable)
    fitted: FittedOn | None = None


def load_profile_file(path: Path) -> DeviceProfile:
    """The device profile a file describes. Raises ProfileFileError: `PATH: what is wrong`."""
    return _parse(path, _read(path))[0]


@dataclass(frozen=True)
class ProfileSnapshot:
    """A profile file as a session read it, once, at its start. Every server, every run on
    the virtual clock and every record of the session use these bytes: a file edited or
    deleted while the session runs changes neither what is measured nor what the records say
    priced it."""

    path: Path  # the file as the user named it (resolved)
    content: bytes = field(repr=False)

    @property
    def profile(self) -> DeviceProfile:
        return _parse(self.path, self.content)[0]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    def identity(self) -> dict[str, Any]:
        """What a record says of the profile that priced it: the profile's name, the file,
        the sha256 of its bytes and the runs it was fitted on."""
        profile, parsed = _parse(self.path, self.content)
        return {
            "name": profile.name,
            "path": str(self.path),
            "sha256": self.sha256,
            "fitted": parsed.fitted.model_dump() if parsed.fitted else None,
        }

    def copy_into(self, folder: Path) -> Path:
        """These bytes as a file in `folder`, named by the file and its digest: what a server
        started later reads (`--sim-profile`), whatever became of the user's file. Written
        once, atomically: workers sharing the folder write the same bytes to the same name."""
        target = folder / f"{self.path.stem}-{self.sha256[:12]}{self.path.suffix or '.toml'}"
        if not target.is_file() or target.read_bytes() != self.content:
            write_atomic(target, self.content)
        return target


def read_profile(path: Path) -> ProfileSnapshot:
    """The file read and checked now, as the session will use it. Raises ProfileFileError."""
    content = _read(path)
    _parse(path, content)
    return ProfileSnapshot(path, content)


def identity(path: Path) -> dict[str, Any]:
    """`ProfileSnapshot.identity` of the file as it is now. Raises ProfileFileError."""
    return read_profile(path).identity()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ProfileFileError(f"{path}: cannot read the profile: {error.strerror}") from None


def _parse(path: Path, content: bytes) -> tuple[DeviceProfile, ProfileFile]:
    try:
        data = tomllib.loads(content.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ProfileFileError(f"{path}: not a TOML file: {error}") from None
    try:
        parsed = ProfileFile.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise ProfileFileError(f"{path}: {where}: {first['msg']}{more}") from None
    given = {k: v for k, v in parsed.overheads.model_dump().items() if v is not None}
    fields_ = parsed.model_dump(exclude={"overheads", "fitted", "aliases"})
    profile = DeviceProfile(
        **fields_,
        aliases=tuple(parsed.aliases),
        source=str(path),
        overheads=Overheads(**given),
    )
    return profile, parsed


def profile_toml(profile: DeviceProfile, fitted: FittedOn, comments: list[str]) -> str:
    """A profile file for `profile`, with `[fitted]` naming its runs, `comments` on top."""
    # A comment is one line: a newline in a run id (a label) would end it and start TOML.
    lines = [f"# {part}" for line in comments for part in line.splitlines() or [""]]
    head = {
        "name": profile.name,
        "memory_gib": profile.memory_gib,
        "memory_bandwidth_gbs": profile.memory_bandwidth_gbs,
        "bf16_tflops": profile.bf16_tflops,
        "fp8_tflops": profile.fp8_tflops,
        "achieved_bf16_tflops": profile.achieved_bf16_tflops,
        "interconnect_gbs": profile.interconnect_gbs,
        "default_max_num_seqs": profile.default_max_num_seqs,
        "default_max_num_batched_tokens": profile.default_max_num_batched_tokens,
        "host_cpu_factor": profile.host_cpu_factor,
        "serial_host": profile.serial_host,
    }
    lines += [f"{key} = {_toml_value(value)}" for key, value in head.items()]
    lines += ["", "[overheads]"]
    lines += [
        f"{f.name} = {_toml_value(getattr(profile.overheads, f.name))}" for f in fields(Overheads)
    ]
    lines += ["", "[fitted]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in fitted.model_dump().items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        # Six significant figures: a fit is not known closer, and the file is read by people.
        return "inf" if value == float("inf") else repr(float(f"{value:.6g}"))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    # JSON's string escapes are TOML's basic string's (\n, \", \\, \uXXXX): a run id with a
    # newline or a control character stays one valid string. ensure_ascii: no raw surrogate.
    return json.dumps(str(value).encode("utf-8", "replace").decode("utf-8"))
