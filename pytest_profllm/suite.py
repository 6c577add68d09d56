"""Suite files: the typed form of `bench_*.yaml` and of the `profllm` marker's arguments.

A suite declares `server:` (vLLM engine arguments, snake_case) and `benchmark:` (the workload,
`vllm bench serve` flags in snake_case); a list value is an axis. Errors name the file, the
line, the key and what is allowed.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from pytest_profllm import metrics

if TYPE_CHECKING:
    from pytest_profllm.engine_args import Registry

_ARG_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Set by the lease, never by a suite: two servers must not be told the same port.
LEASED_SERVER_ARGS = frozenset({"host", "port"})


class SuiteError(Exception):
    """A suite that cannot be run; the message is one line naming file, line and key."""


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs 'min', 'max' or both")
        return self


class Exclusion(BaseModel):
    """Cases whose server and benchmark values match all of these are left out."""

    model_config = ConfigDict(extra="forbid")

    server: dict[str, Any] = Field(default_factory=dict)
    benchmark: dict[str, Any] = Field(default_factory=dict)


class BenchmarkConfig(BaseModel):
    """One workload, with the names of `vllm bench serve`'s flags in snake_case."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["serve"] = "serve"
    backend: Literal["openai", "openai-chat"] = "openai"
    dataset_name: Literal["random", "prefix_repetition", "sharegpt", "custom"] = "random"
    # sharegpt: a ShareGPT JSON file; custom: JSON lines with a "prompt" (and "output_tokens").
    dataset_path: str | None = None
    num_prompts: int = Field(100, gt=0)
    random_input_len: int = Field(1024, gt=0)
    random_output_len: int = Field(128, gt=0)
    random_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    random_prefix_len: int = Field(0, ge=0)
    prefix_repetition_prefix_len: int = Field(256, gt=0)
    prefix_repetition_suffix_len: int = Field(256, gt=0)
    prefix_repetition_num_prefixes: int = Field(10, gt=0)
    prefix_repetition_output_len: int = Field(128, gt=0)
    sharegpt_output_len: int | None = Field(None, gt=0)
    custom_output_len: int = 256  # -1: each line's own "output_tokens"
    request_rate: float = Field(math.inf, gt=0)
    burstiness: float = Field(1.0, gt=0)
    max_concurrency: int | None = Field(None, gt=0)
    ramp_up_strategy: Literal["linear", "exponential"] | None = None
    ramp_up_start_rps: float | None = Field(None, ge=0)
    ramp_up_end_rps: float | None = Field(None, gt=0)
    seed: int = 0
    # vLLM's own client forces ignore_eos for the random dataset, so lengths are exact.
    ignore_eos: bool = True
    temperature: float | None = Field(0.0, ge=0.0)  # None: the server's default
    tokenizer: str | None = None
    num_warmups: int = Field(0, ge=0)
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "50,90,95,99"
    goodput: dict[Literal["ttft", "tpot", "e2el"], float] | None = None
    request_timeout_s: float = Field(600.0, gt=0)
    # Ours, not vLLM's: spread the client over processes when one event loop cannot keep up.
    client_processes: int = Field(1, ge=1)

    @field_validator("percentile_metrics")
    @classmethod
    def _known_metrics(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in names if name not in metrics.LATENCY_METRICS]
        if unknown or not names:
            raise ValueError(
                f"unknown latency metric {unknown or value!r}; "
                f"allowed: {', '.join(metrics.LATENCY_METRICS)}"
            )
        return ",".join(names)

    @field_validator("metric_percentiles")
    @classmethod
    def _percentiles(cls, value: str) -> str:
        try:
            numbers = [float(p) for p in value.split(",") if p.strip()]
        except ValueError:
            raise ValueError("metric_percentiles takes numbers like '50,90,99'") from None
        if not numbers or not all(0 < p < 100 for p in numbers):
            raise ValueError("metric_percentiles must lie strictly between 0 and 100")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BenchmarkConfig:
        # The same checks as vllm bench serve, before any server starts.
        if self.ramp_up_strategy is not None:
            if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
                raise ValueError("ramp_up_strategy needs ramp_up_start_rps and ramp_up_end_rps")
            if not math.isinf(self.request_rate):
                raise ValueError("with ramp_up_strategy, leave request_rate out (the ramp sets it)")
            if self.ramp_up_start_rps > self.ramp_up_end_rps:
                raise ValueError("ramp_up_start_rps must not exceed ramp_up_end_rps")
            if self.ramp_up_strategy == "exponential" and self.ramp_up_start_rps == 0:
                raise ValueError("an exponential ramp-up cannot start at 0 requests/s")
        if self.dataset_name in ("sharegpt", "custom") and not self.dataset_path:
            raise ValueError(
                f"dataset_name {self.dataset_name!r} needs dataset_path (a local file)"
            )
        return self

    @field_serializer("request_rate")
    def _rate_json(self, rate: float) -> float | str:
        # JSON has no infinity; vLLM's result files write "inf" too.
        return "inf" if math.isinf(rate) else rate

    @property
    def percentiles(self) -> list[float]:
        return [float(p) for p in self.metric_percentiles.split(",") if p.strip()]

    @property
    def latency_metrics(self) -> list[str]:
        return self.percentile_metrics.split(",")

    def result_names(self) -> list[str]:
        # The client's health figures can be gated on too (say, p99_schedule_lag_ms).
        names = metrics.result_names(self.latency_metrics, self.percentiles)
        return names + list(metrics.CLIENT_HEALTH_KEYS)


