"""The `random` dataset over the bundled simulator tokenizer, and that tokenizer's folder itself."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_profllm.load.dataset import (
    DatasetError,
    PromptRequest,
    ServerCodec,
    TokenizerCodec,
    build_prompts,
    make_prompts,
    random_prompts,
)
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim import model_files
from pytest_profllm.sim.model_files import MODEL_DIR

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


# The other datasets, and tokens from the server.


def test_prefix_repetition_shares_prefixes_with_exact_lengths(codec: TokenizerCodec) -> None:
    config = _config(
        dataset_name="prefix_repetition",
        num_prompts=7,
        prefix_repetition_prefix_len=20,
        prefix_repetition_suffix_len=10,
        prefix_repetition_num_prefixes=3,
        prefix_repetition_output_len=5,
    )
    requests = make_prompts(config, codec)
    assert len(requests) == 6  # 7 // 3 per prefix, as vLLM
    prefixes = {tuple(codec.encode(r.prompt)[:20]) for r in requests}
    assert len(prefixes) == 3
    assert {r.prompt_len for r in requests} == {30}
    assert {len(codec.encode(r.prompt)) for r in requests} == {30}
    assert {r.output_len for r in requests} == {5}
    assert make_prompts(config, codec) == requests  # seeded


def test_prefix_repetition_needs_a_prompt_per_prefix(codec: TokenizerCodec) -> None:
    config = _config(dataset_name="prefix_repetition", num_prompts=2)
    with pytest.raises(DatasetError, match=r"num_prompts \(2\) must be at least"):
        make_prompts(config, codec)


def _sharegpt(tmp_path: Path, codec: TokenizerCodec) -> Path:
    def words(count: int, start: int = 10) -> str:
        return codec.decode(list(range(start, start + count)))

    data = [
        {"conversations": [{"value": words(8)}, {"value": words(6)}]},
        {"conversations": [{"value": words(2)}, {"value": words(6)}]},  # prompt too short
        {"conversations": [{"value": words(8, 50)}, {"value": words(2)}]},  # reply too short
        {"conversations": [{"value": words(8)}]},  # one turn only
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_keeps_valid_pairs_and_oversamples(tmp_path: Path, codec: TokenizerCodec) -> None:
    path = _sharegpt(tmp_path, codec)
    requests = make_prompts(_config(dataset_name="sharegpt", dataset_path=str(path)), codec)
    assert len(requests) == 20
    assert {(r.prompt_len, r.output_len) for r in requests} == {(8, 6)}


def test_sharegpt_output_len_overrides_the_reply(tmp_path: Path, codec: TokenizerCodec) -> None:
    path = _sharegpt(tmp_path, codec)
    config = _config(dataset_name="sharegpt", dataset_path=str(path), sharegpt_output_len=3)
    requests = make_prompts(config, codec)
    assert {r.output_len for r in requests} == {3}
    # With a fixed output length the short reply no longer disqualifies its pair.
    assert len({r.prompt for r in requests}) == 2


def test_custom_reads_prompts_and_output_tokens(tmp_path: Path, codec: TokenizerCodec) -> None:
    path = tmp_path / "custom.jsonl"
    path.write_text(
        '{"prompt": "ba be", "output_tokens": 4}\n\n{"prompt": "bi", "output_tokens": 9}\n'
    )
    config = _config(
        dataset_name="custom", dataset_path=str(path), custom_output_len=-1, num_prompts=2
    )
    requests = sorted(make_prompts(config, codec), key=lambda r: r.output_len)
    assert requests == [
        PromptRequest("ba be", len(codec.encode("ba be")), 4),
        PromptRequest("bi", len(codec.encode("bi")), 9),
    ]
    fixed = make_prompts(_config(dataset_name="custom", dataset_path=str(path)), codec)
    assert {r.output_len for r in fixed} == {256}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "x"}\n', "custom.jsonl:1: with custom_output_len -1 each line needs"),
        ('{"prompt": "x", "output_tokens": 2}\nnot json\n', "custom.jsonl:2: not JSON"),
        ('{"text": "x"}\n', "custom.jsonl:1: each line needs a string 'prompt'"),
    ],
)
def test_custom_bad_lines_name_file_and_line(
    tmp_path: Path, codec: TokenizerCodec, text: str, message: str
) -> None:
    path = tmp_path / "custom.jsonl"
    path.write_text(text)
    config = _config(dataset_name="custom", dataset_path=str(path), custom_output_len=-1)
    with pytest.raises(DatasetError, match=message):
        make_prompts(config, codec)


def test_file_datasets_need_a_path() -> None:
    with pytest.raises(ValueError, match="needs dataset_path"):
        _config(dataset_name="sharegpt")


def test_server_codec_matches_the_local_tokenizer(sim_url: str, codec: TokenizerCodec) -> None:
    server = ServerCodec(sim_url, "sim")
    assert server.vocab_size == codec.vocab_size
    assert server.special_ids == codec.special_ids
    assert server.num_special_tokens_to_add == codec.num_special_tokens_to_add
    config = _config(num_prompts=3)
    assert make_prompts(config, server) == make_prompts(config, codec)


def test_server_codec_reports_a_wrong_model(sim_url: str) -> None:
    with pytest.raises(DatasetError, match="/tokenize: HTTP 404"):
        ServerCodec(sim_url, "not-served")
