"""The `profllm` command: `plan`, `schema`, the parser's help, and the console script."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_profllm
import pytest_profllm.cli
from pytest_profllm.cli.main import COMMANDS, build_parser, main

PACKAGE_DIR = Path(pytest_profllm.__file__).parent
SHIPPED_SCHEMA = PACKAGE_DIR / "schema" / "record.schema.json"
# The manual's reference page for the command (docs/, the MkDocs site).
CLI_PAGE = PACKAGE_DIR.parent / "docs" / "reference" / "cli.md"

SUITE = """\
name: smoke
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [16, 64]
  tensor_parallel_size: 2
  api_key: sk-secret
benchmark:
  num_prompts: 8
  request_rate: [8, inf]
repeat: 2
thresholds:
  completed: {min: 8}
"""


@pytest.fixture
def suite_path(tmp_path: Path) -> Path:
    path = tmp_path / "bench_smoke.yaml"
    path.write_text(SUITE)
    return path


@pytest.fixture(autouse=True)
def in_the_suites_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `profllm plan` is run where its suites are, as a user would. From elsewhere pytest puts
    # the rootdir at the common ancestor of that folder and the suites: from a clone under
    # /tmp that is /tmp, and every case id would start with pytest-of-root/...
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan's environment comes from the default pool: 8 virtual GPUs where NVML finds none.
    from pytest_profllm.hosts import nvml

    monkeypatch.setattr(nvml, "discover", lambda: nvml.GpuHost((), None))


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- plan ---------------------------------------------------------------------------------


def test_plan_names_suites_from_here_or_by_their_whole_path(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pytest's ids are from its rootdir, the common folder of the suites and the current
    # directory: `/tmp/x/bench.yaml` read `x/bench.yaml` from a clone under /tmp.
    (tmp_path / "x").mkdir()
    outside = tmp_path / "x" / "bench_far.yaml"
    outside.write_text(SUITE)
    (tmp_path / "here" / "sub").mkdir(parents=True)
    inside = tmp_path / "here" / "sub" / "bench_near.yaml"
    inside.write_text(SUITE)
    monkeypatch.chdir(tmp_path / "here")
    repo_suite = Path(pytest_profllm.__file__).parents[1] / "benchmarks" / "bench_smoke.yaml"
    code, out, err = run_main(capsys, "plan", str(outside), str(inside), str(repo_suite))
    assert (code, err) == (0, "")
    assert f"case {outside}::qwen3-8b-seqs16::random-rate8-r1" in out
    assert "case sub/bench_near.yaml::qwen3-8b-seqs16::random-rate8-r1" in out
    assert f"case {repo_suite}::qwen3-8b-seqs8::random-rate8" in out  # beside the repo's conftest


def test_plan_json_lists_servers_and_cases(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    code, out, err = run_main(capsys, "plan", str(suite_path), "--json", "--engine", "vllm")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert document["engine"] == "vllm"  # asked for, though this host cannot run it
    assert document["engine_args"]["vllm_version"] == "0.33.0"
    assert document["engine_args"]["options"] == 320
    assert document["lease"].startswith("argv and env as leased from an empty pool (8 virtual")
    servers, cases = document["servers"], document["cases"]
    assert [server["label"] for server in servers] == ["qwen3-8b-seqs16", "qwen3-8b-seqs64"]
    assert len(cases) == 2 * 2 * 2  # servers x rates x repeats
    for server in servers:
        assert server["gpus_needed"] == 2
        assert server["suite"] == "smoke"
        # What the first lease of an empty default pool gives: GPUs 0 and 1, the first ports.
        assert server["env"] == {
            "CUDA_VISIBLE_DEVICES": "0,1",
            "VLLM_PORT": "20001",
            # vLLM's development routes: each case empties the prefix cache before its load.
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_API_KEY": "***",
        }
        argv = server["argv"]
        assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                            "Qwen/Qwen3-8B"]
        assert argv[-4:] == ["--host", "127.0.0.1", "--port", "20000"]
        assert "--api-key" not in argv  # vLLM reads it from VLLM_API_KEY, out of its log
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        # Each server's cases point at it, four apiece.
        assert sum(case["server_key"] == server["server_key"] for case in cases) == 4
    assert servers[0]["server_key"] != servers[1]["server_key"]
    assert cases[0]["case_id"] == "bench_smoke.yaml::qwen3-8b-seqs16::random-rate8-r1"
    assert [case["repeat_index"] for case in cases[:2]] == [0, 1]
    assert cases[0]["benchmark"]["num_prompts"] == 8
    assert cases[2]["benchmark"]["request_rate"] == "inf"
    assert cases[0]["thresholds"] == {"completed": {"min": 8.0, "max": None}}


def test_plan_json_redacts_secrets(capsys: pytest.CaptureFixture[str], suite_path: Path) -> None:
    code, out, _ = run_main(capsys, "plan", str(suite_path), "--json")
    assert code == 0
    assert "sk-secret" not in out
    for server in json.loads(out)["servers"]:
        assert server["config"]["api_key"] == "***"
        assert server["env"]["VLLM_API_KEY"] == "***"


def test_plan_json_redacts_secrets_left_in_argv(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # watermark_config has no variable to travel in: it stays in argv, shown as ***. Several
    # API keys would too, so they are refused: any local user reads a command line.
    path = tmp_path / "bench_keys.yaml"
    path.write_text("server:\n  model: m\n  watermark_config: {key: wm-secret}\n")
    code, out, _ = run_main(capsys, "plan", str(path), "--json")
    assert code == 0
    assert "wm-secret" not in out
    argv = json.loads(out)["servers"][0]["argv"]
    assert argv[argv.index("--watermark-config") + 1] == "***"
    path.write_text("server:\n  model: m\n  api_key: [[sk-one, sk-two]]\n")
    code, out, err = run_main(capsys, "plan", str(path), "--json")
    assert code == 2
    assert "sk-one" not in out + err
    assert "server.api_key[0]: more than one value would go on the server's command line" in err


def test_plan_listing_redacts_secrets(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    code, out, _ = run_main(capsys, "plan", str(suite_path), "--engine", "vllm")
    assert code == 0
    assert "sk-secret" not in out
    lines = out.splitlines()
    assert lines[0] == "engine vllm (--engine vllm)"
    assert lines[-2] == "2 server(s), 8 case(s)"
    assert lines[-1].startswith("(argv and env as leased from an empty pool")
    assert lines[1].startswith("server qwen3-8b-seqs16 [")
    # `***` is quoted: the line is a shell command, where it would be a glob.
    assert (
        "(2 GPU(s); axes: max_num_seqs=16): CUDA_VISIBLE_DEVICES=0,1 VLLM_PORT=20001 "
        "VLLM_SERVER_DEV_MODE=1 VLLM_API_KEY='***' "
    ) in lines[1]
    assert lines[2] == (
        "  case bench_smoke.yaml::qwen3-8b-seqs16::random-rate8-r1 (axes: request_rate=8)"
    )


def test_plan_sim_engine_shows_the_simulator(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    code, out, _ = run_main(capsys, "plan", str(suite_path), "--json", "--engine", "sim")
    assert code == 0
    document = json.loads(out)
    assert document["engine"] == "sim"
    assert document["servers"][0]["argv"][:3] == [sys.executable, "-m", "pytest_profllm.sim"]


def test_plan_of_a_folder_finds_suites(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    # Only bench_*.yaml files are suites; other YAML in the folder is left alone.
    (suite_path.parent / "nested").mkdir()
    (suite_path.parent / "nested" / "bench_other.yaml").write_text("server: {model: m}\n")
    (suite_path.parent / "config.yaml").write_text("not: [a suite\n")
    code, out, _ = run_main(capsys, "plan", str(suite_path.parent), "--json")
    assert code == 0
    document = json.loads(out)
    assert len(document["servers"]) == 3
    assert len(document["cases"]) == 9


def test_plan_of_a_bad_suite_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bench_bad.yaml"
    path.write_text("server:\n  model: m\nbenchmark:\n  num_promts: 5\n")
    code, out, err = run_main(capsys, "plan", str(path))
    assert code == 2
    assert out == ""
    assert err.endswith("\n")
    assert err.count("\n") == 1
    assert err.startswith(
        "profllm plan: bench_bad.yaml:4: unknown key 'benchmark.num_promts' "
        "(did you mean 'num_prompts'?); allowed: "
    )


def test_plan_of_a_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    code, out, err = run_main(capsys, "plan", str(missing))
    assert (code, out) == (2, "")
    assert err == f"profllm plan: {missing}: no such file or folder\n"


def test_plan_needs_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan"])
    assert exit_info.value.code == 2
    assert "PATH" in capsys.readouterr().err


def test_plan_shows_marked_tests_as_pytest_collects_them(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    (suite_path.parent / "test_plan_marked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.profllm(server={'model': 'Qwen/Qwen3-8B', 'max_num_seqs': [8, 32]},\n"
        "                     benchmark={'num_prompts': 4})\n"
        "def test_gate(profllm_result):\n"
        "    pass\n\n"
        "def test_plain():\n"
        "    pass\n"
    )
    code, out, err = run_main(capsys, "plan", str(suite_path.parent), "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    ids = [case["case_id"] for case in document["cases"]]
    assert len(document["servers"]) == 2 + 2
    assert len(ids) == 8 + 2  # the suite's, and the marked test's (not the plain test)
    assert "test_plan_marked.py::test_gate[qwen3-8b-seqs8/random]" in ids
    assert "test_plan_marked.py::test_gate[qwen3-8b-seqs32/random]" in ids
    marked = [s for s in document["servers"] if s["suite"] == "test_plan_marked.py::test_gate"]
    assert [server["axes"] for server in marked] == [{"max_num_seqs": 8}, {"max_num_seqs": 32}]


def test_plan_picks_the_engine_a_run_would(
    capsys: pytest.CaptureFixture[str], suite_path: Path
) -> None:
    from pytest_profllm.engine.choice import choose_engine

    run_would = choose_engine("auto", 0)  # no GPU here (the autouse fixture)
    code, out, _ = run_main(capsys, "plan", str(suite_path), "--json")
    assert code == 0
    document = json.loads(out)
    assert (document["engine"], document["engine_reason"]) == (run_would.name, run_would.reason)
    code, out, _ = run_main(capsys, "plan", str(suite_path))
    assert out.splitlines()[0] == f"engine {run_would.name} ({run_would.reason})"


def test_plan_command_lines_are_shell_safe(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import shlex

    path = tmp_path / "bench_quoted.yaml"
    path.write_text(
        "server:\n  model: m\n  compilation_config: {mode: 3}\n"
        "  chat_template: \"{{ messages }} it's\"\n  cudagraph_capture_sizes: [1, 2, 4, 8]\n"
    )
    code, out, _ = run_main(capsys, "plan", str(path), "--engine", "vllm")
    assert code == 0
    line = out.splitlines()[1]
    command = shlex.split(line.split("): ", 1)[1])
    document = json.loads(run_main(capsys, "plan", str(path), "--json", "--engine", "vllm")[1])
    [server] = document["servers"]
    # What the shell reads back is exactly the environment and argv the server gets.
    env = [f"{key}={value}" for key, value in server["env"].items()]
    assert command == env + server["argv"]
    assert command[command.index("--compilation-config") + 1] == '{"mode":3}'
    assert command[command.index("--chat-template") + 1] == "{{ messages }} it's"
    # A list value of an argument that takes a list: one server, all four sizes, no axis.
    assert server["axes"] == {}
    start = command.index("--cudagraph-capture-sizes") + 1
    assert command[start : start + 4] == ["1", "2", "4", "8"]


def test_plan_of_a_suite_with_several_errors_shows_each(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bench_bad.yaml"
    path.write_text("server:\n  model: m\n  max_num_seqs: x\nbenchmark:\n  num_promts: 5\n")
    code, out, err = run_main(capsys, "plan", str(path))
    assert (code, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == 2
    assert lines[0] == (
        "profllm plan: bench_bad.yaml:3: server.max_num_seqs: takes an integer (got 'x')"
    )
    assert lines[1].startswith("profllm plan: bench_bad.yaml:5: unknown key 'benchmark.num_promts'")


def test_plan_of_a_yaml_file_pytest_would_not_collect_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "smoke.yaml"
    path.write_text(SUITE)
    code, out, err = run_main(capsys, "plan", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"profllm plan: not found: {path}")
    assert err.endswith("(pytest collects suite files named bench_*.yaml, or as the ini option "
                        "profllm_suite_glob says)\n")


# --- sim ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_sim_help(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", flag])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: profllm sim ")
    assert "--max-num-seqs" in out
    # By hand it differs from the plugin's server, and says how to run it as the plugin does.
    flat = " ".join(out.split())
    assert "only with VLLM_SERVER_DEV_MODE=1" in flat
    assert "VLLM_SERVER_DEV_MODE=1 PROFLLM_SIM_NICE=0 profllm sim MODEL" in flat


# --- schema -------------------------------------------------------------------------------


def test_schema_matches_the_shipped_file(capsys: pytest.CaptureFixture[str]) -> None:
    # If this fails, regenerate the shipped file: profllm schema > pytest_profllm/schema/...
    code, out, _ = run_main(capsys, "schema")
    assert code == 0
    printed = json.loads(out)
    assert printed == json.loads(SHIPPED_SCHEMA.read_text())
    assert printed["title"] == "BenchmarkRecord"
    assert {"run_id", "case_id", "results", "config"} <= set(printed["properties"])


# --- parser and docs ----------------------------------------------------------------------


def _subcommands() -> dict[str, str | None]:
    """Each subcommand's name and the help text shown for it in `profllm --help`."""
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    return {name: helps.get(name) for name in action.choices}