class ThroughputConfig(BaseModel):
    """An offline throughput run: `vllm bench throughput`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["throughput"]
    backend: Literal["vllm", "vllm-chat"] = "vllm"
    dataset_name: Literal["random", "sharegpt", "prefix_repetition"] = "random"
    dataset_path: str | None = None  # sharegpt: a local ShareGPT JSON file
    # vLLM's own default of --input-len is unset, which means 1024 for the random dataset.
    input_len: int = Field(1024, gt=0)
    output_len: int | None = Field(None, gt=0)  # None: the dataset's (random: 128)
    num_prompts: int = Field(1000, gt=0)
    n: int = Field(1, gt=0)
    prefix_len: int = Field(0, ge=0)
    random_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    prefix_repetition_prefix_len: int | None = Field(None, gt=0)
    prefix_repetition_suffix_len: int | None = Field(None, gt=0)
    prefix_repetition_num_prefixes: int | None = Field(None, gt=0)
    prefix_repetition_output_len: int | None = Field(None, gt=0)
    async_engine: bool = False
    disable_detokenize: bool = False
    # Ours, not vLLM's: the whole command (engine start included) must end within this.
    timeout_s: float = Field(1800.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> ThroughputConfig:
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_name 'sharegpt' needs dataset_path (a local file)")
        if self.dataset_name == "prefix_repetition":
            needed = [
                f"prefix_repetition_{name}"
                for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len")
                if getattr(self, f"prefix_repetition_{name}") is None
            ]
            if needed:
                raise ValueError(f"dataset_name 'prefix_repetition' needs {', '.join(needed)}")
        return self

    def result_names(self) -> list[str]:
        from pytest_profllm.offline.results import THROUGHPUT_RESULTS

        return list(THROUGHPUT_RESULTS)


class LatencyConfig(BaseModel):
    """An offline latency run: `vllm bench latency`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["latency"]
    batch_size: int = Field(8, gt=0)
    input_len: int = Field(32, gt=0)
    output_len: int = Field(128, gt=0)
    n: int = Field(1, gt=0)
    num_iters_warmup: int = Field(10, ge=0)
    num_iters: int = Field(30, gt=0)
    use_beam_search: bool = False
    disable_detokenize: bool = False
    timeout_s: float = Field(1800.0, gt=0)  # ours: the whole command's limit

    def result_names(self) -> list[str]:
        from pytest_profllm.offline.results import LATENCY_RESULTS

        return list(LATENCY_RESULTS)


