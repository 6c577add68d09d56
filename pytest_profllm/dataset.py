"""Workload prompts. The `random` dataset follows vLLM's RandomDataset: token ids drawn from the
tokenizer's vocabulary with a seeded numpy generator, decoded to text, and adjusted by
re-encoding until the prompt has exactly the asked-for number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pytest_profllm.suite import BenchmarkConfig

_MAX_ADJUST_ROUNDS = 10


@dataclass(frozen=True)
class PromptRequest:
    prompt: str
    prompt_len: int
    output_len: int


class TokenizerCodec:
    """A Hugging Face tokenizer folder (or hub name) through the `tokenizers` library."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = {index for index, token in added.items() if token.special}
        # vLLM uses the base vocabulary size (without added tokens), as HF's `vocab_size` does.
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=False)
        processor = tokenizer.post_processor
        self.num_special_tokens_to_add = (
            processor.num_special_tokens_to_add(False) if processor is not None else 0
        )

    @classmethod
    def load(cls, name_or_dir: str) -> TokenizerCodec:
        from tokenizers import Tokenizer

        path = Path(name_or_dir)
        if path.is_dir():
            return cls(Tokenizer.from_file(str(path / "tokenizer.json")))
        if path.is_file():
            return cls(Tokenizer.from_file(str(path)))
        return cls(Tokenizer.from_pretrained(name_or_dir))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text


def random_prompts(config: BenchmarkConfig, codec: TokenizerCodec) -> list[PromptRequest]:
    import numpy as np

    rng = np.random.default_rng(config.seed)
    ratio = config.random_range_ratio
    real_input = max(0, config.random_input_len - codec.num_special_tokens_to_add)
    n = config.num_prompts
    input_lens = rng.integers(
        max(int(np.floor(real_input * (1 - ratio))), 1),
        max(int(np.ceil(real_input * (1 + ratio))), 1) + 1,
        size=n,
    )
    output_lens = rng.integers(
        max(int(np.floor(config.random_output_len * (1 - ratio))), 1),
        max(int(np.ceil(config.random_output_len * (1 + ratio))), 1) + 1,
        size=n,
    )
    offsets = rng.integers(0, codec.vocab_size, size=n)
    allowed = np.array(sorted(set(range(codec.vocab_size)) - codec.special_ids))
    prefix = allowed[rng.integers(0, len(allowed), size=config.random_prefix_len)].tolist()
    requests = []
    for i in range(n):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        target = config.random_prefix_len + int(input_lens[i])
        prompt, prompt_len = _decode_to_length(codec, prefix + inner, target, rng)
        requests.append(PromptRequest(prompt, prompt_len, int(output_lens[i])))
    return requests


def _decode_to_length(
    codec: TokenizerCodec, tokens: list[int], target: int, rng: Any
) -> tuple[str, int]:
    """Decode, re-encode, and pad or cut until the text encodes to `target` tokens."""
    prompt = codec.decode(tokens)
    for _ in range(_MAX_ADJUST_ROUNDS):
        tokens = codec.encode(prompt)
        if len(tokens) == target:
            break
        if len(tokens) < target:
            tokens = tokens + rng.integers(0, codec.vocab_size, size=target - len(tokens)).tolist()
        else:
            tokens = tokens[:target]
        prompt = codec.decode(tokens)
    return prompt, len(codec.encode(prompt))


def build_prompts(config: BenchmarkConfig, tokenizer: str) -> list[PromptRequest]:
    return random_prompts(config, TokenizerCodec.load(tokenizer))
