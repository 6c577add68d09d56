"""Secrets: which engine arguments are secret, how they are shown (`***`) wherever we write or
print them, and which of them travel in a server's environment instead of its argv."""

from __future__ import annotations

import re
from typing import Any

from pytest_profllm.engine.registry import RegistryError, bundled

REDACTED = "***"
# Values of these arguments are passed to the server but never written anywhere we write.
_SECRET = re.compile(r"(^|_)(api_key|token|secret|password)$")


def is_secret(name: str) -> bool:
    """A secret by its name (api_key, ..._token, ...) or because vLLM never logs it."""
    name = name.replace("-", "_").lower()
    if _SECRET.search(name):
        return True
    try:
        return name in bundled().secret_names
    except RegistryError:
        return False


class Secret(str):
    """A secret string (an API key, a bearer header): its value wherever it is used (an
    f-string, a header), `***` in its repr. pytest prints the reprs of locals (`-l`) and of
    the arguments in a traceback, to the terminal and into JUnit XML."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(REDACTED)


def bearer(api_key: str | None) -> dict[str, str]:
    """The `Authorization` header that carries `api_key` (none without one), its value a
    Secret."""
    return {"Authorization": Secret(f"Bearer {api_key}")} if api_key else {}


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
    # An empty secret (a variable cleared on purpose) hides nothing.
    return {key: REDACTED if is_secret(key) and value else value for key, value in env.items()}


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


ENV_SECRETS = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}


def env_secrets(server: dict[str, Any]) -> dict[str, str]:
    """The secrets of a server configuration that travel in its environment, by argument name."""
    found = {}
    for key in ENV_SECRETS:
        value = server.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # VLLM_API_KEY holds one key; several stay on the command line
        if isinstance(value, str):
            found[key] = value
    return found
