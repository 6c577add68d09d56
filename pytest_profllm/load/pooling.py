"""Pooling workloads, as vLLM's client sends them: `random` prompts batched by
`random_batch_size` into one embeddings request, and `random-rerank` (RandomDatasetForReranking):
one query of about half the input length, and per request `random_batch_size` documents, each
scored against it, so a request's prompt tokens are (query + separator + document) per pair.

A pooling request is one JSON response, not a stream: its only latency is E2EL (vLLM's client
sets TTFT to it too, and reports E2EL alone), and its tokens are its prompt tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pytest_profllm.load.prompt import Codec, PromptRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from pytest_profllm.plan.suite import BenchmarkConfig

    # The random dataset's maker (dataset.py), which builds on this module's registry entry.
    RandomPrompts = Callable[[BenchmarkConfig, Codec], list[PromptRequest]]


def embedding_prompts(
    config: BenchmarkConfig, prompts: list[PromptRequest]
) -> list[PromptRequest]:
    """The random dataset's `prompts`, `random_batch_size` to a request (vLLM batches so)."""
    size = config.random_batch_size
    if size == 1:
        return [PromptRequest(p.prompt, p.prompt_len, 0, inputs=(p.prompt,)) for p in prompts]
    return [
        PromptRequest(
            batch[0].prompt,
            sum(p.prompt_len for p in batch),
            0,
            inputs=tuple(p.prompt for p in batch),
        )
        for batch in (prompts[i : i + size] for i in range(0, len(prompts), size))
    ]


def rerank_prompts(
    config: BenchmarkConfig, codec: Codec, random_prompts: RandomPrompts
) -> list[PromptRequest]:
    """One query for the whole workload and `num_prompts` documents, `random_batch_size`
    documents to a request; the query takes about half of `random_input_len`."""
    separator = 1  # a reranker joins query and document with one token, as vLLM counts
    query_len = max(1, config.random_input_len // 2 - separator)
    query = random_prompts(
        config.model_copy(update={"random_input_len": query_len, "num_prompts": 1}), codec
    )[0]
    document_len = max(1, config.random_input_len - query.prompt_len - separator)
    documents = random_prompts(
        config.model_copy(update={"random_input_len": document_len, "seed": config.seed + 1}),
        codec,
    )
    size = config.random_batch_size
    requests = []
    for start in range(0, len(documents), size):
        batch = documents[start : start + size]
        tokens = (query.prompt_len + separator) * len(batch) + sum(d.prompt_len for d in batch)
        requests.append(
            PromptRequest(
                query.prompt, tokens, 0, inputs=(query.prompt, *(d.prompt for d in batch))
            )
        )
    return requests


def vector_check(vectors: object) -> str | None:
    """Why an embeddings response's `data` is not one finite vector per input, or None."""
    if not isinstance(vectors, list) or not vectors:
        return "the response has no embeddings"
    for item in vectors:
        vector = item.get("embedding") if isinstance(item, dict) else None
        if not isinstance(vector, list) or not vector:
            return "an embedding is not a list of numbers"
        numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector)
        if not numbers or not np.all(np.isfinite(np.asarray(vector, dtype=float))):
            return "an embedding has a value that is not a finite number"
    return None
