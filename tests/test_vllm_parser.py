"""Our argv against vLLM's own parser: every rendered `vllm serve` command must parse, under the
vLLM the registry was read from, to the values the suite asked for.

vLLM runs in a Python of its own, named by PROFLLM_VLLM_PYTHON (`.ci/run` builds a CPU-only one
with `.ci/vllm-env.sh parser`); without one these tests are skipped and say why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import PARSE_EACH_ARGV, needs_vllm_python, vllm_parse

from pytest_profllm.engine.command import serve_command, serve_env
from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.registry import Option, Registry, bundled
from pytest_profllm.plan.case import expand
from pytest_profllm.plan.suite import load_suite_file

ROOT = Path(__file__).parent.parent
SUITE = ROOT / "benchmarks" / "bench_engine_args.yaml"
# `vllm serve`'s own parser over each argv given on stdin, every value made plain JSON.
_PARSE = (
    """
import argparse, dataclasses, enum, json, sys
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

def plain(value):
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    dump = getattr(value, "model_dump", None)
    return plain(dump()) if callable(dump) else repr(value)

parser = make_arg_parser(FlexibleArgumentParser())
"""
    + PARSE_EACH_ARGV
)

pytestmark = [pytest.mark.vllm_python, needs_vllm_python]


def args_after_serve(server: dict[str, Any]) -> list[str]:
    argv = serve_command("vllm", server, "127.0.0.1", 20000)
    return argv[argv.index("serve") + 1 :]


def expected_value(option: Option, value: Any) -> Any:
    """What vLLM's namespace holds for a suite value of this option."""
    if option.many:
        items = value if isinstance(value, list) else [value]
        return [expected_item(option, item) for item in items]
    return expected_item(option, value)


def expected_item(option: Option, value: Any) -> Any:
    if option.kind == "int" and isinstance(value, str):
        return human_int(value, allow_auto=True)
    if option.kind == "float":
        return float(value)
    if option.kind == "str" and not isinstance(value, bool | dict):
        return str(value)
    if option.kind in ("json", "str_or_json") and isinstance(value, str):
        return json.loads(value) if value.lstrip().startswith(("{", "[")) else value
    return value


def contains(parsed: Any, expected: Any) -> bool:
    """Equal, except that a parsed config may hold more keys than the suite gave."""
    if isinstance(expected, dict):
        return isinstance(parsed, dict) and all(
            key in parsed and contains(parsed[key], item) for key, item in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(parsed, list)
            and len(parsed) == len(expected)
            and all(contains(p, e) for p, e in zip(parsed, expected, strict=True))
        )
    return bool(parsed == expected)


def check_parsed(registry: Registry, server: dict[str, Any], parsed: dict[str, Any]) -> None:
    env = serve_env(server)
    assert parsed["model_tag"] == server["model"]
    for name, value in server.items():
        if name == "model" or value is None:
            continue
        option = registry.options[name]
        if name in ("api_key", "hf_token") and isinstance(value, str | list) and env:
            # Travelled in the environment, not argv: vLLM's parse has the default.
            assert parsed[name] == option.default
            continue
        want = expected_value(option, value)
        got = parsed[name]
        assert contains(got, want), f"{name}: suite {value!r}, vLLM parsed {got!r}"


def test_the_engine_args_suite_parses_to_its_values() -> None:
    registry = bundled()
    suite, lines = load_suite_file(SUITE, registry)
    cases = expand(suite, str(SUITE), lines)
    servers = {case.server_key: case.server for case in cases}
    # One server, one case: its list values (served_model_name, ...) are values, not axes.
    assert (len(servers), len(cases)) == (1, 1)
    given = {name for server in servers.values() for name in server} - {"model"}
    assert len(given) >= 40, f"the suite uses {len(given)} engine arguments, not 40 or more"
    kinds = {registry.options[name].kind for name in given}
    assert {"bool", "flag", "int", "float", "str", "json"} <= kinds
    parsed = vllm_parse(_PARSE, [args_after_serve(server) for server in servers.values()])
    for server, namespace in zip(servers.values(), parsed, strict=True):
        check_parsed(registry, server, namespace)
    # The secret reached the server through its environment, never its command line.
    [server] = servers.values()
    assert serve_env(server)["VLLM_API_KEY"] == server["api_key"]
    assert server["api_key"] not in " ".join(args_after_serve(server))


def servers_of(tmp_path: Path, text: str) -> list[dict[str, Any]]:
    path = tmp_path / "bench_lists.yaml"
    path.write_text(text)
    suite, lines = load_suite_file(path, bundled())
    return list({c.server_key: c.server for c in expand(suite, str(path), lines)}.values())


