"""Workload prompts, as `vllm bench serve`'s datasets make them.

`random` follows vLLM's RandomDataset: token ids drawn from the tokenizer's vocabulary with a
seeded numpy generator, decoded to text, and adjusted by re-encoding until the prompt has
exactly the asked-for number of tokens. `prefix_repetition` builds `num_prefixes` shared
prefixes, each followed by random suffixes; `sharegpt` takes the first two turns of local
ShareGPT conversations; `custom` reads JSON lines with a `prompt` (and `output_tokens`);
`spec_bench` and `speed_bench` take the first turn of their local question files, as custom
prompts; `burstgpt` takes the lengths of a BurstGPT CSV's GPT-4 rows and makes prompts of them.

Tokens come from a local Hugging Face tokenizer folder (`TokenizerCodec`) or, with no model on
this machine, from the server's own `/tokenize` and `/detokenize` routes (`ServerCodec`).
"""

from __future__ import annotations

import csv
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from pytest_profllm.engine.secrets import bearer
from pytest_profllm.limits import InputLimitError, load_json
from pytest_profllm.load.dataset_files import custom_output_len, fill, read_json_lines
from pytest_profllm.load.lora_mix import with_models
from pytest_profllm.load.multimodal import (
    custom_audio_prompts,
    custom_image_prompts,
    random_mm_prompts,
)
from pytest_profllm.load.pooling import embedding_prompts, rerank_prompts

# Re-exported: the prompt types are this module's public face; trace.py builds on them too.
from pytest_profllm.load.prompt import Codec as Codec
from pytest_profllm.load.prompt import DatasetError as DatasetError
from pytest_profllm.load.prompt import PromptRequest as PromptRequest
from pytest_profllm.load.trace import trace_prompts

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pytest_profllm.plan.suite import BenchmarkConfig

_MAX_ADJUST_ROUNDS = 10


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


def random_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    rng, draws = _random_draws(config, codec)
    requests = []
    for tokens, target, output_len in draws:
        prompt, prompt_len = _decode_to_length(codec, tokens, target, rng)
        requests.append(PromptRequest(prompt, prompt_len, output_len))
    return requests


def random_token_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """The random dataset's requests as token ids, never rendered as text: the lengths
    `random_prompts` sends (its text re-encodes to the length drawn), for a consumer that
    needs only lengths and ids (the virtual clock), at a fraction of the cost."""
    _, draws = _random_draws(config, codec)
    return [
        PromptRequest("", target, output_len, prompt_ids=tuple(tokens))
        for tokens, target, output_len in draws
    ]


def _random_draws(
    config: BenchmarkConfig, codec: Codec
) -> tuple[np.random.Generator, list[tuple[list[int], int, int]]]:
    """vLLM's random dataset's draws: per request its token ids, the prompt length they must
    encode to, and the output length; and the generator, whose next draws pad the texts."""
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
    draws = []
    for i in range(n):
        inner = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        target = config.random_prefix_len + int(input_lens[i])
        draws.append((prefix + inner, target, int(output_lens[i])))
    return rng, draws


def _decode_to_length(codec: Codec, tokens: list[int], target: int, rng: Any) -> tuple[str, int]:
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


def prefix_repetition_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """`num_prefixes` shared prefixes, each with num_prompts // num_prefixes random suffixes,
    shuffled; every part decodes and re-encodes to its exact length."""

    per_prefix = config.num_prompts // config.prefix_repetition_num_prefixes
    if per_prefix == 0:
        raise DatasetError(
            f"num_prompts ({config.num_prompts}) must be at least "
            f"prefix_repetition_num_prefixes ({config.prefix_repetition_num_prefixes})"
        )
    rng = np.random.default_rng(config.seed)
    allowed = np.array(sorted(set(range(codec.vocab_size)) - codec.special_ids))

    def exact(length: int) -> list[int]:
        tokens = allowed[rng.integers(0, len(allowed), size=length)].tolist()
        text, _ = _decode_to_length(codec, tokens, length, rng)
        return codec.encode(text)[:length]

    requests = []
    for _ in range(config.prefix_repetition_num_prefixes):
        prefix = exact(config.prefix_repetition_prefix_len)
        for _ in range(per_prefix):
            tokens = prefix + exact(config.prefix_repetition_suffix_len)
            requests.append(
                PromptRequest(
                    codec.decode(tokens), len(tokens), config.prefix_repetition_output_len
                )
            )
    random.Random(config.seed).shuffle(requests)
    return requests


