"""What a workload's prompts are: the requests a dataset makes and the tokenizer it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class PromptRequest:
    prompt: str
    prompt_len: int
    output_len: int
    # A prompt of token ids, sent as such on the completions endpoint (a timed trace's).
    prompt_ids: tuple[int, ...] | None = None
    # When to send it, in seconds from the start, where the workload says (a timed trace).
    timestamp: float | None = None
    # The request it waits for (its place in the workload; a trace line's parent): sent no
    # earlier than `timestamp` and not before that request's response ended plus
    # `after_delay_s` (load/client.py `run_share`).
    after: int | None = None
    after_delay_s: float = 0.0
    # A pooling request's texts (embeddings: its inputs; rerank: the query, then documents);
    # `prompt_len` counts them all.
    inputs: tuple[str, ...] | None = None
    # Media (random-mm, custom_image, custom_audio): chat content parts sent after the text,
    # each image's or video's (height, width, frames), each audio clip's seconds, and their
    # encoded bytes.
    mm_content: tuple[dict[str, Any], ...] = ()
    mm_items: tuple[tuple[int, int, int], ...] = ()
    mm_audio_s: tuple[float, ...] = ()
    mm_bytes: int = 0
    # A chat message's whole content where the dataset interleaves text and media (a
    # custom_image line's "content"): sent as it is, in its order.
    chat_content: tuple[dict[str, Any], ...] | None = None
    # The model it asks for, where a LoRA mix (load/lora_mix.py) names one; None: the
    # server's model.
    model: str | None = None


class Codec(Protocol):
    special_ids: set[int]
    vocab_size: int
    num_special_tokens_to_add: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class DatasetError(ValueError):
    """A dataset that cannot give prompts; the message says which file or setting and why."""