def test_plain_yaml_lists_reach_vllm_as_the_lists_asked_for(tmp_path: Path) -> None:
    [server] = servers_of(
        tmp_path,
        "server:\n"
        "  model: m\n"
        "  cudagraph_capture_sizes: [1, 2, 4, 8]\n"
        '  allowed_origins: ["http://localhost"]\n'
        "  served_model_name: [a, b]\n"
        '  max_num_seqs: "16"\n'
        "  compilation_config.mode: 3\n"
        "  compilation_config.cudagraph_capture_sizes: [1, 2]\n",
    )
    [parsed] = vllm_parse(_PARSE, [args_after_serve(server)])
    assert parsed["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    assert parsed["allowed_origins"] == ["http://localhost"]
    assert parsed["served_model_name"] == ["a", "b"]
    assert parsed["max_num_seqs"] == 16
    assert contains(parsed["compilation_config"], {"mode": 3, "cudagraph_capture_sizes": [1, 2]})
    check_parsed(bundled(), server, parsed)


def test_an_axis_of_list_values_is_a_list_of_lists(tmp_path: Path) -> None:
    servers = servers_of(
        tmp_path, "server:\n  model: m\n  cudagraph_capture_sizes: [[1, 2], [1, 2, 4, 8]]\n"
    )
    assert len(servers) == 2
    parsed = vllm_parse(_PARSE, [args_after_serve(server) for server in servers])
    assert [p["cudagraph_capture_sizes"] for p in parsed] == [[1, 2], [1, 2, 4, 8]]


CONFIG_VALUES = [
    ("compilation_config", {"cudagraph_capture_sizes": [1, 2, 4, 8]}),
    ("compilation_config", {"cudagraph_capture_sizes": ["1", 2]}),  # lax, as vLLM's pydantic
    ("compilation_config", {"cudagraph_capture_sizes": [1, "x"]}),
    ("compilation_config", {"cudagraph_capture_sizes": 8}),
    ("compilation_config", {"compile_mm_encoder": "maybe"}),
    ("compilation_config", {"dynamic_shapes_config": {"type": "unbacked"}}),
    ("compilation_config", {"dynamic_shapes_config": {"type": "sideways"}}),
    ("compilation_config", {"dynamic_shapes_config": {"typo": 1}}),
    ("compilation_config", {"level": 3}),
    ("structured_outputs_config", {"backend": "guidance"}),
    ("structured_outputs_config", {"backend": "nope"}),
    ("kv_events_config", {"enable_kv_cache_events": "yes"}),
    ("kv_events_config", {"enable_kv_cache_events": [True]}),
]


def test_config_type_checks_agree_with_vllms_parser() -> None:
    # Where the registry knows a config's field types, a suite value is refused exactly when
    # vLLM's parser refuses it.
    registry = bundled()
    argvs, ours = [], []
    for name, value in CONFIG_VALUES:
        argvs.append(args_after_serve({"model": "m", name: value}))
        try:
            registry.options[name].check(value)
            ours.append("accepted")
        except ValueError:
            ours.append("refused")
    results = vllm_parse(_PARSE, argvs, refusals=True)
    theirs = ["refused" if "error" in result else "accepted" for result in results]
    assert list(zip(CONFIG_VALUES, ours, strict=True)) == list(
        zip(CONFIG_VALUES, theirs, strict=True)
    )


def _sample_values(option: Option) -> list[Any]:
    """Values to try for an option: its default (where vLLM's parser could read it back),
    both booleans, and every choice."""
    if option.kind in ("flag", "bool"):
        return [True, False]
    if option.choices is not None:
        return [choice for choice in option.choices if choice is not None]
    if option.default is None or option.default_note is not None:
        return []
    if option.kind == "json" and option.config_class is not None:
        return []  # a config's full default holds fields its constructor does not take
    if option.many and option.default == []:
        return []
    return [option.default]


def test_every_option_renders_to_what_vllm_parses() -> None:
    # Each option of the registry, one value at a time, through our rendering and vLLM's parser.
    registry = bundled()
    servers = []
    for option in registry.options.values():
        if option.name in ("model", "host", "port", "config") or option.secret:
            continue
        for value in _sample_values(option):
            servers.append({"model": "m", option.name: value})
    assert len(servers) > 300
    parsed = vllm_parse(_PARSE, [args_after_serve(server) for server in servers])
    for server, namespace in zip(servers, parsed, strict=True):
        check_parsed(registry, server, namespace)


def test_vllm_refuses_an_unknown_option_and_a_stale_config_key() -> None:
    # What the registry cannot check (keys inside a config) vLLM's parser does: 0.33.0 has
    # no `level` in CompilationConfig (it is `mode`). Unknown options fail in both.
    stale = ["m", "--compilation-config", '{"level":3}']
    results = vllm_parse(_PARSE, [["m", "--max-num-seqz", "4"], stale], refusals=True)
    assert results[0] == {"error": "exit 2"}
    assert results[1] == {"error": "exit 2"}


def test_lora_arguments_reach_vllm_as_the_adapters_asked_for(tmp_path: Path) -> None:
    # Both forms of an adapter (name=path, and a mapping vLLM reads as JSON) in one list, with
    # the slots and rank: vLLM's LoRAParserAction reads each as the adapter given.
    [server] = servers_of(
        tmp_path,
        "server:\n"
        "  model: m\n"
        "  enable_lora: true\n"
        "  lora_modules: [sql=/adapters/sql, {name: chat, path: /adapters/chat, "
        "base_model_name: m}]\n"
        "  max_loras: 3\n"
        "  max_lora_rank: 32\n",
    )
    [parsed] = vllm_parse(_PARSE, [args_after_serve(server)])
    assert parsed["enable_lora"] is True
    assert (parsed["max_loras"], parsed["max_lora_rank"]) == (3, 32)
    assert [(m["name"], m["path"], m["base_model_name"]) for m in parsed["lora_modules"]] == [
        ("sql", "/adapters/sql", None), ("chat", "/adapters/chat", "m")
    ]
