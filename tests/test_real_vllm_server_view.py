"""The server's view on real vLLM (the CPU build serving a tiny random-weight Llama): the
means `profllm bench` reports from vLLM's own histograms agree with two raw scrapes of its
/metrics around the run. Marked `real_vllm`: skips (one line) without
PROFLLM_VLLM_CPU_PYTHON."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_vllm import one_at_a_time, require_vllm_cpu_python, tiny_llama, vllm_cpu_server
from test_server_view_sim import check_means_of_the_window

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm_cpu_python()
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_vllms_means_of_the_window(tiny_model: Path, tmp_path: Path) -> None:
    with one_at_a_time(), vllm_cpu_server(tiny_model, tmp_path) as url:
        check_means_of_the_window(
            url, tmp_path, "--tokenizer", str(tiny_model), "--ignore-eos", model=str(tiny_model)
        )
