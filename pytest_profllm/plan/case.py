"""The plan: a suite's cross product, expanded into cases with stable ids and server keys.

Cases are ordered server-major, so that every case of one server runs back to back in one
server. A case id reads `bench_smoke.yaml::qwen3-8b-tp1-seqs64::random-rate4`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pytest_profllm.engine.secrets import RedactedDict, is_secret
from pytest_profllm.plan.suite import (
    BENCHMARK_KINDS,
    AccuracyConfig,
    BenchmarkConfig,
    CapacityConfig,
    Exclusion,
    Suite,
    SuiteError,
    Threshold,
    WorkloadConfig,
    at_line,
    describe_error,
    did_you_mean,
    fold_dotted_keys,
    measures,
)

# Short names for the axes users sweep most; other axes use their words' initials.
_ABBREVIATIONS = {
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "data_parallel_size": "dp",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "mnbt",
    "max_model_len": "len",
    "gpu_memory_utilization": "gmu",
    "enable_prefix_caching": "prefix-cache",
    "enable_chunked_prefill": "chunked",
    "request_rate": "rate",
    "max_concurrency": "conc",
    "num_prompts": "n",
    "random_input_len": "in",
    "random_output_len": "out",
    "random_prefix_len": "prefix",
    "random_range_ratio": "range",
    "dataset_name": "",
    "random_mm_bucket_config": "image",
    "random_mm_base_items_per_request": "items",
}


@dataclass(frozen=True)
class Case:
    """One benchmark run: a server configuration and one workload against it."""

    suite: str
    source: str  # the suite file, or the test function of a marker
    server_label: str
    workload_label: str
    server: dict[str, Any]
    benchmark: WorkloadConfig
    thresholds: dict[str, Threshold]
    repeat_index: int = 0
    repeat_count: int = 1
    # Whether the workload's seed was derived from the case id (the suite sets none).
    seed_derived: bool = False
    profile: bool = False  # a short profiled run after the measured one
    regression: dict[str, float] = field(default_factory=dict)  # metric -> tolerance
    # The values this case takes on its suite's axes, as ("server.key", value) pairs: what
    # was read as an axis, and not as one (list) value.
    axis_values: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # pytest shows this mapping in reprs (-l, fixture values, JUnit XML): secrets as ***.
        if not isinstance(self.server, RedactedDict):
            object.__setattr__(self, "server", RedactedDict(self.server))

    @property
    def kind(self) -> str:
        """serve, capacity or accuracy (against a server), or an offline kind (throughput,
        latency) that runs without one."""
        return self.benchmark.kind

    @property
    def server_key(self) -> str:
        # A profiling server is started differently (vLLM's profiler on): it is another server.
        # An offline case starts its own engine, never a server that a serve case could share.
        extra: dict[str, Any] = {"<profile>": True} if self.profile else {}
        # A capacity case probes a running server as a serve case does, and an accuracy case
        # scores one: they may share it.
        if self.kind not in ("serve", "capacity", "accuracy"):
            extra["<kind>"] = self.kind
        return server_key({**self.server, **extra})

    @property
    def name(self) -> str:
        """The case's part of the node id, after the file: `server::workload`."""
        return f"{self.server_label}::{self.workload_label}"

    @property
    def case_id(self) -> str:
        """The record's case id: the suite file's name (not its folder), then `name`."""
        return f"{_case_file(self.source)}::{self.name}"

    @property
    def gpus_needed(self) -> int:
        return gpus_needed(self.server)


