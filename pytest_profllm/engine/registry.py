"""The engine-argument registry: every option of `vllm serve`, as vLLM's own parser defines it.

The package ships the registry of one vLLM version (`data/engine_args.json`, written by
`in_vllm/dump_args.py` from the real parser; `profllm engine-args --python PY` writes it for
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
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    create_model,
)
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.in_vllm import DUMP_ARGS_SCRIPT
from pytest_profllm.engine.install import VllmInstall, own_distribution
from pytest_profllm.hosts.files import write_atomic

DATA_FILE = Path(__file__).parent / "data" / "engine_args.json"
_GENERATE_TIMEOUT_S = 600


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
    # A JSON argument's value as vLLM declares it (in_vllm.dump_args._type_of); None: unknown.
    value_type: Any = field(default=None, compare=False)

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
            value_type=data.get("value_type"),
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

    def takes_list(self, path: tuple[str, ...] = ()) -> bool:
        """Its one value is a list: several values (`--x a b`), or JSON that is a list
        (`--allowed-origins '["a"]'`); with `path`, the field at that path of a JSON mapping."""
        if not path and self.many:
            return True
        if self.kind not in ("json", "str_or_json"):
            return False
        if self.value_type is None:  # a registry without value types
            return not path and isinstance(self.default, list)
        return _is_list_type(_field_type(self.value_type, path))

    def axis(self, value: Any, path: tuple[str, ...] = ()) -> list[Any] | None:
        """The values of the axis `value` is, or None where it is one value. A list is an
        axis, except for an argument that takes a list: there a flat list is its value, and
        an axis of list values is a list of lists (where a plain item is a value of one:
        `[k1, [k2, k3]]` is one key, then two)."""
        if not isinstance(value, list):
            return None
        if not self.takes_list(path):
            return value
        if any(isinstance(item, list) for item in value):
            return value
        return None

    def check_field(self, path: tuple[str, ...], value: Any) -> Any:
        """A value for one field of this JSON argument, written `name.field: value` as
        vLLM's `--name.field value`; ValueError if the argument or the field refuses it."""
        if self.kind != "json":
            raise ValueError(
                f"{self.name} is not a JSON argument: it takes no dotted keys"
            )
        if self.config_fields is not None and path[0] not in self.config_fields:
            close = difflib.get_close_matches(path[0], self.config_fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"'{path[0]}' is not a field of {self.config_class}{hint}")
        if self.value_type is not None:
            _check_type(_field_type(self.value_type, path), value, self.config_class)
        return value

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
        """The value as vLLM's parser reads it (a number in quotes becomes the number), if
        this option takes it; ValueError saying what it takes if not."""
        if value is None:
            return value
        if self.many and isinstance(value, list):
            if not value:
                raise ValueError(f"takes one or more values ({self.flag} A B ...), not none")
            return [self._check_one(item) for item in value]
        return self._check_one(value)

    def _check_one(self, value: Any) -> Any:
        kind = self.kind
        if self.action == "LoRAParserAction":
            return _lora_module(value)
        if kind in ("flag", "bool"):
            if not isinstance(value, bool):
                raise ValueError("takes true or false")
            return value
        if kind == "str_or_true":
            if value is not True and not isinstance(value, str):
                raise ValueError("takes true or a string")
            return value
        if kind == "json":
            parsed = _json_value(value, self.takes_list())
            self._check_config_keys(parsed)
            if self.value_type is not None:
                _check_type(self.value_type, parsed, self.config_class)
            return value
        if kind == "str_or_json":
            if not isinstance(value, str | dict):
                raise ValueError("takes a string or a mapping")
            if isinstance(value, str) and value.lstrip().startswith("{"):
                _json_value(value)
            return value
        if kind == "int":
            number = self._int(value)
            if self.choices is not None and number not in self.choices:
                raise ValueError(f"takes one of {_listing(self.choices)}")
            return number
        if kind == "float":
            return _float(value)
        # str, and the few options of other types vLLM reads as text
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError("takes a string")
        if self.choices is not None and str(value) not in {str(c) for c in self.choices}:
            raise ValueError(f"takes one of {_listing(self.choices)}")
        return value

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

    def _int(self, value: Any) -> int | str:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if self.human_readable and isinstance(value, str):
            number = human_int(value, allow_auto=self.name == "max_model_len")
            if number is not None:
                # Digits in quotes are the number; a size is rendered as written (vLLM reads it).
                return number if value.strip().isdigit() else value
            raise ValueError("takes an integer, or a size like 8k, 32K or 1M")
        if isinstance(value, str):
            try:
                return int(value)  # as argparse's type=int reads it: "16", " 16", "1_000"
            except ValueError:
                pass
        raise ValueError("takes an integer")


