"""Describe every option of `vllm serve` as JSON, read from vLLM's own argument parser.

A standalone script (standard library and vLLM only), so that any Python that has vLLM can run
it, with or without pytest-profllm installed:

    VLLM_TARGET_DEVICE=cpu /path/to/venv/bin/python dump_args.py [--with-help] > out.json

`profllm engine-args --python PATH` runs it to regenerate the registry bundled with the package;
the plugin runs it with its own Python where vLLM is importable (the live registry).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import importlib.util
import json
import math
import sys
import types
import typing
from pathlib import Path, PurePath
from typing import Any

FORMAT = 1


def main(argv: list[str]) -> int:
    with_help = "--with-help" in argv
    if with_help:
        # vLLM collects the attribute docs that make up the help text only when it sees
        # --help among the process arguments as arg_utils is imported.
        sys.argv = [sys.argv[0], "--help"]
    # vLLM is imported after sys.argv is set (see above).
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser_module = importlib.import_module(_parser_module())
    make_arg_parser = parser_module.make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
    secret = _sensitive_fields()
    field_types = _field_types(parser_module)
    deprecated = {id(action) for action in getattr(parser, "_deprecated", ())}
    options = []
    positional = None
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:
            positional = {"dest": action.dest, "nargs": action.nargs}
            continue
        entry = _describe(action, with_help, action.dest in secret, id(action) in deprecated)
        entry["value_type"] = _value_type(action, entry["kind"], field_types)
        options.append(entry)
    json.dump(
        {
            "format": FORMAT,
            "vllm_version": _vllm_version(),
            "parser": f"{parser_module.__name__}.make_arg_parser(FlexibleArgumentParser())",
            # --help counts as an option of `vllm serve --help`; it is no engine argument.
            "parser_option_count": sum(1 for a in parser._actions if a.option_strings),
            "positional": positional,
            "options": options,
        },
        sys.stdout,
        indent=1,
        sort_keys=False,
    )
    sys.stdout.write("\n")
    return 0


# Where `vllm serve`'s parser lives: vLLM 0.33.0, then 0.32.0 (the CPU build on PyPI).
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")


def _parser_module() -> str:
    for module in PARSER_MODULES:
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except ImportError:
            continue
    raise SystemExit(f"no vllm serve parser in this vLLM (looked in {', '.join(PARSER_MODULES)})")


def _vllm_version() -> str:
    # The sibling script's answer, loaded by its path: both run in vLLM's Python, outside the
    # package, with only the standard library and vLLM.
    spec = importlib.util.spec_from_file_location(
        "profllm_vllm_probe", Path(__file__).with_name("probe.py")
    )
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    version: str | None = probe.installed_vllm()[1]
    return version or "unknown"


def _sensitive_fields() -> frozenset[str]:
    # vLLM keeps the arguments it never logs verbatim in this set (0.33.0); older versions lack it.
    try:
        # This script runs in vLLM's own Python; vLLM is imported only here, when needed.
        from vllm.entrypoints.common import startup
    except ImportError:
        return frozenset()
    return frozenset(getattr(startup, "_SENSITIVE_ARG_FIELDS", ()))


def _describe(
    action: argparse.Action, with_help: bool, secret: bool, deprecated: bool
) -> dict[str, Any]:
    # Boolean actions keep their negative forms here (vLLM hides `--no-x` from help where a
    # `--disable-x` pairs with `--enable-x`, yet its parser still takes both).
    negative = sorted(getattr(action, "negative_option_strings", ()) or ())
    long_flags = [flag for flag in action.option_strings if flag.startswith("--")]
    positive = [flag for flag in long_flags if flag not in negative]
    chain = _type_chain(action.type)
    names = [name for name, _ in chain]
    config_class = next((arg for name, arg in chain if name == "parse_dataclass"), None)
    config_fields = _config_fields(action.type) if config_class else None
    default, note = _json_default(action.default)
    kind = _kind(action, names)
    choices = None
    if action.choices is not None:
        choices = [_json_default(choice)[0] for choice in action.choices]
    entry: dict[str, Any] = {
        "name": action.dest,
        "flag": (positive or long_flags or action.option_strings)[0],
        "aliases": [flag for flag in action.option_strings if flag not in positive[:1] + negative],
        "negative_flags": negative,
        "dest": action.dest,
        "group": getattr(getattr(action, "container", None), "title", None),
        "action": type(action).__name__.lstrip("_"),
        "kind": kind,
        "nargs": action.nargs if action.nargs not in (0,) else None,
        "const": _json_default(action.const)[0],
        "choices": choices,
        "accepts_none": "_optional_type" in names or (choices is not None and None in choices),
        "human_readable": any(name.startswith("human_readable_int") for name in names),
        "json": kind in ("json", "str_or_json"),
        "config_class": config_class,
        # The keys its JSON may hold, where vLLM refuses any other (pydantic extra="forbid").
        "config_fields": config_fields,
        "type_chain": [f"{name}[{arg}]" if arg else name for name, arg in chain],
        "default": default,
        "default_note": note,
        "secret": secret,
        "deprecated": deprecated,
        "help": (action.help or "") if with_help else "",
    }
    return entry


def _config_fields(function: Any) -> list[str] | None:
    while function is not None and getattr(function, "__name__", "") != "parse_dataclass":
        cells = [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]
        inner = [value for value in cells if callable(value)]
        function = inner[0] if inner else None
    cls = (getattr(function, "__defaults__", None) or (None,))[0]
    config = getattr(cls, "__pydantic_config__", None) or {}
    if cls is None or not dataclasses.is_dataclass(cls) or config.get("extra") != "forbid":
        return None
    return [field.name for field in dataclasses.fields(cls) if field.init]


def _value_type(
    action: argparse.Action, kind: str, field_types: dict[str, Any]
) -> Any:
    """What a JSON argument's value is, as vLLM's classes declare it (see `_type_of`): the
    config class its parser validates against, else the field's annotation. None for
    arguments whose command-line kind already says it all."""
    if kind not in ("json", "str_or_json"):
        return None
    cls = _config_class(action.type)
    if cls is not None:
        return _type_of(cls, 0)
    if action.dest in field_types:
        return _type_of(field_types[action.dest], 0)
    return "any"


def _field_types(parser_module: types.ModuleType) -> dict[str, Any]:
    # The dataclasses `make_arg_parser` builds the options from (frontend first, as it does);
    # FrontendArgs lives beside the parser, wherever this vLLM keeps it.
    from vllm.engine.arg_utils import AsyncEngineArgs

    frontend = getattr(parser_module, "FrontendArgs", None)
    found: dict[str, Any] = {}
    for cls in (frontend, AsyncEngineArgs):
        if cls is None:
            continue
        for name, annotation in _annotations(cls).items():
            found.setdefault(name, annotation)
    return found


def _annotations(cls: Any) -> dict[str, Any]:
    """Each init field's type, resolved one at a time (a field whose forward reference does
    not resolve is left out: it is read as any value)."""
    namespace: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        namespace.update(vars(sys.modules.get(klass.__module__, types.ModuleType("x"))))
    resolved = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        annotation = field.type
        if isinstance(annotation, str):
            try:
                # vLLM's own annotations, in its own modules' namespace
                annotation = eval(annotation, namespace)
            except Exception:
                continue
        resolved[field.name] = annotation
    return resolved


_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", type(None): "none"}


def _type_of(annotation: Any, depth: int) -> Any:
    """A JSON description of a type, precise only where pydantic would check it as written:
    "int", "float", "bool", "str", "none", "any", {"literal": [...]}, {"list": T},
    {"dict": T} (string keys), {"union": [T, ...]}, and {"config": NAME, "fields": {...}}
    for a config dataclass that refuses unknown keys. A field with a validator that runs
    before pydantic's own check (it may accept other forms) is "any"."""
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if annotation is typing.Any or depth > 4:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "str"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"literal": [_to_json(member.value) for member in annotation]}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_of(args[0], depth)
    if origin is typing.Literal:
        return {"literal": [_to_json(value) for value in args]}
    if origin in (typing.Union, types.UnionType):
        members = [_type_of(arg, depth) for arg in args]
        return "any" if "any" in members else {"union": members}
    if annotation in (list, set, frozenset, tuple) or origin in (list, set, frozenset):
        return {"list": _type_of(args[0], depth + 1) if args else "any"}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"list": _type_of(args[0], depth + 1)}
        return "any"
    if annotation is dict or origin is dict:
        return {"dict": _type_of(args[1], depth + 1) if len(args) == 2 else "any"}
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _config_type(annotation, depth)
    return "any"