def server_key(server: dict[str, Any]) -> str:
    """A short hash of the effective server configuration: equal configs share one server."""
    canonical = json.dumps(server, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def gpus_needed(server: dict[str, Any]) -> int:
    sizes = (
        server.get(name, 1) or 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    )
    return math.prod(int(size) for size in sizes)


# More cases than this from one suite is a usage error unless raised (--profllm-max-cases):
# a matrix of millions runs for days, and expanding it alone takes minutes and gigabytes.
MAX_CASES = 10_000


def case_count(suite: Suite) -> tuple[int, list[str]]:
    """How many cases a suite's cross product makes (before exclusions), and the factors."""
    factors = [
        (f"{block}.{key}", len(value))
        for block, values in (("server", suite.server), ("benchmark", suite.benchmark))
        for key, value in values.items()
        if isinstance(value, list) and len(value) > 1
    ]
    if suite.repeat > 1:
        factors.append(("repeat", suite.repeat))
    return math.prod(n for _, n in factors), [f"{name} {n:,}" for name, n in factors]


def expand(
    suite: Suite,
    source: str,
    lines: dict[tuple[Any, ...], int] | None = None,
    max_cases: int = MAX_CASES,
) -> list[Case]:
    """Every case of a suite, server-major, exclusions removed, thresholds checked; SuiteError
    for a matrix of more than `max_cases`, known before anything is expanded."""
    count, factors = case_count(suite)
    if count > max_cases:
        raise SuiteError(
            f"{source}: {count:,} cases ({' x '.join(factors)}) is over the limit of "
            f"{max_cases:,}; raise it with --profllm-max-cases (ini: profllm_max_cases)"
        )
    lines = lines or {}
    suite_name = suite.name or _suite_name(source)
    server_axes = _axes(suite.server)
    bench_axes = _axes(suite.benchmark)
    servers = list(_combinations(suite.server))
    workloads = [
        _validate_benchmark(values, source, lines) for values in _combinations(suite.benchmark)
    ]
    for workload in workloads:
        _check_thresholds(suite, workload, source, lines)
        if suite.profile and isinstance(workload, CapacityConfig):
            raise SuiteError(
                f"{at_line(source, lines.get(('profile',)))}: profile: true profiles one load; "
                "a capacity case runs many (profile a serve case at the capacity instead)"
            )
        if isinstance(workload, AccuracyConfig) and workload.api == "completions":
            _check_tokenizer_info(servers, source, lines)
        if suite.profile and workload.kind != "serve":
            raise SuiteError(
                f"{at_line(source, lines.get(('profile',)))}: profile: true profiles a server; "
                f"a {workload.kind} case runs none (leave profile out of offline suites)"
            )
    cases: list[Case] = []
    server_labels = _unique_labels(
        [
            _label(_model_short_name(str(s["model"])), s, server_axes - {"model"}, suite.server)
            for s in servers
        ]
    )
    bench_labels = _unique_labels(
        [_label(_workload_head(w), w.model_dump(), bench_axes - _HEAD_KEYS) for w in workloads]
    )
    for server, server_label in zip(servers, server_labels, strict=True):
        for workload, workload_label, raw in zip(
            workloads, bench_labels, _combinations(suite.benchmark), strict=True
        ):
            if _excluded(suite.exclude, server, raw):
                continue
            axis_values = tuple(
                [(f"server.{key}", server[key]) for key in suite.server if key in server_axes]
                + [(f"benchmark.{key}", raw[key]) for key in suite.benchmark if key in bench_axes]
            )
            for index in range(suite.repeat):
                label = workload_label if suite.repeat == 1 else f"{workload_label}-r{index + 1}"
                cases.append(
                    Case(
                        suite=suite_name,
                        source=source,
                        server_label=server_label,
                        workload_label=label,
                        server=fold_dotted_keys(server),
                        benchmark=with_prompt_seed(
                            workload, f"{_case_file(source)}::{server_label}::{label}"
                        ),
                        thresholds=suite.thresholds,
                        repeat_index=index,
                        repeat_count=suite.repeat,
                        seed_derived=isinstance(workload, BenchmarkConfig)
                        and "seed" not in workload.model_fields_set,
                        profile=suite.profile,
                        axis_values=axis_values,
                        regression=suite.regression,
                    )
                )
    return cases


# Keys a workload's name already holds: not repeated as an axis in its label.
_HEAD_KEYS = frozenset({"task"})


def _check_tokenizer_info(
    servers: list[dict[str, Any]], source: str, lines: dict[tuple[Any, ...], int]
) -> None:
    """lm-eval's completions model counts a prompt's tokens with the server's own tokenizer
    (its /tokenizer_info and /tokenize), which vLLM serves only when asked: known before any
    server starts."""
    if all(server.get("enable_tokenizer_info_endpoint") is True for server in servers):
        return
    where = at_line(source, lines.get(("benchmark", "kind")))
    raise SuiteError(
        f"{where}: an accuracy case (api: completions) reads the server's tokenizer from "
        "/tokenizer_info, which vLLM serves only with enable_tokenizer_info_endpoint: true: "
        "add it under server:"
    )


def with_prompt_seed(workload: WorkloadConfig, case_id: str) -> WorkloadConfig:
    """The workload with the seed its prompts are drawn from: the suite's `seed` where it sets
    one, else one derived from the case id (which names the repeat). Two cases on one server,
    and two repeats of a case, then send different prompts, so none is answered from what an
    earlier one left in the prefix cache; the same case draws the same prompts in every
    session, so the gate compares like with like."""
    if "seed" in workload.model_fields_set or not isinstance(workload, BenchmarkConfig):
        return workload
    return workload.model_copy(update={"seed": derived_seed(case_id)})


def derived_seed(case_id: str) -> int:
    # 31 bits: numpy's and Python's generators take any non-negative int, vLLM's --seed an int.
    return int.from_bytes(hashlib.sha256(f"profllm-prompts:{case_id}".encode()).digest()[:4]) >> 1


def _case_file(source: str) -> str:
    # The record's case id starts with the suite file's name (not its folder).
    return source.split("/")[-1]


def _suite_name(source: str) -> str:
    # `bench_smoke.yaml` is suite "smoke"; a marked test is "test_file.py::test_name". The
    # case id's file part: a node id's folders are parted by "/", and an escaped control
    # character of the name (session/collect.py) reads `\x1b`, a backslash not a folder's.
    name = _case_file(source)
    if "::" in name:
        return name
    return name.removesuffix(".yaml").removesuffix(".yml").removeprefix("bench_")


def _axes(block: dict[str, Any]) -> set[str]:
    # A one-value list (often a list-valued argument, `[[a, b]]`) names nothing apart.
    return {key for key, value in block.items() if isinstance(value, list) and len(value) > 1}


def _combinations(block: dict[str, Any]) -> list[dict[str, Any]]:
    keys = list(block)
    choices = [block[key] if isinstance(block[key], list) else [block[key]] for key in keys]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*choices)]