def sharegpt_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """The first human turn as prompt, the reply's length as output length (or
    `sharegpt_output_len`), skipping pairs vLLM skips (prompt under 4 or over 1024 tokens,
    output under 4, both over 2048)."""
    path = Path(str(config.dataset_path))
    try:
        data = load_json(path.read_bytes(), what=str(path))
    except InputLimitError as error:
        raise DatasetError(str(error)) from None
    except (OSError, ValueError) as error:
        raise DatasetError(f"{path}: cannot read a ShareGPT JSON file: {error}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of conversations")
    entries = [e for e in data if isinstance(e, dict) and len(e.get("conversations") or []) >= 2]
    random.Random(config.seed).shuffle(entries)
    fixed = config.sharegpt_output_len
    requests: list[PromptRequest] = []
    for entry in entries:
        if len(requests) >= config.num_prompts:
            break
        prompt = str(entry["conversations"][0]["value"])
        reply = str(entry["conversations"][1]["value"])
        prompt_len = len(codec.encode(prompt)) + codec.num_special_tokens_to_add
        output_len = fixed if fixed is not None else len(codec.encode(reply))
        too_short = prompt_len < 4 or (fixed is None and output_len < 4)
        if too_short or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        requests.append(PromptRequest(prompt, prompt_len, output_len))
    return fill(requests, config, path)


def custom_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """JSON lines with a `prompt` and, when `custom_output_len` is -1, `output_tokens`. The
    prompt is sent as it is (vLLM applies the model's chat template unless told to skip it)."""
    path = Path(str(config.dataset_path))
    items = []
    for number, item in read_json_lines(path):
        if not isinstance(item.get("prompt"), str):
            raise DatasetError(f"{path}:{number}: each line needs a string 'prompt'")
        items.append((number, item))
    random.Random(config.seed).shuffle(items)
    requests = []
    for number, item in items[: config.num_prompts]:
        output_len = custom_output_len(config, item, f"{path}:{number}")
        prompt = item["prompt"]
        requests.append(PromptRequest(prompt, len(codec.encode(prompt)), output_len))
    return fill(requests, config, path)


def spec_bench_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """Spec-Bench's question.jsonl: each question's first turn, of `spec_bench_category`
    where set, with `spec_bench_output_len` tokens out. vLLM shuffles these with seed 0
    whatever the workload's seed, and so do we."""
    path = Path(str(config.dataset_path))
    prompts = _first_turns(
        path, config.spec_bench_category, "turns", lambda turns: turns[0], seed=0
    )
    return _turn_requests(prompts, config, codec, config.spec_bench_output_len, path)


def speed_bench_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """SPEED-Bench's `<subset>.jsonl` in the dataset folder: each row's first message, of
    `speed_bench_category` where set, with `speed_bench_output_len` tokens out."""
    folder = Path(str(config.dataset_path))
    if not folder.is_dir():
        raise DatasetError(
            f"{folder}: dataset_name 'speed_bench' reads a folder (SPEED-Bench's prepare "
            "script writes one), not a file"
        )
    path = folder / f"{config.speed_bench_dataset_subset}.jsonl"
    prompts = _first_turns(
        path,
        config.speed_bench_category,
        "messages",
        lambda messages: messages[0]["content"],
        seed=0,
    )
    return _turn_requests(prompts, config, codec, config.speed_bench_output_len, path)