# What `benchmark:` describes, by its `kind` (serve when absent).
OfflineConfig = ThroughputConfig | LatencyConfig
WorkloadConfig = BenchmarkConfig | ThroughputConfig | LatencyConfig
BENCHMARK_KINDS: dict[str, type[BaseModel]] = {
    "serve": BenchmarkConfig,
    "throughput": ThroughputConfig,
    "latency": LatencyConfig,
}


class Suite(BaseModel):
    """A whole suite file before expansion; list values in server/benchmark are axes."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    server: dict[str, Any]
    benchmark: dict[str, Any] = Field(default_factory=dict)
    thresholds: dict[str, Threshold] = Field(default_factory=dict)
    repeat: int = Field(1, gt=0)
    exclude: list[Exclusion] = Field(default_factory=list)
    # Each case ends with a short run under vLLM's profiler (`/start_profile`, `/stop_profile`).
    profile: bool = False

    @field_validator("server")
    @classmethod
    def _has_model(cls, server: dict[str, Any]) -> dict[str, Any]:
        if "model" not in server:
            raise ValueError("'model' is required (the model name or path vLLM serves)")
        return server



def _server_key_problem(key: object, registry: Registry) -> str | None:
    if not isinstance(key, str) or not _ARG_NAME.match(key):
        return f"{key!r} is not an engine argument name (snake_case, as in vLLM's EngineArgs)"
    if key in LEASED_SERVER_ARGS:
        return f"'{key}' is set by profllm's port lease; remove it"
    if key not in registry.options:
        hint = did_you_mean(key, list(registry.options))
        return f"unknown engine argument of vLLM {registry.vllm_version}{hint or _NO_MATCH}"
    return None


_NO_MATCH = " (see `profllm engine-args --list` for all of them)"


def load_suite_file(
    path: Path, registry: Registry | None = None
) -> tuple[Suite, dict[tuple[Any, ...], int]]:
    """Read and validate a YAML suite; returns the suite and each key path's line (1-based)."""
    try:
        text = path.read_text()
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SuiteError(f"{where}: invalid YAML: {error.problem}") from None
    except (OSError, yaml.YAMLError) as error:
        raise SuiteError(f"{path}: cannot read suite: {error}") from None
    lines = _key_lines(node) if node is not None else {}
    if not isinstance(data, dict):
        raise SuiteError(f"{path}:1: a suite is a mapping with 'server:' and 'benchmark:' blocks")
    return validate_suite(data, str(path), lines, registry), lines


def validate_suite(
    data: dict[str, Any],
    where: str,
    lines: dict[tuple[Any, ...], int] | None = None,
    registry: Registry | None = None,
) -> Suite:
    """The typed suite; `server:` is checked against vLLM's engine arguments (`registry`,
    the bundled one by default): names, types, choices and a few rules across them."""
    from pytest_profllm.engine_args import bundled

    lines = lines or {}
    registry = registry or bundled()
    server = data.get("server")
    for key in server if isinstance(server, dict) else ():
        problem = _server_key_problem(key, registry)
        if problem is not None:
            location = at_line(where, lines.get(("server", key)))
            raise SuiteError(f"{location}: server.{key}: {problem}")
    try:
        suite = Suite.model_validate(data)
    except ValidationError as error:
        raise SuiteError(describe_error(error, where, lines, Suite)) from None
    _check_server_values(suite.server, registry, where, lines)
    _check_exclusions(suite, where, lines)
    return suite


