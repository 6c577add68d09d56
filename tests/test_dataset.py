"""The `random` dataset over the bundled simulator tokenizer, and that tokenizer's folder itself."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_profllm.dataset import (
    PromptRequest,
    TokenizerCodec,
    build_prompts,
    random_prompts,
)
from pytest_profllm.sim import model_files
from pytest_profllm.sim.model_files import MODEL_DIR
from pytest_profllm.suite import BenchmarkConfig

SPECIAL_IDS = {0, 1, 2}


@pytest.fixture(scope="module")
def codec() -> TokenizerCodec:
    return TokenizerCodec.load(str(MODEL_DIR))


def _config(**values: Any) -> BenchmarkConfig:
    values = {"num_prompts": 20, "random_input_len": 50, "random_output_len": 7} | values
    return BenchmarkConfig(**values)


def test_codec_reads_bundled_tokenizer(codec: TokenizerCodec) -> None:
    assert codec.vocab_size == model_files.VOCAB_SIZE
    assert codec.special_ids == SPECIAL_IDS
    # No post-processor: nothing is added to prompts, so input lengths are not reduced.
    assert codec.num_special_tokens_to_add == 0


def test_bundled_tokenizer_round_trips_any_ordinary_ids(codec: TokenizerCodec) -> None:
    # The property the folder exists for: decode then encode gives the same ids back.
    ids = np.random.default_rng(0).integers(3, codec.vocab_size, size=500).tolist()
    assert codec.encode(codec.decode(ids)) == ids


def test_fixed_lengths_are_exact(codec: TokenizerCodec) -> None:
    prompts = random_prompts(_config(), codec)
    assert len(prompts) == 20
    for prompt in prompts:
        assert prompt.prompt_len == 50
        assert len(codec.encode(prompt.prompt)) == 50
        assert prompt.output_len == 7
    assert len({prompt.prompt for prompt in prompts}) == 20


def test_build_prompts_loads_the_folder(codec: TokenizerCodec) -> None:
    config = _config(num_prompts=5)
    assert build_prompts(config, str(MODEL_DIR)) == random_prompts(config, codec)
    # A path to tokenizer.json itself works too.
    assert build_prompts(config, str(MODEL_DIR / "tokenizer.json")) == random_prompts(config, codec)


@pytest.mark.parametrize(
    ("input_len", "output_len", "ratio"),
    [(40, 20, 0.5), (33, 7, 0.3), (10, 3, 0.9)],
)
def test_range_ratio_spreads_lengths_within_bounds(
    codec: TokenizerCodec, input_len: int, output_len: int, ratio: float
) -> None:
    config = _config(
        num_prompts=60,
        random_input_len=input_len,
        random_output_len=output_len,
        random_range_ratio=ratio,
    )
    prompts = random_prompts(config, codec)
    # vLLM's bounds: [floor(n * (1 - r)), ceil(n * (1 + r))], inclusive, at least 1.
    input_low = max(math.floor(input_len * (1 - ratio)), 1)
    input_high = math.ceil(input_len * (1 + ratio))
    output_low = max(math.floor(output_len * (1 - ratio)), 1)
    output_high = math.ceil(output_len * (1 + ratio))
    for prompt in prompts:
        assert input_low <= prompt.prompt_len <= input_high
        assert output_low <= prompt.output_len <= output_high
        assert len(codec.encode(prompt.prompt)) == prompt.prompt_len
    assert len({prompt.prompt_len for prompt in prompts}) > 1
    assert len({prompt.output_len for prompt in prompts}) > 1


def test_prefix_is_shared(codec: TokenizerCodec) -> None:
    prompts = random_prompts(_config(num_prompts=10, random_prefix_len=6), codec)
    encodings = [codec.encode(prompt.prompt) for prompt in prompts]
    prefixes = {tuple(ids[:6]) for ids in encodings}
    assert len(prefixes) == 1
    # The prefix comes on top of the input length, as in vLLM.
    for prompt, ids in zip(prompts, encodings, strict=True):
        assert prompt.prompt_len == len(ids) == 56
    # The rest differs from prompt to prompt.
    assert len({tuple(ids[6:]) for ids in encodings}) == 10


def test_without_prefix_prompts_start_differently(codec: TokenizerCodec) -> None:
    prompts = random_prompts(_config(num_prompts=10), codec)
    assert len({codec.encode(prompt.prompt)[0] for prompt in prompts}) > 1


def test_seed_fixes_prompts(codec: TokenizerCodec) -> None:
    config = _config(random_range_ratio=0.5, random_prefix_len=4, seed=11)
    same: list[PromptRequest] = random_prompts(config, codec)
    assert random_prompts(config, codec) == same
    other = random_prompts(config.model_copy(update={"seed": 12}), codec)
    assert [p.prompt for p in other] != [p.prompt for p in same]
    assert all(a.prompt != b.prompt for a, b in zip(same, other, strict=True))


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"random_range_ratio": 0.5, "random_prefix_len": 16, "seed": 5},
        # Prompts longer than the vocabulary wrap around it, so every ordinary id is used.
        {"num_prompts": 3, "random_input_len": 8200, "seed": 2},
    ],
)
def test_special_tokens_never_appear(codec: TokenizerCodec, values: dict[str, Any]) -> None:
    for prompt in random_prompts(_config(**values), codec):
        assert not SPECIAL_IDS & set(codec.encode(prompt.prompt))
        for token in model_files.SPECIAL_TOKENS:
            assert token not in prompt.prompt


# The shipped model folder must be what model_files.py writes.


def test_shipped_files_match_generators() -> None:
    assert (MODEL_DIR / "tokenizer.json").read_text() == model_files.tokenizer_json() + "\n"
    assert json.loads((MODEL_DIR / "tokenizer_config.json").read_text()) == (
        model_files.tokenizer_config()
    )
    assert json.loads((MODEL_DIR / "config.json").read_text()) == model_files.model_config()


def test_write_model_dir_reproduces_shipped_folder_byte_for_byte(tmp_path: Path) -> None:
    written = model_files.write_model_dir(tmp_path / "model")
    shipped = sorted(path.name for path in MODEL_DIR.iterdir())
    assert sorted(path.name for path in written.iterdir()) == shipped
    for name in shipped:
        assert (written / name).read_bytes() == (MODEL_DIR / name).read_bytes(), name


def test_model_config_agrees_with_tokenizer(codec: TokenizerCodec) -> None:
    config = model_files.model_config()
    assert config["vocab_size"] == codec.vocab_size
    assert codec.encode("<s>") == [config["bos_token_id"]]
    assert codec.encode("</s>") == [config["eos_token_id"]]
