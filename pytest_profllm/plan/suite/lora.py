"""A LoRA mix checked against the servers it runs on: every model it names is an adapter of
the server's `lora_modules`, or the base model's name, and the server serves adapters."""

from __future__ import annotations

import json
from typing import Any

from pytest_profllm.plan.suite.axes import combinations


def adapter_names(lora_modules: Any) -> list[str]:
    """The adapters' names of one server's `lora_modules` (`name=path` or a mapping, or its
    JSON text, as vLLM's parser reads them)."""
    items = lora_modules if isinstance(lora_modules, list) else [lora_modules]
    names = []
    for item in items:
        if isinstance(item, str) and "=" in item and "," not in item:
            names.append(item.split("=", 1)[0])
            continue
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError:
                continue
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            names.append(item["name"])
    return names


def base_names(server: dict[str, Any]) -> list[str]:
    """The names a server answers for its base model: `served_model_name`, else `model`."""
    served = server.get("served_model_name")
    if served:
        return [str(name) for name in (served if isinstance(served, list) else [served])]
    return [str(server.get("model"))]


def mix_problems(server_block: dict[str, Any], benchmark_block: dict[str, Any]) -> list[str]:
    """Each way a workload's `lora_mix` does not fit a server of the suite, one line each."""
    mixes = [
        values["lora_mix"]
        for values in combinations(benchmark_block)
        if isinstance(values.get("lora_mix"), dict)
    ]
    if not mixes:
        return []
    problems: list[str] = []
    for server in combinations(server_block):
        adapters = adapter_names(server.get("lora_modules") or [])
        bases = base_names(server)
        for mix in mixes:
            unknown = [name for name in mix if name not in adapters and name not in bases]
            for name in unknown:
                served = ", ".join(adapters) if adapters else "none"
                problems.append(
                    f"benchmark.lora_mix: {name!r} is neither an adapter of "
                    f"server.lora_modules ({served}) nor the base model "
                    f"({', '.join(repr(b) for b in bases)})"
                )
            if any(name in adapters for name in mix) and server.get("enable_lora") is not True:
                problems.append(
                    "benchmark.lora_mix asks for adapters: the server needs enable_lora: true"
                )
    return list(dict.fromkeys(problems))
