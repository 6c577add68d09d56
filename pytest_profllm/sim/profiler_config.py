"""What the simulator's command line and environment say about its profiler
(`--profiler-config`) and vLLM's development routes (`VLLM_SERVER_DEV_MODE`), read as vLLM
reads them. Apart from `instruments.py`, which serves them: the parser (`cli.py`), which
`profllm plan`, the virtual clock and the offline benchmarks import, loads without aiohttp.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class ProfilerConfigError(ValueError):
    """A `--profiler-config` vLLM would reject; the message says why, as vLLM's does."""


@dataclass(frozen=True)
class ProfilerSettings:
    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_use_gzip: bool = True

    @classmethod
    def from_json(cls, text: str | None) -> ProfilerSettings:
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfilerConfigError(f"--profiler-config is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise ProfilerConfigError("--profiler-config takes a JSON object")
        profiler = data.get("profiler")
        if profiler not in (None, "torch", "cuda", "proton"):
            raise ProfilerConfigError(
                f"profiler: input should be 'torch', 'cuda' or 'proton', got {profiler!r}"
            )
        directory = str(data.get("torch_profiler_dir") or "")
        if directory and profiler != "torch":
            raise ProfilerConfigError(
                "torch_profiler_dir is only applicable when profiler is set to 'torch'"
            )
        if profiler == "torch" and not directory:
            raise ProfilerConfigError("torch_profiler_dir must be set when profiler is 'torch'")
        return cls(
            profiler=profiler,
            torch_profiler_dir=os.path.abspath(os.path.expanduser(directory)) if directory else "",
            torch_profiler_use_gzip=bool(data.get("torch_profiler_use_gzip", True)),
        )


def dev_mode_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the development routes are served: `VLLM_SERVER_DEV_MODE` read as vLLM reads it
    (an integer, 0 when unset). ValueError for what vLLM could not read either (it would not
    start)."""
    text = environ.get(DEV_MODE_ENV, "0")
    try:
        return bool(int(text))
    except ValueError:
        raise ValueError(f"{DEV_MODE_ENV}={text!r}: expected an integer (0 or 1)") from None
