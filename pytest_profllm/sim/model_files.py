"""The simulated engine's model folder: a tiny Hugging Face-format tokenizer and config.

The folder carries no weights. Its tokenizer is a word-level one over made-up syllable words,
so that any token sequence decodes to text that encodes back to the same tokens: clients
(ours and `vllm bench serve --tokenizer DIR`) can build prompts of exact token lengths.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

MODEL_DIR = Path(__file__).with_name("model")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
VOCAB_SIZE = 8192
MAX_POSITION_EMBEDDINGS = 32768
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def vocabulary(size: int = VOCAB_SIZE) -> list[str]:
    """Special tokens, then one-, two- and three-syllable words in a fixed order."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words: list[str] = list(SPECIAL_TOKENS)
    for length in (1, 2, 3):
        for parts in itertools.product(syllables, repeat=length):
            if len(words) == size:
                return words
            words.append("".join(parts))
    return words


def tokenizer_json(size: int = VOCAB_SIZE) -> str:
    vocab = {word: index for index, word in enumerate(vocabulary(size))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    return tokenizer.to_str(pretty=True)


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def model_config(size: int = VOCAB_SIZE) -> dict[str, object]:
    # Enough of a Llama-style config for tools that read vocab size and context length;
    # `profllm_sim` marks the folder as the simulator's (there are no weights). The shape is
    # an 8B-class model's (Qwen3-8B's layers and widths), so a simulator serving this folder
    # costs steps like a model people benchmark.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "profllm_sim": True,
        "vocab_size": size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def write_model_dir(directory: Path = MODEL_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json() + "\n")
    for name, content in (
        ("tokenizer_config.json", tokenizer_config()),
        ("config.json", model_config()),
    ):
        (directory / name).write_text(json.dumps(content, indent=2) + "\n")
    return directory


if __name__ == "__main__":
    print(write_model_dir())
