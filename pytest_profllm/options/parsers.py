"""What an option's text means: the `type=` parsers of the `profllm` options, which read an ini
value as well. A bad text is an argparse.ArgumentTypeError saying what was expected."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from pytest_profllm.hosts.devices import parse_cpu_sets
from pytest_profllm.hosts.pool import PORT_BLOCK
from pytest_profllm.limits import MAX_GPU_HOUR_PRICE_USD, MAX_REMEASURE
from pytest_profllm.server.tracing import TRACE_MODES, TraceMode
from pytest_profllm.sim.hardware import UnknownDevice, device_profile
from pytest_profllm.sim.profile_file import ProfileFileError, ProfileSnapshot, read_profile

DEFAULT_PORTS = "20000-21999"  # here: parse_ports' message shows it as the example

Choice = TypeVar("Choice", bound=str)


class OneOf(Generic[Choice]):
    """One of a few words. On the command line argparse checks them (`choices=`), so its own
    message stays; an ini value is checked here."""

    def __init__(self, choices: tuple[Choice, ...]) -> None:
        self.choices = choices

    def __call__(self, text: str) -> Choice:
        for choice in self.choices:
            if text == choice:
                return choice
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(self.choices)}")


_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def parse_switch(text: str) -> bool:
    """An on/off option: on the command line its flag alone; in an ini file pytest reads it
    (type `bool`) with these same words."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"invalid truth value {text!r}")


def parse_trace_mode(text: str) -> TraceMode:
    """--profllm-trace-requests: auto, on or off; the ini file's true and false (the option
    was a switch) mean on and off."""
    value = text.strip().lower()
    for mode in TRACE_MODES:
        if value == mode:
            return mode
    if value in _TRUE:
        return "on"
    if value in _FALSE:
        return "off"
    # The flag alone means on, so a path after it is read as its value: say how to write it.
    raise argparse.ArgumentTypeError(
        f"expected auto, on or off, got {text!r} (write --profllm-trace-requests=on, or put "
        "paths before the flag)"
    )


def parse_gpus(text: str) -> int | tuple[str, ...]:
    """`4` is a count (the first 4 GPUs, or 4 virtual ones); `0,1,3` names CUDA device ids."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        count = int(text)
        if count < 1:
            raise argparse.ArgumentTypeError("--profllm-gpus: a count must be at least 1")
        return count
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids or not all(re.fullmatch(r"[0-9]+", part) for part in ids):
        raise argparse.ArgumentTypeError(
            f"--profllm-gpus: expected a count like 4 or device ids like 0,1,3, got {text!r}"
        )
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"--profllm-gpus: device ids repeat in {text!r}")
    return ids


def parse_cpus(text: str) -> int | tuple[str, ...]:
    """A count of CPU core sets, or the sets themselves (`0-3/4-7`): see hosts/devices.py."""

    try:
        return parse_cpu_sets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_python(text: str) -> str:
    """A Python interpreter's path, `~` expanded; it must exist (what it holds is probed)."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--profllm-vllm-python: {text} is not a file")
    return str(path)


def parse_ports(text: str) -> range:
    """`START-END`, both included; at least one block of ports for one server."""

    try:
        start_text, end_text = text.split("-")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: expected START-END like {DEFAULT_PORTS}, got {text!r}"
        ) from None
    if not 1024 <= start <= end <= 65535:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: {text!r} must lie within 1024-65535 with START <= END"
        )
    if end - start + 1 < PORT_BLOCK:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: {text!r} holds fewer than {PORT_BLOCK} ports (one server's block)"
        )
    return range(start, end + 1)


def _number(text: str, expected: str, valid: Callable[[float], bool], invalid: str) -> float:
    """`text` as a number for which `valid` holds; ArgumentTypeError saying what was expected
    (`expected`: not a number; `invalid`: out of range). NaN is never valid."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if math.isnan(value) or not valid(value):
        raise argparse.ArgumentTypeError(f"{invalid}, got {text!r}")
    return value


def _positive(value: float) -> bool:
    return 0 < value < math.inf


def parse_seconds(text: str) -> float:
    return _number(text, "seconds", _positive, "expected a positive number of seconds")


def parse_milliseconds(text: str) -> float:
    return _number(text, "milliseconds", _positive, "expected a positive number of milliseconds")


def parse_share(text: str) -> float:
    """A share of a whole: `0.25` or `25%`, from 0 to 1."""
    value = text.strip()
    scale = 100.0 if value.endswith("%") else 1.0
    return _number(
        value.removesuffix("%"), "a share like 0.25 or 25%",
        lambda v: 0 <= v / scale <= 1, "a share lies between 0 and 1 (0% and 100%)",
    ) / scale


def parse_gpu_hour_price(text: str) -> float:
    """A price in US dollars per GPU-hour: 0 to MAX_GPU_HOUR_PRICE_USD (`2.50`, `$2.50`)."""
    return _number(
        text.strip().removeprefix("$"), "a price in USD per GPU-hour like 2.50",
        lambda v: 0 <= v <= MAX_GPU_HOUR_PRICE_USD,
        f"a price is a number from 0 to {MAX_GPU_HOUR_PRICE_USD:,.0f} USD per GPU-hour",
    )


def parse_max_cases(text: str) -> int:
    """A whole number of cases, at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--profllm-max-cases: expected a count of cases, got {text!r}"
        )
    return int(text)


