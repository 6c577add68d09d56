"""The `server:` block: each key an engine argument of vLLM's (the registry), each value one
vLLM parses, and the rules across arguments that vLLM would refuse at start-up."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.secrets import ENV_SECRETS
from pytest_profllm.limits import MAX_ARGUMENT_BYTES
from pytest_profllm.plan.suite.axes import combinations
from pytest_profllm.plan.suite.problems import (
    _nearest_line,
    _Problems,
    _shown_input,
    did_you_mean,
)

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry


# An engine argument, or a field inside a JSON one (`compilation_config.mode`).
_ARG_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[A-Za-z0-9_]+)*$")
# Set by the lease, never by a suite: two servers must not be told the same port.
LEASED_SERVER_ARGS = frozenset({"host", "port"})


def _server_key_problem(key: object, registry: Registry) -> str | None:
    if not isinstance(key, str) or not _ARG_NAME.match(key):
        return f"{key!r} is not an engine argument name (snake_case, as in vLLM's EngineArgs)"
    name = key.split(".")[0]
    if name in LEASED_SERVER_ARGS:
        return f"'{name}' is set by profllm's port lease; remove it"
    if name not in registry.options:
        hint = did_you_mean(name, list(registry.options))
        return f"unknown engine argument of vLLM {registry.vllm_version}{hint or _NO_MATCH}"
    return None


_NO_MATCH = " (see `profllm engine-args --list` for all of them)"


def _check_server(
    server: dict[str, Any],
    registry: Registry,
    lines: dict[tuple[Any, ...], int],
    problems: _Problems,
) -> dict[str, Any]:
    """Each key and each value of each axis once (not every combination: the cross product
    can be large); the block with values as vLLM reads them, every list an axis."""
    checked: dict[str, Any] = {}
    for key, value in server.items():
        problem = _server_key_problem(key, registry)
        if problem is not None:
            problems.add(lines.get(("server", key)), f"server.{key}: {problem}")
            continue
        resolved = registry.resolve(key)
        if resolved is None:
            continue  # not reached: _server_key_problem knows every name
        option, path = resolved
        axis = option.axis(value, path)
        values = []
        for index, item in enumerate(axis if axis is not None else [value]):
            loc: tuple[Any, ...] = ("server", key, index) if axis is not None else ("server", key)
            try:
                values.append(option.check_field(path, item) if path else option.check(item))
                value_ = values[-1]
                if key in ENV_SECRETS and isinstance(value_, list) and len(value_) > 1:
                    raise ValueError(
                        "more than one value would go on the server's command line, which any "
                        f"local user reads (/proc/PID/cmdline); give one (it travels as "
                        f"{ENV_SECRETS[key]})"
                    )
                _check_length(key, option.render(value_) if not path else [repr(value_)])
            except ValueError as error:
                shown = f"server.{key}" + (f"[{index}]" if axis is not None else "")
                # A place inside a list value reads as an index of the key: `key[1]: ...`.
                sep = "" if str(error).startswith("[") else ": "
                problems.add(
                    _nearest_line(lines, loc), f"{shown}{sep}{error}{_shown_input(loc, item)}"
                )
        if axis is not None:
            checked[key] = values
        elif values:
            # One value that is a list: an axis of one, so that every list here is an axis.
            checked[key] = [values[0]] if isinstance(values[0], list) else values[0]
    return checked


def _check_length(key: str, tokens: list[str]) -> None:
    """ValueError where one of a value's argv tokens is longer than exec takes."""
    for token in tokens:
        size = len(token.encode("utf-8", "surrogatepass"))
        if size > MAX_ARGUMENT_BYTES:
            raise ValueError(
                f"a value of {size:,} bytes on the server's command line: Linux takes at most "
                f"{MAX_ARGUMENT_BYTES:,} bytes per argument (MAX_ARG_STRLEN); put it in a file "
                "vLLM reads instead"
            )


def _check_rules(
    server: dict[str, Any], lines: dict[tuple[Any, ...], int], problems: _Problems
) -> None:
    for combination in _rule_combinations(server):
        problem = cross_field_problem(combination)
        if problem is not None:
            key, message = problem
            problems.add(lines.get(("server", key)), f"server: {message}")


def _rule_combinations(server: dict[str, Any]) -> list[dict[str, Any]]:
    return combinations({key: server[key] for key in _RULE_KEYS if key in server})


_RULE_KEYS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "max_num_active_seqs",
    "data_parallel_size",
    "data_parallel_size_local",
)


def cross_field_problem(server: dict[str, Any]) -> tuple[str, str] | None:
    """The first rule across engine arguments that vLLM 0.33.0 would refuse at start-up, as
    (key, message); only rules that need no model or device to decide, on values given."""

    def number(key: str) -> int | None:
        value = server.get(key)
        if isinstance(value, str):
            value = human_int(value, allow_auto=True)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        return value

    tokens, seqs, length = (
        number("max_num_batched_tokens"), number("max_num_seqs"), number("max_model_len")
    )
    active, dp, dp_local = (
        number("max_num_active_seqs"),
        number("data_parallel_size"),
        number("data_parallel_size_local"),
    )
    if tokens is not None and seqs is not None and tokens < seqs:
        return "max_num_batched_tokens", (
            f"max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({seqs})"
        )
    if (
        tokens is not None
        and length is not None
        and tokens < length
        and server.get("enable_chunked_prefill") is False
    ):
        return "max_num_batched_tokens", (
            f"max_num_batched_tokens ({tokens}) is below max_model_len ({length}) with "
            "enable_chunked_prefill false: prompts longer than it could never be scheduled"
        )
    if active is not None and seqs is not None and active > seqs:
        return "max_num_active_seqs", (
            f"max_num_active_seqs ({active}) must not exceed max_num_seqs ({seqs})"
        )
    if dp is not None and dp_local is not None and dp_local > dp:
        return "data_parallel_size_local", (
            f"data_parallel_size_local ({dp_local}) must not exceed data_parallel_size ({dp})"
        )
    return None
