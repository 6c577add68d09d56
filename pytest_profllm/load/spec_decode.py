"""Speculative decoding over a load's window: vLLM's counters of drafts and accepted tokens,
as their change between the /metrics scrapes before and after the load.

vLLM 0.32 (`vllm/v1/spec_decode/metrics.py`, `SpecDecodingProm`) counts, where the server
speculates: `vllm:spec_decode_num_drafts` (a draft: one request's draft tokens verified in one
step), `_num_draft_tokens`, `_num_accepted_tokens` and `_num_accepted_tokens_per_pos`
(label `position`, 0 to k-1), each with prometheus_client's `_total`. From them, as vLLM's
own log line (`SpecDecodingLogging.log`) and its PromQL notes say: the acceptance rate is
accepted / draft tokens, the mean acceptance length 1 + accepted / drafts (the bonus token
included), and a position's acceptance rate its accepted tokens / drafts.

A server that does not speculate has none of these counters: the figures are null and the
problem says so, as it does for a window without drafts, a scrape missing or unread, and a
counter that went back (a restart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_profllm.load.scrape import labelled_key, left_out, unread_reason, usable

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
POSITION_LABEL = "position"
COUNTERS = (DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS)
# More positions than this are no draft anyone serves (the simulator refuses more than 64):
# past it, the scrape's positions are not read.
MAX_POSITIONS = 64
NOT_SPECULATING = "the server did not speculate (its /metrics has no vllm:spec_decode_* counters)"
NOT_SPECULATING_SIM = "the engine did not speculate (no speculative_config)"  # virtual clock

FIGURES = (
    "server_spec_decode_num_drafts",
    "server_spec_decode_num_draft_tokens",
    "server_spec_decode_num_accepted_tokens",
    "server_spec_decode_acceptance_rate",
    "server_spec_decode_mean_acceptance_length",
    "server_spec_decode_acceptance_rate_per_position",
    "server_spec_decode_problem",
)


def _positions(scraped: Mapping[str, float]) -> dict[int, float]:
    """The per-position accepted counts a scrape has, by position."""
    found: dict[int, float] = {}
    for position in range(MAX_POSITIONS):
        value = scraped.get(labelled_key(ACCEPTED_PER_POSITION, POSITION_LABEL, str(position)))
        if value is None:
            break
        found[position] = value
    return found


def spec_decode_figures(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, Any]:
    """The record's speculative decoding figures over the window between two scrapes
    (`FIGURES`): counts, acceptance rate, mean acceptance length and the acceptance rate per
    draft position; null where there are none, with `server_spec_decode_problem` saying why."""
    figures: dict[str, Any] = dict.fromkeys(FIGURES)

    def none(problem: str) -> dict[str, Any]:
        figures["server_spec_decode_problem"] = problem
        return figures

    if after is None:
        return none("no /metrics scrape after the load")
    now = usable(after)
    if now is None:
        return none(f"the server's /metrics after the load {unread_reason(after)}")
    for name in (*COUNTERS, ACCEPTED_PER_POSITION):
        why = left_out(after, name) or left_out(before, name)
        if why is not None:
            return none(f"{name} left out of the server's /metrics ({why})")
    if not any(name in now for name in COUNTERS):
        return none(NOT_SPECULATING)
    then = usable(before)
    if then is None:
        why = f"it {unread_reason(before)}" if before is not None else "none was taken"
        return none(f"no /metrics scrape before the load ({why}): the window has no start")
    changes: dict[str, float] = {}
    for name in COUNTERS:
        change = now.get(name, 0.0) - then.get(name, 0.0)
        if change < 0:
            return none(f"{name} went back during the load (a restart?)")
        changes[name] = change
    drafts, drafted, accepted = (changes[name] for name in COUNTERS)
    positions_now, positions_then = _positions(now), _positions(then)
    per_position = [count - positions_then.get(position, 0.0)
                    for position, count in positions_now.items()]
    return figures_of(drafts, drafted, accepted, per_position)


def figures_of(
    drafts: float, drafted: float, accepted: float, per_position: Sequence[float]
) -> dict[str, Any]:
    """The record's figures (`FIGURES`) of speculative decoding's counts over a window:
    `drafts`, draft tokens `drafted`, `accepted` tokens and the accepted tokens at each draft
    position (empty: not counted)."""
    figures: dict[str, Any] = dict.fromkeys(FIGURES)
    if accepted > drafted:
        figures["server_spec_decode_problem"] = (
            f"{ACCEPTED_TOKENS} grew by {accepted:.0f}, more than the {drafted:.0f} draft "
            "tokens")
        return figures
    figures.update(
        server_spec_decode_num_drafts=drafts,
        server_spec_decode_num_draft_tokens=drafted,
        server_spec_decode_num_accepted_tokens=accepted,
    )
    if drafts == 0 or drafted == 0:
        figures["server_spec_decode_problem"] = (
            "the server speculates, but drafted nothing during the load")
        return figures
    # As vLLM's log line: the rate over draft tokens, the length over drafts with the bonus
    # token, and each position's accepted tokens over drafts.
    figures["server_spec_decode_acceptance_rate"] = accepted / drafted
    figures["server_spec_decode_mean_acceptance_length"] = 1 + accepted / drafts
    for position, change in enumerate(per_position):
        if not 0 <= change <= drafts:
            figures["server_spec_decode_problem"] = (
                f"{ACCEPTED_PER_POSITION} at position {position} changed by {change:.0f} "
                f"over {drafts:.0f} drafts: no rate per position")
            return figures
    figures["server_spec_decode_acceptance_rate_per_position"] = (
        [change / drafts for change in per_position] or None)
    return figures
