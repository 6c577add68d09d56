"""What a workload's prompts are: the requests a dataset makes and the tokenizer it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PromptRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # A prompt of token ids, sent as such on the completions endpoint (a timed trace's).
    prompt_ids: tuple[int, ...] | None = None
    # When to send it, in seconds from the start, where the workload says (a timed trace).
    timestamp: float | None = None


class Codec(Protocol):
    special_ids: set[int]
    vocab_size: int
    num_special_tokens_to_add: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class DatasetError(ValueError):
    """A dataset that cannot give prompts; the message says which file or setting and why."""
