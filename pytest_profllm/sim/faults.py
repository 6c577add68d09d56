"""Faults on demand: the simulator fails the ways a vLLM server does, so a suite (or the
plugin's own tests) can see what the user sees when it happens.

Faults come from `--sim-fault SPEC` (repeatable) and from the environment variable
`PROFLLM_SIM_FAULTS` (specs separated by commas), which a pytest run passes on to every server
it starts. A spec is `NAME[=VALUE][@ARG=VALUE]`; the `@` part limits it to servers whose
`vllm serve` argv has that engine argument with that value (`@max_num_seqs=16`), so one
server of a suite fails and the others do not.

    exit_at_start            exit 1 at start with vLLM's engine-core failure (CUDA out of memory)
    slow_start=SECONDS       listen only after SECONDS
    never_healthy            listen, but /health answers 503 forever
    die_after=N              the process dies (exit 1) when request N+1 arrives
    error_rate=FRACTION      that fraction of requests get vLLM's 500 error (seeded, repeatable)
    stall_request=N          the N-th request's stream stops after its first token, open
    close_request=N          the N-th request's stream is cut after its first token
    error_event=N            the N-th request's stream sends an `error` event after its first
                             token, then ends ([DONE]), as vLLM does for an error mid-stream
    junk_line=N              the N-th request's stream sends a line that is not JSON after its
                             first token, then goes on
    short_stream=N           the N-th request finishes after 2 tokens (finish_reason length),
                             whatever max_tokens and ignore_eos asked
    usage_claims=N           every usage chunk claims N completion tokens (N may be negative)
    usage_text               every usage chunk gives completion_tokens as a string
    orphan_child             start a child in its own session that outlives the process group
    drift=FRACTION           a server that slows as it serves: every step takes 1 + FRACTION * N
                             times its modelled time once N requests have arrived (0.002: twice
                             as long after 500 requests)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pytest_profllm.sim.batching import StepCost
from pytest_profllm.sim.cost import StepWork

FAULTS_ENV = "PROFLLM_SIM_FAULTS"
_FLAGS = ("exit_at_start", "never_healthy", "orphan_child", "usage_text")
_COUNTS = (
    "die_after", "stall_request", "close_request", "error_event", "junk_line", "short_stream"
)
_NUMBERS = ("slow_start", "error_rate", "drift")
_INTEGERS = ("usage_claims",)  # any whole number, negative ones included


class FaultSpecError(ValueError):
    """A fault spec the simulator cannot read; the message names it and the known faults."""


@dataclass(frozen=True)
class Faults:
    exit_at_start: bool = False
    slow_start: float = 0.0
    never_healthy: bool = False
    die_after: int | None = None
    error_rate: float = 0.0
    stall_request: int | None = None
    close_request: int | None = None
    error_event: int | None = None
    junk_line: int | None = None
    short_stream: int | None = None
    usage_claims: int | None = None
    usage_text: bool = False
    orphan_child: bool = False
    drift: float = 0.0

    def __bool__(self) -> bool:
        return self != Faults()

    def names(self) -> list[str]:
        names = (*_FLAGS, *_COUNTS, *_NUMBERS, *_INTEGERS)
        return [name for name in names if getattr(self, name) not in (None, False, 0, 0.0)]

    def in_stream(self, number: int | None) -> bool:
        """Whether request `number`'s stream has a fault after its first token."""
        return number is not None and number in (
            self.stall_request,
            self.close_request,
            self.error_event,
            self.junk_line,
        )


@dataclass(frozen=True)
class DriftingCost:
    """Fault `drift`: the engine's step cost, growing with the requests the server has received
    (a server that heats up, fragments or leaks as it runs). Counting requests rather than
    seconds makes the drift the same on a quiet host and a loaded one."""

    cost: StepCost
    per_request: float
    received: Callable[[], int]

    def step_seconds(self, work: StepWork) -> float:
        return self.cost.step_seconds(work) * (1 + self.per_request * self.received())


def parse_faults(specs: Sequence[str], argv: Sequence[str]) -> Faults:
    """The faults of `specs` that apply to a server started with `argv`."""
    values: dict[str, object] = {}
    for spec in (part.strip() for text in specs for part in text.split(",")):
        if not spec:
            continue
        body, _, selector = spec.partition("@")
        if selector and not _selects(selector, argv):
            continue
        name, has_value, text = body.partition("=")
        name = name.strip().replace("-", "_")
        if name in _FLAGS:
            if has_value:
                raise FaultSpecError(f"fault {spec!r}: {name} takes no value")
            values[name] = True
        elif name in _COUNTS:
            values[name] = _number(spec, text, int, minimum=0)
        elif name in _INTEGERS:
            values[name] = _number(spec, text, int, minimum=-math.inf)
        elif name in _NUMBERS:
            value = _number(spec, text, float, minimum=0)
            if name == "error_rate" and value > 1:
                raise FaultSpecError(f"fault {spec!r}: error_rate is a fraction from 0 to 1")
            values[name] = value
        else:
            counted = (*_COUNTS, *_NUMBERS, *_INTEGERS)
            known = ", ".join((*_FLAGS, *(f"{n}=N" for n in counted)))
            raise FaultSpecError(f"unknown fault {spec!r}; known faults: {known}")
    return Faults(**values)  # type: ignore[arg-type]


def _number(spec: str, text: str, kind: type[int] | type[float], minimum: float) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise FaultSpecError(f"fault {spec!r}: expected a number after '='") from None
    if not (minimum <= value < math.inf):
        raise FaultSpecError(f"fault {spec!r}: expected a number >= {minimum:g}")
    if math.isinf(minimum) and math.isnan(value):
        raise FaultSpecError(f"fault {spec!r}: expected a whole number")
    return value


def _selects(selector: str, argv: Sequence[str]) -> bool:
    """`arg=value`: argv has `--arg value` (or `--arg=value`; `--arg` alone for true)."""
    name, _, wanted = selector.partition("=")
    flag = "--" + name.strip().replace("_", "-")
    wanted = wanted.strip()
    if name.strip() == "model":  # the positional model, as vllm serve takes it
        return any(token == wanted for token in argv)
    for index, token in enumerate(argv):
        if token == flag:
            following = argv[index + 1] if index + 1 < len(argv) else ""
            if following.startswith("--") or not following:
                return wanted.lower() in ("", "true")
            return following == wanted
        if token.startswith(flag + "="):
            return token.split("=", 1)[1] == wanted
        if token == "--no-" + flag[2:]:
            return wanted.lower() == "false"
    return False