def _config_type(cls: type, depth: int) -> Any:
    config = getattr(cls, "__pydantic_config__", None) or {}
    decorators = getattr(cls, "__pydantic_decorators__", None)
    if config.get("extra") != "forbid" or decorators is None:
        return "any"
    if any(d.info.mode != "after" for d in decorators.model_validators.values()):
        return "any"
    unchecked = {
        name
        for d in decorators.field_validators.values()
        if d.info.mode != "after"
        for name in d.info.fields
    }
    annotations = _annotations(cls)
    fields = {
        field.name: "any"
        if field.name in unchecked or field.name not in annotations
        else _type_of(annotations[field.name], depth + 1)
        for field in dataclasses.fields(cls)
        if field.init
    }
    return {"config": cls.__name__, "fields": fields}


def _config_class(function: Any) -> Any:
    while function is not None and getattr(function, "__name__", "") != "parse_dataclass":
        cells = [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]
        inner = [value for value in cells if callable(value)]
        function = inner[0] if inner else None
    return (getattr(function, "__defaults__", None) or (None,))[0]


def _type_chain(function: Any) -> list[tuple[str, str | None]]:
    """The names of a type function and of those it wraps (vLLM nests them in closures)."""
    chain: list[tuple[str, str | None]] = []
    while function is not None and len(chain) < 8:
        name = getattr(function, "__name__", type(function).__name__)
        if name == "parse_dataclass":
            cls = (function.__defaults__ or (None,))[0]
            chain.append((name, getattr(cls, "__name__", None)))
            break
        chain.append((name, None))
        cells = [cell.cell_contents for cell in getattr(function, "__closure__", None) or ()]
        inner = [value for value in cells if callable(value)]
        function = inner[0] if inner else None
    return chain


