"""Which engine serves the benchmarks (real vLLM or the simulator), and the command that starts it.

Both engines get the same `vllm serve` argv, rendered from the suite's snake_case engine
arguments, so a suite written on a laptop runs unchanged on a GPU host.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pytest_profllm.engine_args import Registry

EngineName = Literal["vllm", "sim"]
ENGINE_CHOICES = ("auto", "vllm", "sim")
REDACTED = "***"
# Values of these arguments are passed to the server but never written anywhere we write.
_SECRET = re.compile(r"(^|_)(api_key|token|secret|password)$")


class EngineUnavailable(Exception):
    """The engine asked for cannot run on this host; the message says why."""


@dataclass(frozen=True)
class EngineChoice:
    name: EngineName
    reason: str
    version: str | None

    def as_record(self) -> dict[str, str | None]:
        return {"name": self.name, "reason": self.reason, "version": self.version}


def choose_engine(requested: str, gpu_count: int) -> EngineChoice:
    """`auto` takes vLLM where it is importable and a GPU is present, else the simulator."""
    vllm_version = _vllm_version()
    if requested == "sim":
        return EngineChoice("sim", "--profllm-engine sim", _own_version())
    if requested == "vllm":
        if vllm_version is None:
            raise EngineUnavailable(
                "--profllm-engine vllm: vLLM is not installed in this environment "
                "(pip install 'pytest-profllm[vllm]' on a GPU host)"
            )
        if gpu_count == 0:
            raise EngineUnavailable("--profllm-engine vllm: NVML reports no GPU on this host")
        return EngineChoice("vllm", "--profllm-engine vllm", vllm_version)
    if vllm_version is not None and gpu_count > 0:
        return EngineChoice(
            "vllm", f"auto: vLLM {vllm_version} and {gpu_count} GPU(s)", vllm_version
        )
    missing = "vLLM is not installed" if vllm_version is None else "no GPU found by NVML"
    return EngineChoice("sim", f"auto: {missing}, using the simulated engine", _own_version())


def _vllm_version() -> str | None:
    # find_spec does not import vLLM (seconds, and CUDA initialisation) just to look.
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _own_version() -> str:
    from pytest_profllm import __version__

    return __version__


def serve_command(
    engine: EngineName,
    server: dict[str, Any],
    host: str,
    port: int,
    registry: Registry | None = None,
    sim_device: str | None = None,
) -> list[str]:
    """The full command: `vllm serve MODEL --flag value ...` or the simulator with the same argv
    (and its own `--sim-device` when one is chosen).

    Secrets that vLLM also reads from its environment are left out: see `serve_env`.
    """
    if engine == "vllm":
        head = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    else:
        head = [sys.executable, "-m", "pytest_profllm.sim"]
    in_argv = {key: value for key, value in server.items() if key not in _env_secrets(server)}
    own = ["--sim-device", sim_device] if engine == "sim" and sim_device else []
    return head + serve_args(in_argv, registry) + own + ["--host", host, "--port", str(port)]


def serve_env(server: dict[str, Any]) -> dict[str, str]:
    """The secrets a server takes from its environment rather than its argv.

    vLLM writes its argv into its log; `api_key` (one key) and a string `hf_token` travel as
    VLLM_API_KEY and HF_TOKEN instead, which vLLM 0.33.0 and the Hugging Face hub read.
    """
    return {_ENV_SECRETS[key]: value for key, value in _env_secrets(server).items()}


_ENV_SECRETS = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}


def _env_secrets(server: dict[str, Any]) -> dict[str, str]:
    found = {}
    for key in _ENV_SECRETS:
        value = server.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # VLLM_API_KEY holds one key; several stay on the command line
        if isinstance(value, str):
            found[key] = value
    return found


def serve_args(server: dict[str, Any], registry: Registry | None = None) -> list[str]:
    """Engine arguments as vLLM's parser takes them: the model first, then its options.

    Each value is written as its option's kind asks (registry): True and False become `--flag`
    and `--no-flag`, mappings JSON, several values follow one flag (or repeat it for
    `--middleware`-like options). None writes nothing: vLLM's default stands.
    """
    from pytest_profllm.engine_args import bundled

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


def is_secret(name: str) -> bool:
    """A secret by its name (api_key, ..._token, ...) or because vLLM never logs it."""
    from pytest_profllm.engine_args import RegistryError, bundled

    name = name.replace("-", "_").lower()
    if _SECRET.search(name):
        return True
    try:
        return name in bundled().secret_names
    except RegistryError:
        return False


def redact(server: dict[str, Any]) -> dict[str, Any]:
    return {
        key: REDACTED if is_secret(key) and value is not None else value
        for key, value in server.items()
    }


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {key: REDACTED if is_secret(key) else value for key, value in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """Every value after a secret flag, up to the next flag, becomes `***`."""
    shown = []
    hiding = False
    for token in argv:
        if token.startswith("--"):
            hiding = is_secret(token[2:].split("=", 1)[0])
            if hiding and "=" in token:
                token = token.split("=", 1)[0] + "=" + REDACTED
                hiding = False
            shown.append(token)
        else:
            shown.append(REDACTED if hiding else token)
    return shown
