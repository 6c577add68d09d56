"""The Python form of a suite: the marker declares the matrix, the test asserts what it likes."""

import pytest


@pytest.mark.profllm(
    server={"model": "Qwen/Qwen3-8B", "max_num_seqs": 32},
    benchmark={
        "num_prompts": 16, "random_input_len": 128, "random_output_len": 16, "request_rate": 16,
    },
    thresholds={"failed": {"max": 0}},
)
def test_decode_is_faster_than_prefill(profllm_result):
    results = profllm_result.results
    assert results["completed"] == 16
    assert results["total_output_tokens"] == 16 * 16
    # A decode step is one token for every running sequence: far quicker than a whole prompt.
    assert results["median_tpot_ms"] < results["median_ttft_ms"] + 50