def _first_turns(
    path: Path, category: str | None, column: str, first: Any, seed: int
) -> list[str]:
    prompts = []
    for number, item in read_json_lines(path):
        if category and item.get("category") != category:
            continue
        try:
            prompt = first(item[column])
        except (KeyError, IndexError, TypeError):
            raise DatasetError(
                f"{path}:{number}: each line needs a non-empty '{column}' list"
                + (" of messages with a 'content'" if column == "messages" else "")
            ) from None
        if not isinstance(prompt, str):
            raise DatasetError(f"{path}:{number}: the first of '{column}' is not text")
        prompts.append(prompt)
    if not prompts:
        raise DatasetError(
            f"{path}: no questions" + (f" in category {category!r}" if category else "")
        )
    random.Random(seed).shuffle(prompts)
    return prompts


def _turn_requests(
    prompts: list[str], config: BenchmarkConfig, codec: Codec, output_len: int, path: Path
) -> list[PromptRequest]:
    requests = [
        PromptRequest(prompt, len(codec.encode(prompt)), output_len)
        for prompt in prompts[: config.num_prompts]
    ]
    return fill(requests, config, path)


_BURSTGPT_COLUMNS = ("Model", "Request tokens", "Response tokens")


def burstgpt_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """A BurstGPT CSV's GPT-4 rows with a response, drawn `num_prompts` times (without
    replacement while rows last), as vLLM's: each gives its request and response token
    counts, and the prompt is the ids (i + j) mod the vocabulary, decoded. vLLM draws with
    pandas; we draw the same way with Python's seeded generator (other rows, same spread)."""
    path = Path(str(config.dataset_path))
    try:
        with path.open(encoding="utf-8", newline="") as file:
            reader = csv.DictReader(file)
            missing = [c for c in _BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DatasetError(
                    f"{path}: a BurstGPT CSV needs the columns {', '.join(_BURSTGPT_COLUMNS)}; "
                    f"missing {', '.join(missing)}"
                )
            rows = []
            for number, row in enumerate(reader, 2):
                if row["Model"] != "GPT-4":
                    continue
                try:
                    lengths = int(row["Request tokens"]), int(row["Response tokens"])
                except (TypeError, ValueError):
                    raise DatasetError(
                        f"{path}:{number}: 'Request tokens' and 'Response tokens' are integers"
                    ) from None
                if lengths[1] > 0:
                    rows.append(lengths)
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DatasetError(f"{path}: cannot read a CSV: {error}") from None
    if not rows:
        raise DatasetError(f"{path}: no GPT-4 rows with response tokens (what vLLM keeps)")
    picker = random.Random(config.seed)
    n = config.num_prompts
    drawn = picker.sample(rows, n) if n <= len(rows) else picker.choices(rows, k=n)
    requests = []
    for i, (input_len, output_len) in enumerate(drawn):
        ids = [(i + j) % codec.vocab_size for j in range(input_len)]
        requests.append(PromptRequest(codec.decode(ids), input_len, output_len))
    return requests


def _random_or_embeddings(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    prompts = random_prompts(config, codec)
    return embedding_prompts(config, prompts) if config.is_pooling else prompts


def _random_mm(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    try:
        return random_mm_prompts(config, random_prompts(config, codec))
    except ValueError as error:
        raise DatasetError(str(error)) from None


def _random_rerank(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    return rerank_prompts(config, codec, random_prompts)


DATASETS = {
    "random": _random_or_embeddings,
    "prefix_repetition": prefix_repetition_prompts,
    "sharegpt": sharegpt_prompts,
    "custom": custom_prompts,
    "timed_trace": trace_prompts,
    "random-mm": _random_mm,
    "random-rerank": _random_rerank,
    "burstgpt": burstgpt_prompts,
    "spec_bench": spec_bench_prompts,
    "speed_bench": speed_bench_prompts,
    "custom_image": custom_image_prompts,
    "custom_audio": custom_audio_prompts,
}


def make_prompts(
    config: BenchmarkConfig, codec: Codec, max_model_len: int | None = None
) -> list[PromptRequest]:
    """The workload's prompts; `max_model_len`, the server's context where known, bounds the
    lengths a trace file gives (other datasets' lengths are the suite's or the tokenizer's)."""
    if config.dataset_name not in DATASETS:
        # Conversations are sessions, not single prompts: load/conversation.py makes them.
        raise DatasetError(f"dataset_name {config.dataset_name!r} makes conversations, not prompts")
    if config.dataset_name == "timed_trace":
        return with_models(trace_prompts(config, codec, max_model_len), config)
    return with_models(DATASETS[config.dataset_name](config, codec), config)


def build_prompts(config: BenchmarkConfig, tokenizer: str) -> list[PromptRequest]:
    return make_prompts(config, TokenizerCodec.load(tokenizer))


class ServerCodec:
    """Tokens from the server's `/tokenize` and `/detokenize`: no model files needed here.

    The vocabulary size is found by asking `/detokenize` which ids exist (a binary search);
    special ids are those whose text `/tokenize` does not map back to the same single id.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        # Deferred: requests takes about 0.1 s to import, on every pytest run otherwise.
        import requests

        self._url = base_url.rstrip("/")
        self._model = model
        self._session = requests.Session()
        self._session.headers.update(bearer(api_key))
        self.num_special_tokens_to_add = len(self._tokenize("", add_special=True))
        self.vocab_size = self._find_vocab_size()
        self.special_ids = self._find_special_ids()

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        response = self._session.post(f"{self._url}{route}", json=body, timeout=30)
        if response.status_code != 200:
            raise DatasetError(
                f"{self._url}{route}: HTTP {response.status_code}: {response.text[:200]}"
            )
        return response.json()

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special}
        tokens: list[int] = self._post("/tokenize", body)["tokens"]
        return tokens

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, add_special=False)

    def decode(self, ids: list[int]) -> str:
        text: str = self._post("/detokenize", {"model": self._model, "tokens": ids})["prompt"]
        return text

    def _exists(self, token: int) -> bool:
        # Deferred: requests takes about 0.1 s to import, on every pytest run otherwise.
        import requests

        body = {"model": self._model, "tokens": [token]}
        try:
            response = self._session.post(f"{self._url}/detokenize", json=body, timeout=30)
        except requests.RequestException as error:
            raise DatasetError(f"{self._url}/detokenize: {error}") from None
        return response.status_code == 200

    def _find_vocab_size(self) -> int:
        if not self._exists(0):
            raise DatasetError(f"{self._url}/detokenize does not decode token 0")
        low, high = 0, 1
        while self._exists(high):  # the first id that does not exist lies beyond `low`
            low, high = high, high * 2
            if high > 1 << 24:
                raise DatasetError(f"{self._url}/detokenize decodes any id: no vocabulary size")
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self._exists(middle) else (low, middle)
        return high

    def _find_special_ids(self) -> set[int]:
        # Control tokens sit at the start of a vocabulary (<unk>, <s>) or at its end (Llama 3,
        # Qwen): probe there for tokens whose text is a control marker like `<s>` or `<|x|>`.
        # Like `tokenizer.vocab_size`, the vocabulary then ends before a trailing run of them.
        probes = sorted(
            set(range(min(self.vocab_size, 64)))
            | set(range(max(0, self.vocab_size - 512), self.vocab_size))
        )
        special = {token for token in probes if _looks_special(self.decode([token]))}
        while self.vocab_size - 1 in special and self.vocab_size > 1:
            self.vocab_size -= 1
            special.discard(self.vocab_size)
        return special


def _looks_special(text: str) -> bool:
    return not text or re.fullmatch(r"<\|?[^<>\s]+\|?>|\[[A-Z_]+\]", text) is not None
