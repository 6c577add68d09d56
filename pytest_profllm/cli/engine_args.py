"""`profllm engine-args`: the registry of vLLM engine arguments, listed or regenerated from a
vLLM (engine/registry.py)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pytest_profllm.cli.errors import CliError
from pytest_profllm.engine.registry import DATA_FILE, Registry, RegistryError, bundled, generate
from pytest_profllm.hosts.files import write_atomic


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    engine_args = commands.add_parser(
        "engine-args",
        help="the registry of vLLM engine arguments: list it, or regenerate it from a vLLM",
        description="Without --python: summarise (or --list) the registry shipped with the "
        "package. With --python: read every `vllm serve` option from the parser of the vLLM "
        "that Python imports (VLLM_TARGET_DEVICE=cpu unless set), and write the registry file.",
    )
    engine_args.add_argument(
        "--python",
        metavar="PY",
        help="a Python that imports vLLM, e.g. /path/to/venv/bin/python (default: none; "
        "the bundled registry is shown)",
    )
    engine_args.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="PATH",
        help="where --python writes the registry (default: the package's own "
        "pytest_profllm/engine/data/engine_args.json)",
    )
    engine_args.add_argument(
        "--list", action="store_true", help="print one line per option instead"
    )
    engine_args.set_defaults(handler=_engine_args)


def _engine_args(args: argparse.Namespace) -> int:
    try:
        if args.python is None:
            if args.output is not None:
                raise CliError("--output needs --python (the vLLM to read the options from)")
            registry = bundled()
            where = f"bundled: {DATA_FILE}"
        else:
            env = {} if "VLLM_TARGET_DEVICE" in os.environ else {"VLLM_TARGET_DEVICE": "cpu"}
            data = generate(args.python, with_help=True, env=env)
            registry = Registry.from_json(data, "live")
            where = str(args.output or DATA_FILE)
            if not args.list:
                write_atomic(Path(where), (json.dumps(data, indent=1) + "\n").encode())
    except RegistryError as error:
        raise CliError(str(error)) from None
    if args.list:
        for option in registry.options.values():
            default = json.dumps(option.default)
            default = default if len(default) <= 40 else default[:37] + "..."
            print(f"{option.name}\t{option.kind}\t{option.group}\t{default}")
        return 0
    verb = "wrote" if args.python else "has"
    print(f"{len(registry)} engine arguments of vLLM {registry.vllm_version} ({verb} {where})")
    return 0
