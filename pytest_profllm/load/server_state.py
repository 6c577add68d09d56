"""What a server carries from one load to the next, and what it says of itself over one load.

A server answers a prompt it has seen from its prefix cache: a case that follows another on
the same server, a repeat or a capacity probe would measure the cache left by the one before.
`empty_caches` empties it (vLLM's `POST /reset_prefix_cache`, served where the server runs with
`VLLM_SERVER_DEV_MODE=1`, which the plugin sets for the servers it starts; the simulated
engine serves the same route). Two scrapes of `/metrics` around a load then say what the cache
did within it (`cache_problem`), and whether the simulated engine kept its own clock
(`sim_lateness`, `sim_fell_behind`).
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pytest_profllm.engine.secrets import bearer
from pytest_profllm.load.scrape import Scraped as Scraped
from pytest_profllm.load.scrape import scrape_metrics as scrape_metrics
from pytest_profllm.load.scrape import usable
from pytest_profllm.plan.suite import BenchmarkConfig

# vLLM 0.33.0's names (vllm/v1/metrics/loggers.py); counters carry prometheus_client's `_total`.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
# The simulated engine's own (sim/instruments.py): steps run, and steps that ended more than
# so many milliseconds after they were due, by the real-time step loop.
SIM_STEPS = "profllm:sim_steps_total"
SIM_LATENESS_SUM = "profllm:sim_step_lateness_seconds_total"
SIM_LATE_BOUNDS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def sim_late_name(bound_ms: int) -> str:
    return f"profllm:sim_steps_late_over_{bound_ms}ms_total"


# A workload that shares no prefix on purpose may still find a little of itself in the cache
# (a chat template's opening tokens, two prompts that happen to start alike); more than this
# share of its prompt tokens means it measured what an earlier load left behind.
MAX_UNINTENDED_HIT_RATE = 0.05
# The share of the simulated engine's steps allowed to end later than the lateness limit; and
# how many late steps it takes at least to decide it: one hiccup of the host makes the step
# after it late too (it catches up), and in a short load two steps are over 1 % of them.
SIM_LATE_STEP_SHARE = 0.01
SIM_MIN_LATE_STEPS = 3
_RESET_TIMEOUT_S = 30.0


# vLLM's cache configuration as an info metric (a gauge of 1 whose labels carry the facts):
# the KV cache's blocks, their size in tokens and (vLLM 0.32 has it) its capacity in tokens, as the
# engine sized them at start. `scrape_metrics` (load/scrape.py) keeps such labels as NAME.LABEL.
CACHE_INFO = "vllm:cache_config_info"
KV_BLOCKS = f"{CACHE_INFO}.num_gpu_blocks"
KV_BLOCK_SIZE = f"{CACHE_INFO}.block_size"
KV_TOKENS = f"{CACHE_INFO}.kv_cache_size_tokens"


@dataclass(frozen=True)
class CacheState:
    """How a load found the server's caches: `emptied` before it, kept warm on purpose, or not
    emptied (`problem` says why)."""

    state: str  # "emptied", "warm" or "not emptied"
    problem: str | None = None

    def describe(self) -> str:
        if self.state == "emptied":
            return "emptied before the load"
        if self.state == "warm":
            return "kept warm (warm_cache: true)"
        return f"not emptied: {self.problem}"


def empty_caches(
    base_url: str, config: BenchmarkConfig, api_key: str | None = None
) -> CacheState:
    """Empties the server's prefix cache (and its multimodal cache, where the workload sends
    media) unless the workload keeps it warm; what was done, never an exception."""
    if config.warm_cache:
        return CacheState("warm")
    problem = _post(base_url, "/reset_prefix_cache", api_key)
    if problem is None and config.dataset_name in _MEDIA:
        # A server without a multimodal cache route (a text model's) has nothing to empty.
        mm_problem = _post(base_url, "/reset_mm_cache", api_key)
        if mm_problem is not None and "404" not in mm_problem:
            problem = mm_problem
    return CacheState("emptied") if problem is None else CacheState("not emptied", problem)


_MEDIA = ("random-mm", "custom_image", "custom_audio")


def _post(base_url: str, path: str, api_key: str | None) -> str | None:
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}{path}",
        data=b"",
        method="POST",
        headers=bearer(api_key),
    )
    try:
        with urllib.request.urlopen(request, timeout=_RESET_TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return (
                f"POST {path} answered 404 (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"
            )
        return f"POST {path} answered {error.code}: {_short(error.read())}"
    except (OSError, ValueError) as error:
        return f"POST {path} failed: {error}"
    # vLLM answers 200 either way; `{"success": false}` when blocks were still in use (older
    # versions answer an empty body on success).
    with contextlib.suppress(ValueError):
        said = json.loads(body or b"{}")
        if isinstance(said, dict) and said.get("success") is False:
            return f"POST {path}: the server could not empty it (requests still running)"
    return None


def _short(body: bytes) -> str:
    text = body.decode(errors="replace").strip()
    try:
        said = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(said, dict):
        message = said.get("message") or said.get("detail") or (said.get("error") or {})
        if isinstance(message, dict):
            message = message.get("message")
        if message:
            return str(message)[:200]
    return text[:200]


# The datasets whose prompts the tool draws itself, sharing nothing unless a key says so. A
# file's prompts (sharegpt, custom, images, traces) may share a system prompt or an image on
# purpose: their cache figures are reported, never judged.
_DRAWN_APART = ("random", "random-mm", "burstgpt")


def shared_on_purpose(config: BenchmarkConfig) -> str | None:
    """Why the workload's own prompts may share prefixes (what a cold cache still finds
    within the load), or None where they share none by construction."""
    if config.warm_cache:
        return "warm_cache: true"
    if config.dataset_name == "prefix_repetition":
        return "prefix_repetition prompts share prefixes"
    if config.dataset_name == "conversation":
        return "a conversation's turns re-send its history"
    if config.dataset_name == "timed_trace":
        return "a trace's hash_ids name shared blocks"
    if config.random_prefix_len and config.dataset_name in ("random", "random-mm"):
        return "random_prefix_len is a shared prefix"
    if config.dataset_name not in _DRAWN_APART:
        return f"{config.dataset_name} prompts come from a file, which may share them"
    return None


# The block size of vLLM's prefix cache on a GPU (and the simulator's): a prompt's full blocks
# are what a cache can find.
CACHE_BLOCK_TOKENS = 16


def own_prefix_hits(prompts: Iterable[Sequence[int]], block: int = CACHE_BLOCK_TOKENS) -> int:
    """The prompt tokens a cold cache could find within the load itself: sent in this order,
    the full blocks each prompt shares from its start with an earlier one (random prompts of
    a small vocabulary start alike now and then; thousands of them, often). An upper bound:
    a prompt sent before the earlier one's prefill ends finds less."""
    seen: set[int] = set()
    hits = 0
    for ids in prompts:
        parent, matching = 0, True
        usable = (len(ids) - 1) // block  # the last token is always computed
        for index in range(len(ids) // block):
            parent = hash((parent, tuple(ids[index * block : (index + 1) * block])))
            matching = matching and index < usable and parent in seen
            hits += block if matching else 0
            seen.add(parent)
    return hits


def cache_problem(
    before: dict[str, float] | None,
    after: dict[str, float] | None,
    config: BenchmarkConfig,
    own_hits: float = 0.0,
) -> str | None:
    """Why a load's figures measure an earlier load's prefix cache, or None: a workload that
    shares nothing on purpose found more than 5 % of its prompt tokens in the cache, beyond
    the `own_hits` its prompts could find in each other (`own_prefix_hits`)."""
    before, after = usable(before), usable(after)
    if shared_on_purpose(config) is not None or before is None or after is None:
        return None
    queries = after.get(PREFIX_QUERIES, 0.0) - before.get(PREFIX_QUERIES, 0.0)
    hits = after.get(PREFIX_HITS, 0.0) - before.get(PREFIX_HITS, 0.0)
    # Counters that went back (a restart), or more hits than lookups: nothing to judge by.
    if queries <= 0 or not 0 <= hits <= queries:
        return None
    if (hits - own_hits) / queries <= MAX_UNINTENDED_HIT_RATE:
        return None
    own = f"; {own_hits:.0f} of them its prompts share with each other" if own_hits else ""
    return (
        f"prefix cache: {hits / queries:.1%} of the prompt tokens were found in the server's "
        f"cache ({hits:.0f} of {queries:.0f}{own}), over {MAX_UNINTENDED_HIT_RATE:.0%} beyond "
        "what the workload shares: the figures measure what an earlier load left"
    )


def sim_lateness(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None]:
    """The simulated engine's steps over a load and how late they ended: the mean, and the
    lateness that at most 1 % of the steps exceeded (to the next of its bounds; None beyond
    the last). Empty figures where the server is not the simulated engine, and where its
    counters went back (a restart)."""
    empty: dict[str, float | None] = {"sim_steps": None, "sim_step_lateness_mean_ms": None,
                                      "sim_step_lateness_p99_ms": None}
    before, after = usable(before), usable(after)
    if before is None or after is None or SIM_STEPS not in after:
        return empty
    steps = after[SIM_STEPS] - before.get(SIM_STEPS, 0.0)
    lateness = after.get(SIM_LATENESS_SUM, 0.0) - before.get(SIM_LATENESS_SUM, 0.0)
    late = [after.get(sim_late_name(bound), 0.0) - before.get(sim_late_name(bound), 0.0)
            for bound in SIM_LATE_BOUNDS_MS]
    if steps < 0 or lateness < 0 or min(late) < 0:
        return empty
    p99: float | None = None
    for bound, count in zip(SIM_LATE_BOUNDS_MS, late, strict=True):
        if steps <= 0 or count / steps <= SIM_LATE_STEP_SHARE:
            p99 = float(bound)
            break
    return {
        "sim_steps": steps,
        "sim_step_lateness_mean_ms": lateness / steps * 1000 if steps > 0 else None,
        "sim_step_lateness_p99_ms": p99,
    }


def sim_fell_behind(
    before: dict[str, float] | None, after: dict[str, float] | None, limit_ms: float
) -> str | None:
    """Why the simulated engine's figures measure a busy host, or None: over 1 % of its steps,
    and three or more, ended more than `limit_ms` after they were due (its tokens came that
    much late)."""
    before, after = usable(before), usable(after)
    if before is None or after is None or SIM_STEPS not in after:
        return None
    steps = after[SIM_STEPS] - before.get(SIM_STEPS, 0.0)
    if steps <= 0:
        return None
    worst: tuple[int, float] | None = None
    for bound in SIM_LATE_BOUNDS_MS:
        late = after.get(sim_late_name(bound), 0.0) - before.get(sim_late_name(bound), 0.0)
        if bound >= limit_ms and late / steps > SIM_LATE_STEP_SHARE and (
            late >= SIM_MIN_LATE_STEPS
        ):
            worst = (bound, late / steps)
    if worst is None:
        return None
    bound, share = worst
    return (
        f"the simulated engine fell behind by {bound} ms or more on {share:.1%} of its "
        f"{steps:.0f} steps (host busy)"
    )


def empty_prefix_cache(base_url: str, api_key: str | None = None) -> CacheState:
    """Empties the server's prefix cache before a load that sends no media and never keeps
    it warm (an accuracy case's evaluation); what was done, never an exception."""
    problem = _post(base_url, "/reset_prefix_cache", api_key)
    return CacheState("emptied") if problem is None else CacheState("not emptied", problem)