def _float(value: Any) -> float | int:
    if isinstance(value, str):
        try:
            value = float(value)  # as argparse's type=float reads it
        except ValueError:
            raise ValueError("takes a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("takes a number")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError("takes a number, not NaN")
    return value


def _is_list_type(value_type: Any) -> bool:
    if isinstance(value_type, dict) and "union" in value_type:
        members = [member for member in value_type["union"] if member != "none"]
        return bool(members) and all(_is_list_type(member) for member in members)
    return isinstance(value_type, dict) and "list" in value_type


def _field_type(value_type: Any, path: tuple[str, ...]) -> Any:
    """The type at `path` inside a JSON argument's type ("any" where it is not known)."""
    for part in path:
        if isinstance(value_type, dict) and "union" in value_type:
            members = [m for m in value_type["union"] if m != "none"]
            value_type = members[0] if len(members) == 1 else "any"
        if isinstance(value_type, dict) and "config" in value_type:
            value_type = value_type["fields"].get(part, "any")
        elif isinstance(value_type, dict) and "dict" in value_type:
            value_type = value_type["dict"]
        else:
            return "any"
    return value_type


def _check_type(value_type: Any, value: Any, owner: str | None) -> None:
    """ValueError naming the first place where `value` is not of `value_type`, checked by
    pydantic in JSON mode as vLLM checks a config argument (`TypeAdapter(cls).validate_json`)."""
    if value_type == "any":
        return
    try:
        _adapter(json.dumps(value_type, sort_keys=True)).validate_json(json.dumps(value))
    except ValidationError as error:
        first = error.errors()[0]
        path = _path_in(value, first["loc"])
        where = ".".join(str(p) for p in path).replace(".[", "[")
        shown = f"{where}: " if where else ""
        if first["type"] == "extra_forbidden":
            keys = tuple(str(p) for p in path[:-1] if isinstance(p, str))
            inner = _field_type(value_type, keys)
            name = inner.get("config") if isinstance(inner, dict) else None
            raise ValueError(f"{shown}not a field of {name or owner or 'this mapping'}") from None
        # A value with no place inside it is quoted by the caller, as any other value is.
        got = f" (got {first.get('input')!r})" if path else ""
        raise ValueError(f"{shown}{first['msg']}{got}") from None
    except ValueError:
        return  # not JSON (the caller says so), or a value pydantic cannot compare


def _path_in(value: Any, loc: tuple[Any, ...]) -> list[str]:
    # pydantic's location also names union members and models; keep what indexes the value.
    parts: list[str] = []
    for part in loc:
        if isinstance(value, dict) and part in value:
            parts.append(str(part))
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            parts.append(f"[{part}]")
            value = value[part]
    return parts


@functools.cache
def _adapter(value_type_json: str) -> TypeAdapter[Any]:
    return TypeAdapter(_python_type(json.loads(value_type_json)))


def _python_type(value_type: Any) -> Any:
    """The Python type of a registry value type, for pydantic to check values against."""
    scalars: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str}
    if value_type == "none":
        return type(None)
    if isinstance(value_type, str):
        return scalars.get(value_type, Any)
    if not isinstance(value_type, dict):
        return Any
    if value_type.get("literal"):
        return Literal.__getitem__(tuple(value_type["literal"]))
    if "list" in value_type:
        return list[_python_type(value_type["list"])]  # type: ignore[misc]
    if "dict" in value_type:
        return dict[str, _python_type(value_type["dict"])]  # type: ignore[misc]
    if "union" in value_type:
        return Union.__getitem__(tuple(_python_type(m) for m in value_type["union"]))
    if "config" in value_type:
        # A TypedDict, not a model: field names like `json` or `model_x` are fine in it.
        members = {name: _python_type(kind) for name, kind in value_type["fields"].items()}
        make_typed_dict: Any = TypedDict
        typed = make_typed_dict(value_type["config"], members, total=False)
        typed.__pydantic_config__ = ConfigDict(extra="forbid")
        return typed
    return Any


def _json_value(value: Any, takes_list: bool = False) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            what = "a list" if takes_list else "a mapping"
            raise ValueError(f"takes {what}, or JSON text") from None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError("takes a mapping of JSON values") from None
    return value


# vLLM's LoRAModulePath (vllm/entrypoints/openai/models/protocol.py): what a mapping may hold.
_LORA_KEYS = ("name", "path", "base_model_name", "is_3d_lora_weight")


def _lora_module(value: Any) -> Any:
    """One `--lora-modules` adapter as vLLM's LoRAParserAction reads it: `name=path` (a text
    with `=` and no comma), else JSON of a mapping with a name and a path."""
    if isinstance(value, str) and "=" in value and "," not in value:
        name, path = value.split("=", 1)
        if not name or not path:
            raise ValueError(f"takes name=path, not {value!r}")
        return value
    mapping = value
    if isinstance(value, str):
        try:
            mapping = json.loads(value)
        except ValueError:
            raise ValueError(
                "takes name=path (no comma; vLLM reads a text with a comma as JSON) or a "
                "mapping {name: ..., path: ...}"
            ) from None
    if not isinstance(mapping, dict):
        raise ValueError("takes name=path or a mapping {name: ..., path: ...}")
    unknown = [key for key in mapping if key not in _LORA_KEYS]
    if unknown:
        raise ValueError(f"an adapter's keys are {', '.join(_LORA_KEYS)}, not {unknown[0]!r}")
    if not isinstance(mapping.get("name"), str) or not isinstance(mapping.get("path"), str):
        raise ValueError("an adapter mapping needs a name and a path (strings)")
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

    def resolve(self, key: str) -> tuple[Option, tuple[str, ...]] | None:
        """The option a suite key names, and the field path of a dotted key
        (`compilation_config.mode`, as vLLM's `--compilation-config.mode`); None if unknown."""
        name, *path = key.split(".")
        option = self.options.get(name)
        return None if option is None else (option, tuple(path))

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
    command = [python, str(DUMP_ARGS_SCRIPT), *(["--with-help"] if with_help else [])]
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
        raise RegistryError(f"{python}: cannot run {DUMP_ARGS_SCRIPT.name}: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RegistryError(f"{python} {DUMP_ARGS_SCRIPT.name} exited {done.returncode}: {last}")
    try:
        data: dict[str, Any] = json.loads(done.stdout)
    except ValueError as error:
        raise RegistryError(f"{DUMP_ARGS_SCRIPT.name} printed no JSON: {error}") from None
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
        python, version = sys.executable, own_distribution()[1] or "unknown"
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

