"""Reading a dataset's local files: JSON, JSON lines with their line numbers (all, or a seeded
sample), a custom line's output length, and vLLM's oversampling of a short file."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_profllm.limits import (
    MAX_JSON_BYTES,
    MAX_JSON_LINE_BYTES,
    MAX_REQUEST_TOKENS,
    InputLimitError,
    load_json,
)
from pytest_profllm.load.prompt import DatasetError, PromptRequest

if TYPE_CHECKING:
    from pytest_profllm.plan.suite import BenchmarkConfig


def dataset_json(data: str | bytes, where: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """`data` (a file's or a line's) read as JSON; else DatasetError in one line, naming
    `where`: over limits.py's bounds, or not JSON."""
    try:
        return load_json(data, what=where, max_bytes=max_bytes)
    except InputLimitError as error:
        raise DatasetError(str(error)) from None
    except ValueError as error:
        raise DatasetError(f"{where}: not JSON: {error}") from None


def read_json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """A JSON-lines file's objects with their line numbers; blank lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{path}: cannot read: {error}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item = dataset_json(line, f"{path}:{number}", MAX_JSON_LINE_BYTES)
        if not isinstance(item, dict):
            raise DatasetError(f"{path}:{number}: each line is a JSON object")
        items.append((number, item))
    return items


def sampled_lines(config: BenchmarkConfig) -> tuple[Path, list[tuple[str, dict[str, Any]]]]:
    """The dataset file, and up to `num_prompts` of its JSON lines in the seed's shuffled
    order, each with where it stands (`path:line`) for an error to name."""
    path = Path(str(config.dataset_path))
    lines = read_json_lines(path)
    random.Random(config.seed).shuffle(lines)
    return path, [(f"{path}:{number}", item) for number, item in lines[: config.num_prompts]]


def custom_output_len(config: BenchmarkConfig, item: dict[str, Any], where: str) -> int:
    """`custom_output_len`, or with -1 the line's own positive `output_tokens`."""
    if config.custom_output_len != -1:
        return config.custom_output_len
    output_len = item.get("output_tokens")
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise DatasetError(
            f"{where}: with custom_output_len -1 each line needs a positive integer "
            "'output_tokens'"
        )
    if output_len > MAX_REQUEST_TOKENS:
        raise DatasetError(
            f"{where}: output_tokens {output_len:,} is more than the {MAX_REQUEST_TOKENS:,} "
            "tokens a request may have"
        )
    return output_len


def fill(
    requests: list[PromptRequest], config: BenchmarkConfig, path: Path
) -> list[PromptRequest]:
    # vLLM oversamples a short dataset to num_prompts by drawing again from what it has.
    if not requests:
        raise DatasetError(f"{path}: no usable prompts in the file")
    picker = random.Random(config.seed)
    while len(requests) < config.num_prompts:
        requests.append(picker.choice(requests))
    return requests