def parse_remeasure(text: str) -> int:
    """How many more times a load the host made invalid runs: 0 to MAX_REMEASURE."""
    stripped = text.strip()
    # isdigit first: int() of a thousands of digits long text is slow and refused by Python.
    if not stripped.isascii() or not stripped.isdigit() or len(stripped) > 6 \
            or int(stripped) > MAX_REMEASURE:
        raise argparse.ArgumentTypeError(
            f"--profllm-remeasure: expected a count of runs from 0 to {MAX_REMEASURE}, "
            f"got {text!r}"
        )
    return int(stripped)


def parse_metrics_port(text: str) -> int:
    """The port of the session's own /metrics: a TCP port, 1 to 65535."""
    value = text.strip()
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise argparse.ArgumentTypeError(
            f"--profllm-metrics-port: expected a TCP port (1-65535), got {text!r}"
        )
    return int(value)


def parse_confidence(text: str) -> float:
    """The regression gate's confidence level, in [0.5, 1)."""
    return _number(
        text, "a confidence like 0.99", lambda v: 0.5 <= v < 1, "a confidence lies in [0.5, 1)"
    )


def parse_resamples(text: str) -> int:
    """The regression gate's bootstrap resamples: a whole number, at least 100."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of resamples, got {text!r}")
    return int(_number(text, "a number of resamples", lambda v: v >= 100, "at least 100 resamples"))


def parse_sim_device(text: str) -> str:
    """A device profile of the simulator (`sim/device_profiles`), by name or alias."""

    try:
        return device_profile(text).name
    except UnknownDevice as error:
        raise argparse.ArgumentTypeError(f"--profllm-sim-device: {error}") from None


def parse_sim_profile(text: str) -> ProfileSnapshot:
    """A device profile file for the simulator (`profllm calibrate` writes one), read and
    checked now: a bad file stops the session in one line, not each server; and what is read
    now is what the session uses, whatever becomes of the file."""
    path = Path(text).expanduser().resolve()
    try:
        return read_profile(path)
    except ProfileFileError as error:
        raise argparse.ArgumentTypeError(f"--profllm-sim-profile: {error}") from None


def parse_saturation_margin(text: str) -> float:
    """The saturation stop's margin: a fraction (`0.1`) or a percentage (`10%`) under 1; `off`
    is 0, which turns the stop off."""
    cleaned = text.strip().lower()
    if cleaned in ("off", "none", "no"):
        return 0.0
    percent = cleaned.endswith("%")
    value = _number(
        cleaned.removesuffix("%"),
        "a fraction like 0.1, a percentage like 10% or off",
        lambda v: 0 <= v < (100 if percent else 1),
        "a margin lies in [0, 1) (or [0%, 100%))",
    )
    return value / 100 if percent else value


# `--profllm-invalid exit-code:N`: a status none of pytest's own (0 to 5) and under the 126 and
# up that shells keep for themselves.
INVALID_EXIT_STATUSES = range(6, 126)


@dataclass(frozen=True)
class InvalidPolicy:
    """What an invalid case does to the session: `fail` (it fails, status 1, as a missed
    threshold does), `skip` (it is reported skipped, with its reason), or `exit-code:N` (it
    fails, and where invalid cases were the session's only failures the status is N)."""

    skip: bool = False
    exit_status: int | None = None

    def __str__(self) -> str:
        if self.skip:
            return "skip"
        return "fail" if self.exit_status is None else f"exit-code:{self.exit_status}"


def parse_invalid(text: str) -> InvalidPolicy:
    """`fail`, `skip` or `exit-code:N` (N from 6 to 125)."""
    cleaned = text.strip().lower()
    if cleaned in ("fail", "skip"):
        return InvalidPolicy(skip=cleaned == "skip")
    number = cleaned.removeprefix("exit-code:")
    if number != cleaned and number.isascii() and number.isdigit() and len(number) <= 3 \
            and int(number) in INVALID_EXIT_STATUSES:
        return InvalidPolicy(exit_status=int(number))
    raise argparse.ArgumentTypeError(
        f"--profllm-invalid: expected fail, skip or exit-code:N (N from "
        f"{INVALID_EXIT_STATUSES.start} to {INVALID_EXIT_STATUSES.stop - 1}, not one of "
        f"pytest's own statuses), got {text!r}"
    )
