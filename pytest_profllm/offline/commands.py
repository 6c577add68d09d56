"""The command of an offline case: `vllm bench throughput|latency` with the suite's engine
arguments (rendered by the same registry as `vllm serve`'s) and its benchmark options, or the
simulator's stand-in with the same arguments.

vLLM runs through `engine/in_vllm/bench.py` (vLLM's own subcommand parsers and mains, see there), by
file path with `python -P`, so the vLLM environment needs nothing of ours.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_profllm.engine.choice import EngineName
from pytest_profllm.engine.command import serve_args, serve_env
from pytest_profllm.engine.in_vllm import BENCH_SCRIPT
from pytest_profllm.engine.registry import bundled
from pytest_profllm.engine.secrets import env_secrets
from pytest_profllm.plan.suite import LatencyConfig, OfflineConfig, ThroughputConfig

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry

# `vllm bench throughput|latency` builds an engine, not an HTTP server: options of `vllm serve`
# outside EngineArgs (these registry groups) do not exist there and are left out.
_SERVE_ONLY_GROUPS = frozenset({"Frontend", "options"})


def offline_command(
    engine: EngineName,
    bench: OfflineConfig,
    server: dict[str, Any],
    output_json: Path,
    registry: Registry | None = None,
    python: str | None = None,
) -> list[str]:
    """The full argv; `python` is the one that imports vLLM (default: this one)."""
    if engine == "vllm":
        head = [python or sys.executable, "-P", str(BENCH_SCRIPT), bench.kind]
    else:
        head = [sys.executable, "-m", "pytest_profllm.sim.offline", bench.kind]
    return head + engine_args(server, registry) + bench_args(bench) + [
        "--output-json",
        str(output_json),
    ]


def offline_env(server: dict[str, Any]) -> dict[str, str]:
    """Secrets vLLM reads from its environment (HF_TOKEN), as for a server."""
    return serve_env(server)


def engine_args(server: dict[str, Any], registry: Registry | None = None) -> list[str]:
    """`--model MODEL` and the engine options (the benchmarks take no positional model)."""

    options = (registry or bundled()).options
    moved = set(env_secrets(server))  # they travel in the environment (offline_env)
    kept = {
        key: value
        for key, value in server.items()
        if key not in moved
        and not (key in options and options[key].group in _SERVE_ONLY_GROUPS)
    }
    args = serve_args(kept, registry)
    return ["--model", *args]


def serve_only_args(server: dict[str, Any], registry: Registry | None = None) -> list[str]:
    """The server's options an offline command leaves out (shown by `profllm plan`)."""

    options = (registry or bundled()).options
    return [key for key in server if key in options and options[key].group in _SERVE_ONLY_GROUPS]


def bench_args(bench: OfflineConfig) -> list[str]:
    if isinstance(bench, ThroughputConfig):
        return _throughput_args(bench)
    return _latency_args(bench)


def _throughput_args(bench: ThroughputConfig) -> list[str]:
    args = ["--backend", bench.backend, "--dataset-name", bench.dataset_name]
    if bench.dataset_path:
        args += ["--dataset-path", bench.dataset_path]
    if bench.dataset_name == "random":
        # vLLM 0.33.0 reads the random dataset's lengths from --random-* only (its --input-len
        # and --output-len lose to their --random-* defaults): the flags it really reads.
        args += ["--random-input-len", str(bench.input_len)]
        if bench.output_len is not None:
            args += ["--random-output-len", str(bench.output_len)]
        args += ["--random-prefix-len", str(bench.prefix_len)]
        args += ["--random-range-ratio", _number(bench.random_range_ratio)]
    elif bench.dataset_name == "prefix_repetition":
        for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len"):
            flag = f"--prefix-repetition-{name.replace('_', '-')}"
            args += [flag, str(getattr(bench, f"prefix_repetition_{name}"))]
    elif bench.output_len is not None:
        args += ["--output-len", str(bench.output_len)]
    args += ["--num-prompts", str(bench.num_prompts), "--n", str(bench.n)]
    args += _flags(bench, ("async_engine", "disable_detokenize"))
    return args


def _latency_args(bench: LatencyConfig) -> list[str]:
    args = []
    for name in ("batch_size", "input_len", "output_len", "n", "num_iters_warmup", "num_iters"):
        args += [f"--{name.replace('_', '-')}", str(getattr(bench, name))]
    return args + _flags(bench, ("use_beam_search", "disable_detokenize"))


def _flags(bench: OfflineConfig, names: tuple[str, ...]) -> list[str]:
    return [f"--{name.replace('_', '-')}" for name in names if getattr(bench, name)]


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)