def _kind(action: argparse.Action, names: list[str]) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"  # --x and --no-x
    if action.nargs == 0:
        return "flag"  # --x only
    if action.nargs == "?" and action.const is True:
        return "str_or_true"  # a bare flag means True, a value is a string (hf_token)
    if "parse_dataclass" in names or "loads" in names:
        return "json"
    if "union_dict_and_str" in names:
        return "str_or_json"
    for name in names:
        if name.startswith("human_readable_int") or name == "int":
            return "int"
        if name == "float":
            return "float"
    if action.choices is not None:
        kinds = {type(c).__name__ for c in action.choices if c is not None}
        if kinds == {"int"}:
            return "int"
    return "str"


def _json_default(value: Any) -> tuple[Any, str | None]:
    """A JSON form of a default, and a note saying how it was made where it is not exact."""
    if value is argparse.SUPPRESS:
        return None, "not set unless given (argparse.SUPPRESS)"
    converted = _to_json(value)
    try:
        json.dumps(converted, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value), f"repr of a {type(value).__name__} (not JSON-serialisable)"
    if converted is value or (type(value) in (list, dict) and converted == value):
        return converted, None
    return converted, f"converted from {type(value).__name__}"


def _to_json(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return _to_json(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(key): _to_json(item) for key, item in value.items()}
    if isinstance(value, set | frozenset):
        return sorted((_to_json(item) for item in value), key=repr)
    if isinstance(value, list | tuple):
        return [_to_json(item) for item in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _to_json(dump(mode="json"))
    return repr(value)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