def test_every_subcommand_has_help() -> None:
    commands = _subcommands()
    assert {"plan", "ingest", "schema", "sim"} <= set(commands)
    for name, help_text in commands.items():
        assert help_text, f"profllm {name} has no help text"
    assert all(name in build_parser().format_help() for name in commands)


def test_the_manual_documents_every_subcommand() -> None:
    # Each command has its own entry, `- `profllm NAME ...`, not a mention in another's.
    entries = set(re.findall(r"^- `profllm ([\w-]+)", CLI_PAGE.read_text(), re.MULTILINE))
    missing = [name for name in _subcommands() if name not in entries]
    assert not missing, f"docs/reference/cli.md does not document: {', '.join(missing)}"


def test_every_command_module_is_registered() -> None:
    # A module of cli/ with a `register` is a subcommand: main must list it, or it is never
    # reachable.
    modules = [
        importlib.import_module(f"pytest_profllm.cli.{info.name}")
        for info in pkgutil.iter_modules(pytest_profllm.cli.__path__)
        if info.name != "__main__"  # importing it runs the command
    ]
    commands = {module.__name__ for module in modules if hasattr(module, "register")}
    listed = [getattr(module, "__name__", "") for module in COMMANDS]
    assert sorted(listed) == sorted(commands)
    # Each adds one parser with a handler (sim's is handed its arguments before parsing).
    parser = build_parser()
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(action.choices) == len(COMMANDS)
    for name, sub in action.choices.items():
        assert name == "sim" or callable(sub.get_default("handler")), f"{name} has no handler"


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


