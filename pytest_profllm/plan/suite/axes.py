"""A block's axes: every combination of them, and one server's dotted keys folded into the
JSON argument they name."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any


def combinations(block: dict[str, Any]) -> list[dict[str, Any]]:
    """Every combination of a block's axes (a list value is an axis)."""
    keys = list(block)
    choices = [block[key] if isinstance(block[key], list) else [block[key]] for key in keys]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*choices)]


def fold_dotted_keys(server: dict[str, Any]) -> dict[str, Any]:
    """One server's values with each `name.field: value` merged into the JSON value of
    `name`, as vLLM merges `--name.field value` into `--name`."""
    folded = {key: value for key, value in server.items() if "." not in key}
    for key, value in server.items():
        if "." not in key:
            continue
        name, *path = key.split(".")
        base = folded.get(name)
        merged = json.loads(base) if isinstance(base, str) else copy.deepcopy(base)
        if not isinstance(merged, dict):
            merged = {}  # as in vLLM, where the dotted form then replaces the value
        inner = merged
        for part in path[:-1]:
            inner = inner.setdefault(part, {})
        inner[path[-1]] = value
        folded[name] = merged
    return folded