def _workload_head(workload: WorkloadConfig) -> str:
    # A serve workload is named by its dataset; an offline one by its kind first.
    if isinstance(workload, BenchmarkConfig):
        if isinstance(workload, CapacityConfig):
            return f"capacity-{workload.dataset_name}"
        return workload.dataset_name
    if isinstance(workload, AccuracyConfig):  # named by its task (a YAML file by its stem)
        return f"accuracy-{_task_stem(workload.task)}"
    dataset = getattr(workload, "dataset_name", "")
    return f"{workload.kind}-{dataset}" if dataset else workload.kind


def _task_stem(task: str) -> str:
    name = re.split(r"[\\/]", task)[-1]
    return re.sub(r"\.ya?ml$", "", name)


def _validate_benchmark(
    values: dict[str, Any], source: str, lines: dict[tuple[Any, ...], int]
) -> WorkloadConfig:
    kind = values.get("kind", "serve")
    model = BENCHMARK_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        where = at_line(source, lines.get(("benchmark", "kind")))
        raise SuiteError(
            f"{where}: benchmark.kind: {kind!r} is not a benchmark kind; "
            f"allowed: {', '.join(BENCHMARK_KINDS)}"
        )
    try:
        workload: WorkloadConfig = model.model_validate(values)  # type: ignore[assignment]
    except ValidationError as error:
        raise SuiteError(
            describe_error(error, source, lines, model, prefix=("benchmark",))
        ) from None
    return workload


