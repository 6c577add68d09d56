"""A workload as `vllm bench serve`'s command line: to check a case against vLLM's own client,
or to run it there by hand.

Options that are ours alone (`trace_speedup`, `trace_target_rate`, the trace window,
`client_processes`, `request_timeout_s`, the `conversation_*` keys) have no vLLM flag and are
left out, so a workload that sets them replays differently under vLLM; `unrendered` names those
a workload sets. A conversation workload has no `vllm bench serve` form at all. A LoRA mix is
vLLM's `--lora-modules NAME ... --lora-assignment random|round-robin`, which picks the names
evenly: a mix of unequal weights is named by `unrendered`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pytest_profllm.plan.suite import BenchmarkConfig, bucket_shape

OURS = (
    "kind",
    "client_processes",
    "request_timeout_s",
    "trace_speedup",
    # vLLM's timed_trace reads no links between lines: its client sends each at its time.
    "timed_trace_label_session_id",
    "timed_trace_label_request_id",
    "timed_trace_label_parent_id",
    "timed_trace_label_delay",
    "trace_target_rate",
    "trace_start_s",
    "trace_duration_s",
    "conversation_turns",
    "conversation_input_len",
    "conversation_output_len",
    "conversation_range_ratio",
    "conversation_think_time_s",
    "conversation_think_time_distribution",
)


# vLLM's names of our LoRA assignments (vllm/benchmarks/serve.py `--lora-assignment`).
_LORA_ASSIGNMENTS = {"weighted": "random", "round_robin": "round-robin"}


def unrendered(config: BenchmarkConfig) -> list[str]:
    """The options the workload sets that `vllm bench serve` has no flag for."""
    names = [name for name in OURS if name in config.model_fields_set and name != "kind"]
    if config.lora_mix and len(set(config.lora_mix.values())) > 1:
        names.append("lora_mix")  # vLLM's client picks its --lora-modules evenly
    return names


def vllm_bench_serve_argv(
    config: BenchmarkConfig, *, base_url: str, model: str, tokenizer: str | None = None
) -> list[str]:
    """The arguments after `vllm bench serve` for this workload against `base_url`."""
    if config.dataset_name == "conversation":
        raise ValueError(
            "dataset_name 'conversation' is ours: `vllm bench serve` has no such dataset"
        )
    argv = ["--base-url", base_url, "--model", model]
    if tokenizer or config.tokenizer:
        argv += ["--tokenizer", str(tokenizer or config.tokenizer)]
    values = config.model_dump(exclude={*OURS, "tokenizer", "lora_mix", "lora_assignment"})
    for name, value in values.items():
        if _other_datasets(name, config.dataset_name):
            continue  # another dataset's defaults: noise on the command line
        flag = "--" + name.replace("_", "-")
        argv += _rendered(name, flag, value)
    if config.lora_mix:
        argv += ["--lora-modules", *config.lora_mix]
        argv += ["--lora-assignment", _LORA_ASSIGNMENTS[config.lora_assignment]]
    # profllm sends local images inline and audio as a chat part; these make vLLM's do so.
    if config.dataset_name == "custom_image":
        argv.append("--custom-ensure-client-side-data")
    if config.dataset_name == "custom_audio":
        argv.append("--enable-multimodal-chat")
    return argv


_DATASET_PREFIXES = {
    "random_mm_": "random-mm",
    "spec_bench_": "spec_bench",
    "speed_bench_": "speed_bench",
}


def _other_datasets(name: str, dataset_name: str) -> bool:
    return any(
        name.startswith(prefix) and dataset_name != owner
        for prefix, owner in _DATASET_PREFIXES.items()
    )


def _rendered(name: str, flag: str, value: Any) -> list[str]:
    if value is None:
        return []
    if name == "self_timed":
        return [flag if value else "--no-self-timed"]
    if isinstance(value, bool):
        return [flag] if value else []
    if name == "random_mm_bucket_config":  # vLLM reads a Python literal with tuple keys
        buckets = ", ".join(
            f"({', '.join(map(str, bucket_shape(key)))}): {chance!r}"
            for key, chance in value.items()
        )
        return [flag, "{" + buckets + "}"]
    if name == "random_mm_limit_mm_per_prompt":  # vLLM reads JSON
        return [flag, json.dumps(value)]
    if name == "goodput":
        return [flag, *(f"{key}:{limit:g}" for key, limit in value.items())]
    if isinstance(value, float) and math.isinf(value):
        return [flag, "inf"]
    if name == "request_rate" and value == "inf":
        return [flag, "inf"]
    return [flag, str(value)]
