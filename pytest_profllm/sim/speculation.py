"""The simulated engine's speculative decoding: `--speculative-config` as vLLM takes it (JSON
with `method` and `num_speculative_tokens` k), a draft of k tokens per decoding sequence per
step, and the prefix of it the target model accepts.

Whether a draft token is accepted depends on the prompts and the draft method, which the
simulator does not have: it draws it. Position i's draft token (1 to k) is accepted with
probability `acceptance[i-1]` once the tokens before it were, so a step emits the accepted
prefix and one more token (the target's own, vLLM's bonus token). The probabilities are a
default per method (`DEFAULT_ACCEPTANCE`), or the simulator's own knob
`--sim-spec-acceptance P1,P2,...` (also `PROFLLM_SIM_SPEC_ACCEPTANCE`), whose last value
repeats for the positions past it. Verifying the k draft tokens costs the step their compute
(sim/cost.py `StepWork.spec_tokens`); proposing them costs nothing (ngram looks up the prompt on
the CPU while the GPU runs).

The counters are vLLM 0.32's (`vllm/v1/spec_decode/metrics.py` `SpecDecodingStats`): a draft
per decoding sequence per step, its k draft tokens, the accepted ones, and the accepted ones
per position (`/metrics` labels them `position` 0 to k-1).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field

ACCEPTANCE_ENV = "PROFLLM_SIM_SPEC_ACCEPTANCE"
# The chance that each position's draft token is accepted, the ones before it accepted, by
# draft method; the last value repeats. Round figures of the simulator's own, in the range
# vLLM's logs show for chat prompts (ngram finds fewer matches than a trained draft model,
# whose first token is accepted most often); a suite measures its own prompts on vLLM.
DEFAULT_ACCEPTANCE: dict[str, tuple[float, ...]] = {
    "ngram": (0.6, 0.5, 0.4),
    "suffix": (0.6, 0.5, 0.4),
    "eagle": (0.8, 0.7, 0.6),
    "eagle3": (0.8, 0.7, 0.6),
    "mtp": (0.85, 0.7, 0.6),
    "medusa": (0.7, 0.5, 0.4),
    "draft_model": (0.75, 0.6, 0.5),
}
FALLBACK_ACCEPTANCE = (0.7, 0.5, 0.4)  # a method the table does not name
MAX_SPECULATIVE_TOKENS = 64  # more is no configuration anyone serves; the simulator refuses it


class SpeculationError(ValueError):
    """A `--speculative-config` or acceptance knob the simulator cannot take (one line)."""


def parse_acceptance(text: str) -> tuple[float, ...]:
    """`P1,P2,...`: each a probability in [0, 1]; SpeculationError otherwise."""
    values: list[float] = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise SpeculationError(
                f"expected probabilities like 0.8,0.6,0.4, got {text!r}"
            ) from None
        if not 0.0 <= value <= 1.0 or math.isnan(value):
            raise SpeculationError(f"each probability must lie in [0, 1], got {part.strip()!r}")
        values.append(value)
    return tuple(values)


@dataclass
class Speculation:
    """k draft tokens per decoding sequence per step, accepted position by position; vLLM's
    counters of them."""

    method: str
    num_speculative_tokens: int
    acceptance: tuple[float, ...]  # per position, each given the ones before it accepted
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        last = self.acceptance[-1] if self.acceptance else 0.0
        self.acceptance = tuple(
            self.acceptance[i] if i < len(self.acceptance) else last for i in range(k)
        )
        self.accepted_per_position = [0] * k

    def draft(self) -> int:
        """One draft of k tokens: how many the target accepts (a prefix), counted."""
        accepted = 0
        for probability in self.acceptance:
            if self.rng.random() >= probability:
                break
            self.accepted_per_position[accepted] += 1
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += self.num_speculative_tokens
        self.num_accepted_tokens += accepted
        return accepted

    def expected_length(self) -> float:
        """The mean acceptance length the probabilities make: 1 + the expected accepted."""
        length, survive = 1.0, 1.0
        for probability in self.acceptance:
            survive *= probability
            length += survive
        return length


def speculation_from(
    config_json: str | None, acceptance: str | None = None, seed: int = 0
) -> Speculation | None:
    """The speculation `--speculative-config` asks for (None: none), with the acceptance of
    `acceptance` (`P1,P2,...`), else of `PROFLLM_SIM_SPEC_ACCEPTANCE`, else the method's
    default. SpeculationError (one line) where it cannot be read."""
    if not config_json:
        return None
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as error:
        raise SpeculationError(f"not JSON: {error}") from None
    if config is None:
        return None
    if not isinstance(config, dict):
        raise SpeculationError(f"expected a JSON object, got {config_json!r}")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpeculationError(
            f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, "
            f"got {k!r}"
        )
    method = config.get("method") or ("draft_model" if config.get("model") else "ngram")
    if not isinstance(method, str):
        raise SpeculationError(f"method must be a name, got {method!r}")
    knob = acceptance if acceptance is not None else os.environ.get(ACCEPTANCE_ENV, "").strip()
    probabilities = (
        parse_acceptance(knob) if knob
        else DEFAULT_ACCEPTANCE.get(method, FALLBACK_ACCEPTANCE)
    )
    return Speculation(method, k, probabilities, random.Random(seed))
