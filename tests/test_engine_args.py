"""The engine-argument registry: what it holds, how values render and are checked, the live
registry's cache, `profllm engine-args`, and the typed `server:` block of a suite."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.cli.main import main
from pytest_profllm.engine import registry
from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.in_vllm import DUMP_ARGS_SCRIPT
from pytest_profllm.engine.registry import DATA_FILE, Registry, bundled, registry_for
from pytest_profllm.plan.suite import SuiteError, validate_suite

# --- the bundled registry -----------------------------------------------------------------


def test_bundled_registry_is_vllm_0_33_0_with_every_serve_option() -> None:
    registry = bundled()
    data = json.loads(DATA_FILE.read_text())
    assert registry.vllm_version == "0.33.0"
    # `vllm serve` has 321 options; --help is no engine argument.
    assert data["parser_option_count"] == 321
    assert len(registry) == 320
    assert registry.positional == "model_tag"
    assert {"model", "max_num_seqs", "compilation_config", "api_key"} <= set(registry.options)


def test_options_carry_kind_group_default_and_help() -> None:
    options = bundled().options
    seqs = options["max_num_seqs"]
    assert (seqs.kind, seqs.group, seqs.flag) == ("int", "SchedulerConfig", "--max-num-seqs")
    assert "sequences" in seqs.help
    assert options["gpu_memory_utilization"].default == 0.92
    assert options["dtype"].choices == ("auto", "bfloat16", "float", "float16", "float32", "half")
    assert options["enable_prefix_caching"].negative_flags == (
        "--disable-prefix-caching", "--no-enable-prefix-caching",
    )
    assert options["compilation_config"].config_class == "CompilationConfig"
    assert "mode" in (options["compilation_config"].config_fields or ())
    assert options["speculative_config"].config_fields is None  # plain JSON: any keys
    assert options["speculative_config"].kind == "json"
    assert options["served_model_name"].nargs == "+"
    assert options["max_num_batched_tokens"].human_readable


def test_every_default_is_json_and_converted_ones_say_so() -> None:
    data = json.loads(DATA_FILE.read_text())
    json.dumps([entry["default"] for entry in data["options"]], allow_nan=False)
    notes = {entry["name"]: entry["default_note"] for entry in data["options"]}
    assert notes["compilation_config"] == "converted from CompilationConfig"
    assert notes["cpu_offload_params"] == "converted from set"
    assert notes["max_num_seqs"] is None


def test_vllm_marks_its_own_secrets() -> None:
    assert bundled().secret_names == {"api_key", "hf_token", "watermark_config"}


def test_defaults_and_complete() -> None:
    registry = bundled()
    full = registry.complete({"model": "m", "max_num_seqs": 8})
    assert list(full) == list(registry.options)
    assert (full["model"], full["max_num_seqs"], full["seed"]) == ("m", 8, 0)


# --- rendering ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "tokens"),
    [
        ("enable_prefix_caching", True, ["--enable-prefix-caching"]),
        ("enable_prefix_caching", False, ["--no-enable-prefix-caching"]),
        ("headless", True, ["--headless"]),  # store-true: no --no- form
        ("headless", False, []),
        ("hf_token", True, ["--hf-token"]),
        ("hf_token", "hf_x", ["--hf-token", "hf_x"]),
        ("max_num_batched_tokens", "8k", ["--max-num-batched-tokens", "8k"]),
        ("seed", -1, ["--seed=-1"]),  # a value that looks like an option is attached
        ("middleware", ["a.M", "b.M"], ["--middleware", "a.M", "--middleware", "b.M"]),
        ("served_model_name", "one", ["--served-model-name", "one"]),
        ("allowed_origins", ["http://x"], ["--allowed-origins", '["http://x"]']),
        ("compilation_config", {"mode": 3}, ["--compilation-config", '{"mode":3}']),
        ("compilation_config", '{"mode": 3}', ["--compilation-config", '{"mode": 3}']),
        ("optimization_level", 3, ["--optimization-level", "3"]),
        ("max_model_len", None, []),
    ],
)
def test_render(name: str, value: Any, tokens: list[str]) -> None:
    assert bundled().options[name].render(value) == tokens


@pytest.mark.parametrize(
    ("text", "number"),
    [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("1M", 2**20), ("x", None)],
)
def test_human_int(text: str, number: int | None) -> None:
    assert human_int(text) == number


def test_human_int_auto_only_where_allowed() -> None:
    assert human_int("auto", allow_auto=True) == -1
    assert human_int("auto") is None


# --- checking values (the typed server block) ---------------------------------------------


def problem(server: dict[str, Any]) -> str:
    with pytest.raises(SuiteError) as error:
        validate_suite({"server": {"model": "m", **server}}, "bench_x.yaml", {})
    return str(error.value)


def test_unknown_argument_names_the_nearest_one() -> None:
    assert problem({"max_num_seq": 4}) == (
        "bench_x.yaml: server.max_num_seq: unknown engine argument of vLLM 0.33.0 "
        "(did you mean 'max_num_seqs'?)"
    )


def test_unknown_argument_without_a_near_one_says_where_to_look() -> None:
    assert problem({"qqqzzz": 1}).endswith("(see `profllm engine-args --list` for all of them)")


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"dtype": "halfx"}, "server.dtype: takes one of 'auto', 'bfloat16', 'float', "
         "'float16', 'float32', 'half' (got 'halfx')"),
        ({"max_num_seqs": "many"}, "server.max_num_seqs: takes an integer (got 'many')"),
        ({"max_num_seqs": True}, "server.max_num_seqs: takes an integer (got True)"),
        ({"max_num_batched_tokens": "lots"},
         "server.max_num_batched_tokens: takes an integer, or a size like 8k, 32K or 1M"),
        ({"gpu_memory_utilization": "high"}, "server.gpu_memory_utilization: takes a number"),
        ({"enforce_eager": "yes"}, "server.enforce_eager: takes true or false (got 'yes')"),
        ({"compilation_config": "{mode: 3"}, "server.compilation_config: takes a mapping, or "
         "JSON text"),
        ({"served_model_name": [[]]}, "server.served_model_name[0]: takes one or more values"),
        # vLLM 0.33.0 refuses keys its config classes lack, like the old `level` (now `mode`).
        ({"compilation_config": {"level": 3}},
         "server.compilation_config: 'level' is not a field of CompilationConfig"),
        ({"compilation_config": '{"level": 3}'}, "'level' is not a field of CompilationConfig"),
        ({"attention_config": {"backnd": "FLASH_ATTN"}},
         "server.attention_config: 'backnd' is not a field of AttentionConfig "
         "(did you mean 'backend'?)"),
        ({"hf_token": False}, "server.hf_token: takes true or a string (got ***)"),
    ],
)
def test_bad_values(server: dict[str, Any], message: str) -> None:
    assert message in problem(server)


def test_a_bad_value_in_an_axis_points_at_its_line(tmp_path: Path) -> None:
    from pytest_profllm.plan.suite import load_suite_file

    path = tmp_path / "bench_axis.yaml"
    path.write_text("server:\n  model: m\n  max_num_seqs:\n    - 8\n    - lots\n")
    with pytest.raises(SuiteError) as error:
        load_suite_file(path)
    assert str(error.value) == f"{path}:5: server.max_num_seqs[1]: takes an integer (got 'lots')"


def test_good_values_of_every_kind_pass() -> None:
    suite = validate_suite(
        {
            "server": {
                "model": "m",
                "max_num_seqs": [8, 16],
                "max_num_batched_tokens": "8k",
                "max_model_len": "auto",
                "gpu_memory_utilization": 1,
                "enforce_eager": False,
                "headless": True,
                "dtype": "half",
                "compilation_config": {"mode": 3, "cudagraph_capture_sizes": [1, 2]},
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
                "served_model_name": [["a", "b"]],
                "lora_modules": [[{"name": "x", "path": "/p"}, "y=/q"]],
                "hf_token": True,
                "revision": 2,
                "pt_load_map_location": {"": "cuda:0"},
                "max_log_len": None,
            }
        },
        "marker",
    )
    assert suite.server["max_num_batched_tokens"] == "8k"  # kept as given: the key hashes it


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"max_num_batched_tokens": 16, "max_num_seqs": 64},
         "max_num_batched_tokens (16) must be at least max_num_seqs (64)"),
        ({"max_num_batched_tokens": "2k", "max_model_len": 4096, "enable_chunked_prefill": False},
         "max_num_batched_tokens (2000) is below max_model_len (4096) with "
         "enable_chunked_prefill false"),
        ({"max_num_active_seqs": 8, "max_num_seqs": 4},
         "max_num_active_seqs (8) must not exceed max_num_seqs (4)"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 4},
         "data_parallel_size_local (4) must not exceed data_parallel_size (2)"),
    ],
)
def test_cross_field_rules(server: dict[str, Any], message: str) -> None:
    assert message in problem(server)


def test_cross_field_rules_check_every_combination_of_axes() -> None:
    assert "must be at least max_num_seqs (256)" in problem(
        {"max_num_batched_tokens": [128, 4096], "max_num_seqs": [16, 256]}
    )


def test_cross_field_rules_leave_what_vllm_accepts() -> None:
    validate_suite(
        {"server": {"model": "m", "max_num_batched_tokens": "2k", "max_model_len": 4096}}, "m"
    )


# --- the live registry --------------------------------------------------------------------


@pytest.fixture
def fake_vllm_python(tmp_path: Path) -> Path:
    """A 'Python' that answers the dump script with the bundled registry, and counts calls."""
    script = tmp_path / "python"
    script.write_text(
        f"#!/bin/sh\necho run >> {tmp_path / 'calls'}\n"
        f"{sys.executable} -c 'import json,sys; d=json.load(open(sys.argv[1])); "
        f"d[\"vllm_version\"]=\"9.9.9\"; print(json.dumps(d))' {DATA_FILE}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_live_registry_is_read_once_per_version(
    fake_vllm_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry.live.cache_clear()
    first = registry.live(str(fake_vllm_python), "9.9.9")
    registry.live.cache_clear()
    second = registry.live(str(fake_vllm_python), "9.9.9")  # from the disk cache
    assert (first.source, first.vllm_version, len(first)) == ("live", "9.9.9", 320)
    assert second.options == first.options
    assert (tmp_path / "calls").read_text() == "run\n"
    assert list((tmp_path / "cache" / "pytest-profllm").glob("engine-args-vllm-9.9.9-*.json"))
    registry.live.cache_clear()


def test_registry_for_the_simulator_is_the_bundled_one() -> None:
    assert registry_for("sim") is bundled()


def test_registry_for_vllm_without_vllm_is_the_bundled_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert registry_for("vllm") is bundled()


def test_a_failing_live_parser_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0-broken")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no vllm' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    registry.live.cache_clear()
    with pytest.warns(UserWarning, match="ImportError: no vllm"):
        assert registry_for("vllm") is bundled()
    registry.live.cache_clear()


def test_plugin_import_reads_no_registry_and_no_vllm() -> None:
    # The plugin is imported by every pytest run: the registry loads on first use only.
    code = (
        "import sys, pytest_profllm.plugin, pytest_profllm.engine.registry as e;"
        "print(e.bundled.cache_info().currsize, 'vllm' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False"]


# --- profllm engine-args ------------------------------------------------------------------


def test_engine_args_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine-args"]) == 0
    assert capsys.readouterr().out.startswith("320 engine arguments of vLLM 0.33.0 (has bundled:")


def test_engine_args_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine-args", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 320
    assert "max_num_seqs\tint\tSchedulerConfig\tnull" in lines


def test_engine_args_writes_the_registry_of_another_vllm(
    capsys: pytest.CaptureFixture[str], fake_vllm_python: Path, tmp_path: Path
) -> None:
    out = tmp_path / "engine_args.json"
    assert main(["engine-args", "--python", str(fake_vllm_python), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"320 engine arguments of vLLM 9.9.9 (wrote {out})\n"
    assert Registry.from_json(json.loads(out.read_text()), "bundled").vllm_version == "9.9.9"


def test_engine_args_with_a_python_without_vllm_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["engine-args", "--python", sys.executable, "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"profllm engine-args: {sys.executable} dump_args.py exited 1: ")
    assert "vllm" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_engine_args_output_needs_python(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine-args", "-o", "x.json"]) == 2
    assert "--output needs --python" in capsys.readouterr().err


def test_dump_script_is_standalone() -> None:
    # It runs under any Python with vLLM: nothing but the standard library and vLLM.
    source = DUMP_ARGS_SCRIPT.read_text()
    assert "pytest_profllm" not in source.split('"""', 2)[2]
    assert os.access(DUMP_ARGS_SCRIPT, os.R_OK)