def _check_thresholds(
    suite: Suite, workload: WorkloadConfig, source: str, lines: dict[tuple[Any, ...], int]
) -> None:
    allowed = workload.result_names()
    for metric in suite.thresholds:
        if not measures(workload, metric):
            where = at_line(source, lines.get(("thresholds", metric)))
            raise SuiteError(
                f"{where}: unknown metric 'thresholds.{metric}'{did_you_mean(metric, allowed)}; "
                f"allowed: {', '.join(allowed)}"
            )


def _excluded(exclusions: list[Exclusion], server: dict[str, Any], bench: dict[str, Any]) -> bool:
    return any(
        all(server.get(k) == v for k, v in rule.server.items())
        and all(bench.get(k) == v for k, v in rule.benchmark.items())
        for rule in exclusions
    )


def _model_short_name(model: str) -> str:
    return model.rstrip("/").split("/")[-1].lower()


def _label(
    head: str, values: dict[str, Any], axes: set[str], block: dict[str, Any] | None = None
) -> str:
    parts = [head] if head else []
    for key in sorted(axes, key=list(values).index):
        if is_secret(key) and block is not None:
            # Ids land in reports and files: a secret axis is named by position, not value.
            parts.append(f"{_abbreviate(key)}{block[key].index(values[key]) + 1}")
            continue
        parts.append(_abbreviate(key) + _format_value(values[key]))
    return _slug("-".join(parts)) or "default"


def _abbreviate(key: str) -> str:
    if "." in key:  # compilation_config.mode -> cc.mode
        name, *path = key.split(".")
        return ".".join([_abbreviate(name), *path])
    if key in _ABBREVIATIONS:
        return _ABBREVIATIONS[key]
    return "".join(word[0] for word in key.split("_") if word)


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "-on" if value else "-off"
    if isinstance(value, float) and math.isinf(value):
        return "-inf" if value > 0 else "-minf"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list) and len(value) <= 8 and all(
        isinstance(item, int | str) and not isinstance(item, bool) and len(str(item)) <= 12
        for item in value
    ):
        return "-" + "_".join(str(item) for item in value)  # a list value: [1, 2, 4] -> 1_2_4
    if isinstance(value, dict) and value and all(
        isinstance(k, str) and re.fullmatch(r"\(\d+, ?\d+, ?\d+\)", k) for k in value
    ):  # random-mm buckets with a chance: {"(720, 1280, 1)": 1.0} -> 720x1280
        shapes = [re.findall(r"\d+", k) for k, p in value.items() if p]
        return "-" + "_".join("x".join(n if n[2] != "1" else n[:2]) for n in shapes)
    if isinstance(value, dict | list):
        return "-" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:6]
    text = str(value)
    return text if text[:1].isdigit() else f"-{text}"


# Control characters: C0 (a newline, ESC), DEL and C1. A terminal acts on them (clears the
# screen, sets its title, starts a line) where it should show a name.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str, keep: str = "") -> str:
    """`text` with each control character but those in `keep` written as its escape
    (`\\x1b`): a suite file's name is the first part of a node id and a case id, which
    reach the terminal (pytest's lines, the live view, the summary), and, unlike the
    slugged labels, it may hold any character but `/`."""
    return _CONTROLS.sub(lambda found: found.group() if found.group() in keep
                         else f"\\x{ord(found.group()):02x}", text)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", text).strip("-").lower()


def _unique_labels(labels: list[str]) -> list[str]:
    # Labels collide only when two different values format alike; a counter keeps ids unique.
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        count = seen.get(label, 0)
        seen[label] = count + 1
        unique.append(label if count == 0 else f"{label}-{count + 1}")
    return unique