def _check_server_values(
    server: dict[str, Any], registry: Registry, where: str, lines: dict[tuple[Any, ...], int]
) -> None:
    # Each value of each axis once (not every combination): the cross product can be large.
    model = registry.server_model
    for key, value in server.items():
        values = value if isinstance(value, list) else [value]
        for index, item in enumerate(values):
            try:
                model.model_validate({key: item})
            except ValidationError as error:
                loc: tuple[Any, ...] = ("server", key, index) if isinstance(value, list) else (
                    "server", key
                )
                shown = f"server.{key}" + (f"[{index}]" if isinstance(value, list) else "")
                message = error.errors()[0]["msg"].removeprefix("Value error, ")
                line = _nearest_line(lines, loc)
                raise SuiteError(
                    f"{at_line(where, line)}: {shown}: {message}{_shown_input(loc, item)}"
                ) from None
    for combination in _rule_combinations(server):
        problem = cross_field_problem(combination)
        if problem is not None:
            key, message = problem
            raise SuiteError(f"{at_line(where, lines.get(('server', key)))}: server: {message}")


def _rule_combinations(server: dict[str, Any]) -> list[dict[str, Any]]:
    import itertools

    keys = [key for key in _RULE_KEYS if key in server]
    choices = [server[key] if isinstance(server[key], list) else [server[key]] for key in keys]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*choices)]


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
    from pytest_profllm.engine_args import human_int

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


def _check_exclusions(suite: Suite, where: str, lines: dict[tuple[Any, ...], int]) -> None:
    # A rule naming a key its block lacks (a typo) would silently exclude nothing.
    for index, rule in enumerate(suite.exclude):
        for block_name, rule_block, block in (
            ("server", rule.server, suite.server),
            ("benchmark", rule.benchmark, suite.benchmark),
        ):
            for key in rule_block:
                if key not in block:
                    loc = ("exclude", index, block_name, key)
                    line = _nearest_line(lines, loc)
                    raise SuiteError(
                        f"{at_line(where, line)}: exclude[{index}].{block_name}.{key} is not a key "
                        f"of '{block_name}'{did_you_mean(key, list(block))}; the rule would "
                        "exclude nothing"
                    )


def describe_error(
    error: ValidationError,
    where: str,
    lines: dict[tuple[Any, ...], int],
    model: type[BaseModel],
    prefix: tuple[Any, ...] = (),
) -> str:
    """The first validation error as one line: `file:line: key: what is wrong; what is allowed`."""
    first = error.errors()[0]
    loc = prefix + tuple(first["loc"])
    location = at_line(where, _nearest_line(lines, loc))
    key = ".".join(str(part) for part in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        allowed = _allowed_fields(model, loc[len(prefix) :])
        hint = did_you_mean(str(loc[-1]), allowed)
        return f"{location}: unknown key '{key}'{hint}; allowed: {', '.join(allowed)}"
    message = first["msg"].removeprefix("Value error, ")
    return f"{location}: {key}: {message}{_shown_input(loc, first.get('input'))}"


def _shown_input(loc: tuple[Any, ...], value: Any) -> str:
    # A whole block is too long to quote, and may hold an api_key; a secret is never shown.
    from pytest_profllm.engine import REDACTED, is_secret

    if isinstance(value, dict | list):
        return ""
    if any(isinstance(part, str) and is_secret(part) for part in loc):
        return f" (got {REDACTED})"
    return f" (got {value!r})"


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed where an error points, walking nested models along its location."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            current = field.annotation if field is not None else None
        else:
            # Inside a dict[str, Model] or list[Model]: the key or index leads to the Model.
            args = get_args(current)
            current = args[-1] if args else None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return list(model.model_fields)


def did_you_mean(name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def at_line(where: str, line: int | None) -> str:
    """`file:line`, or just `file` where the line is unknown (a marker's dict)."""
    return f"{where}:{line}" if line else where


def _nearest_line(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _key_lines(node: yaml.Node, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    lines: dict[tuple[Any, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key_path = (*path, key_node.value)
            lines[key_path] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, key_path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            lines.update(_key_lines(item, (*path, index)))
    return lines
