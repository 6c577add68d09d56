"""Logprobs for the simulated engine's completions (`echo`, `logprobs`), in vLLM's shape.

The figures come from a hash of each token and the one before it, so one prompt always gets the
same ones; they are well formed (each at most 0, the token among its top entries, the top entries'
probabilities summing under 1) but no model's: what an evaluation scores on them is chance.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

# vLLM's default --max-logprobs: more top entries than this is a bad request.
MAX_LOGPROBS = 20


def _unit(*parts: object) -> float:
    """A number in (0, 1), the same for the same parts."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def _top(
    previous: str, alternatives: Callable[[int], str], count: int
) -> tuple[dict[str, float], float]:
    """The `count` likeliest next tokens after `previous`, with their logprobs (each takes a
    share of the probability the likelier ones left), and the probability left to the rest."""
    left, top = 1.0, dict[str, float]()
    for rank in range(count):
        share = left * (0.2 + 0.6 * _unit("share", previous, rank))
        text = alternatives(int(_unit("alternative", previous, rank) * 2**31))
        top.setdefault(text, math.log(share))
        left -= share
    return dict(sorted(top.items(), key=lambda item: -item[1])), left


def _position(
    previous: str, token: str, alternatives: Callable[[int], str], count: int, greedy: bool
) -> tuple[float, dict[str, float]]:
    """A token's logprob and its top entries (the token itself always among them, as vLLM adds
    the sampled or echoed token to the top ones). A greedy token is the likeliest."""
    top, left = _top(previous, alternatives, max(count, 1))
    if greedy:
        # The token takes the likeliest entry's place (and probability).
        ranked = list(top.items())
        logprob = ranked[0][1]
        others = [(text, value) for text, value in ranked[1:] if text != token]
        top = {token: logprob, **dict(others[: max(count - 1, 0)])}
    else:
        # Outside the top entries: less likely than the least of them, within what they left.
        rest = min(left, math.exp(min(top.values())))
        logprob = top.get(token, math.log(rest * (0.05 + 0.9 * _unit("token", previous, token))))
        top = dict(list(top.items())[:count])
        top[token] = logprob
    return logprob, top


def completion_logprobs(
    prompt: Sequence[str] | None,
    generated: Sequence[str],
    count: int,
    alternatives: Callable[[int], str],
) -> dict[str, Any]:
    """vLLM's `choices[].logprobs` of a completion: over the echoed prompt's tokens (`prompt`,
    None without echo; the first has no logprob, as nothing came before it) then the generated
    ones, with `count` top entries each and each token's offset in the choice's text."""
    tokens = [*(prompt or ()), *generated]
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    offset, echoed = 0, len(prompt or ())
    for index, token in enumerate(tokens):
        text_offset.append(offset)
        offset += len(token)
        if index == 0 and echoed:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        previous = tokens[index - 1] if index else ""
        logprob, top = _position(previous, token, alternatives, count, index >= echoed)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def prompt_logprobs(prompt_ids: Sequence[int], logprobs: dict[str, Any]) -> list[Any]:
    """vLLM's `choices[].prompt_logprobs` beside an echoed prompt's logprobs: per prompt token
    (None for the first) its id with its logprob, its rank among the position's entries and its
    text, from the same figures as `completion_logprobs`."""
    entries: list[Any] = []
    for index, token_id in enumerate(prompt_ids):
        logprob = logprobs["token_logprobs"][index]
        top = logprobs["top_logprobs"][index]
        if logprob is None or top is None:
            entries.append(None)
            continue
        rank = 1 + sum(1 for value in top.values() if value > logprob)
        text = logprobs["tokens"][index]
        entries.append({str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": text}})
    return entries