# --- the installed console script ---------------------------------------------------------


def test_console_script_entry_point(suite_path: Path) -> None:
    script = Path(sys.executable).parent / "profllm"
    assert script.exists(), "the profllm console script is not installed in this environment"
    result = subprocess.run(
        [str(script), "plan", str(suite_path), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["cases"]) == 8
    assert "sk-secret" not in result.stdout + result.stderr

    bad = subprocess.run(
        [str(script), "plan", str(suite_path.parent / "missing.yaml")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert bad.returncode == 2  # main's return value becomes the exit status
    assert bad.stderr.startswith("profllm plan: ")


def test_plan_says_when_a_server_needs_more_gpus_than_the_default_pool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bench_big.yaml"
    path.write_text("server:\n  model: m\n  tensor_parallel_size: 4\n  data_parallel_size: 4\n")
    code, out, _ = run_main(capsys, "plan", str(path), "--json")
    assert code == 0
    [server] = json.loads(out)["servers"]
    assert server["gpus_needed"] == 16
    assert server["problem"] == (
        "needs 16 GPUs but the default pool has 8: skipped unless --profllm-gpus gives more"
    )


def test_plan_of_a_profiling_suite_shows_the_profiler_config_the_server_gets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bench_prof.yaml"
    path.write_text("server:\n  model: m\nprofile: true\n")
    out_dir = tmp_path / "out"
    code, out, _ = run_main(capsys, "plan", str(path), "--json", "--profllm-out", str(out_dir))
    assert code == 0
    [server] = json.loads(out)["servers"]
    argv = server["argv"]
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert config["profiler"] == "torch"
    assert Path(config["torch_profiler_dir"]).parent == (out_dir / "profiles").resolve()
    # vLLM 0.33.0 takes the profiler from its argument, not from VLLM_TORCH_PROFILER_DIR.
    assert "VLLM_TORCH_PROFILER_DIR" not in server["env"]
