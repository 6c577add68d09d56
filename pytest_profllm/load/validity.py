"""What counts as a measurement: the one judge of a finished load.

Every path that measures (a serve case and its conversations, trace replays, multimodal and
pooling loads; a capacity probe and its re-check; the virtual clock; a Ray node, which runs
the same cases; `profllm bench`) hands its load to `judge`, and keeps what it returns: a
list of `Invalid` reasons, each with a kind from `InvalidKind`. Whether a load is measured
again is decided by the kinds (`Invalid.host_caused`), never by a reason's wording.

A rule that cannot be applied where the load ran (no `/metrics`, a server on another host,
no leased cores, the virtual clock) is not applied, and `Judgement.not_applied` says why:
`profllm bench` writes that into its result, so a reader knows what its `valid` rests on.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pytest_profllm.hosts.foreign_cpu import DEFAULT_MAX_FOREIGN_CPU, foreign_problem
from pytest_profllm.load import metrics
from pytest_profllm.load.schedule import LoadResult
from pytest_profllm.load.scrape import unread_reason, usable
from pytest_profllm.load.server_state import cache_problem, sim_fell_behind
from pytest_profllm.load.server_view import (
    DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
    MIN_JOINED_SHARE,
    load_view,
    overhead_problem,
    tail_problem,
)
from pytest_profllm.plan.suite import BenchmarkConfig

# A server's /metrics just before and just after a load (None where there is none;
# load/scrape.py's `Scraped` says why one could not be read).
ServerWindow = tuple[dict[str, float] | None, dict[str, float] | None]


class InvalidKind(enum.StrEnum):
    """Why a load is no measurement of the server, by rule."""

    CLIENT_DESCRIPTORS = "client_descriptors"  # the client could not open its connections
    TOKEN_COUNTS = "token_counts"  # the server's token counts cannot be believed
    CLIENT_FELL_BEHIND = "client_fell_behind"  # schedule lag, achieved rate, client CPU
    CLIENT_SATURATED = "client_saturated"  # the client's loop lag, its wait for a core
    SIMULATOR_LATENESS = "simulator_lateness"  # the simulated engine fell behind its clock
    CACHE = "cache"  # the prefix cache held an earlier load's prompts
    CLIENT_OVERHEAD = "client_overhead"  # the client added too much to the server's TTFT
    # ... to a request's TTFT at p99, by the requests' joined spans
    CLIENT_OVERHEAD_TAIL = "client_overhead_tail"
    FOREIGN_CPU = "foreign_cpu"  # processes outside the session used the load's cores
    BUDGET_SPENT = "budget_spent"  # the session's time for measuring again ran out
    SERVER_CHANGED = "server_changed"  # a capacity search's re-check missed its capacity
    HOST_LIMITED = "host_limited"  # a capacity search was bounded by a host-invalid probe

    @property
    def host_caused(self) -> bool:
        """Whether another run may find the host quieter: such a load is measured again."""
        return self in _HOST_CAUSED


_HOST_CAUSED = frozenset({
    InvalidKind.CLIENT_FELL_BEHIND,
    InvalidKind.CLIENT_SATURATED,
    InvalidKind.SIMULATOR_LATENESS,
    InvalidKind.CLIENT_OVERHEAD,
    InvalidKind.CLIENT_OVERHEAD_TAIL,
    InvalidKind.FOREIGN_CPU,
})


@dataclass(frozen=True)
class Invalid:
    """One reason a load is no measurement: its rule, and the line the user reads."""

    kind: InvalidKind
    text: str

    @property
    def host_caused(self) -> bool:
        return self.kind.host_caused

    def __str__(self) -> str:
        return self.text


def texts(reasons: list[Invalid]) -> list[str]:
    return [reason.text for reason in reasons]


@dataclass(frozen=True)
class Rules:
    """The bounds a load is judged by, and where it ran (what decides which rules apply)."""

    # The client's p99 schedule lag and its event loop's p99 lag (None:
    # metrics.MAX_P99_SCHEDULE_LAG_S).
    max_schedule_lag_ms: float | None = None
    # None: the rule is off. The default grows with the server's own mean TTFT.
    max_client_overhead_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_MS
    # The same at p99 of the requests (their joined spans); None: the rule is off.
    max_client_overhead_p99_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS
    max_foreign_cpu: float | None = DEFAULT_MAX_FOREIGN_CPU  # None: the rule is off
    # The share of a load the client may wait for a core (None: the rule is off).
    max_client_wait: float | None = metrics.MAX_CLIENT_RUNQUEUE_WAIT_SHARE
    # The client's figures include a network where the server is elsewhere.
    server_on_this_host: bool = True
    virtual_clock: bool = False  # the engine model's own client: no host in the figures

    @property
    def lag_limit_ms(self) -> float:
        if self.max_schedule_lag_ms is None:
            return metrics.MAX_P99_SCHEDULE_LAG_S * 1000
        return self.max_schedule_lag_ms


# A suite's case's rules where the session sets none.
DEFAULT_RULES = Rules()


@dataclass(frozen=True)
class LoadFacts:
    """What a finished load measured, as the judge needs it."""

    load: LoadResult
    config: BenchmarkConfig
    health: Mapping[str, Any]  # metrics.client_health
    # vLLM's metrics of the load (means for the overhead), and where requests were traced
    # what the client added to each at p50, p90, p99 (load/trace_join.py)
    results: Mapping[str, Any]
    own_hits: int = 0  # what the prompts find of each other in a cold cache
    foreign_share: float | None = None  # others' share of the load's cores (None: not watched)
    # The share of the completed requests whose server span was joined (None: not traced),
    # and why none was.
    spans_joined_share: float | None = None
    spans_problem: str | None = None
    # The server's own p99 TTFT (ms) over the joined spans: exact, preferred to the one the
    # TTFT histogram's buckets interpolate (None: no span with a TTFT was joined).
    spans_server_ttft_p99_ms: float | None = None


@dataclass
class Judgement:
    """The judge's answer: why the load is invalid (empty: it is valid), and the rules it
    could not apply here, each with why."""

    reasons: list[Invalid] = field(default_factory=list)
    not_applied: dict[str, str] = field(default_factory=dict)
    # Where the gap between the client's TTFT and the server's own was over its bound and
    # was not held against the client: why (`outside_client`); None where it was not.
    outside_client: str | None = None

    @property
    def valid(self) -> bool:
        return not self.reasons

    @property
    def validity(self) -> str:
        return "valid" if self.valid else "invalid"

    def line(self) -> str | None:
        """The reasons as one line, or None for a valid load."""
        return "; ".join(texts(self.reasons)) or None


def judge(facts: LoadFacts, window: ServerWindow, rules: Rules) -> Judgement:
    """Every rule of what counts as a measurement, applied to one finished load."""
    out = Judgement()

    def rule(kind: InvalidKind, text: str | None) -> None:
        if text:
            out.reasons.append(Invalid(kind, text))

    load, config, health = facts.load, facts.config, facts.health
    rule(InvalidKind.CLIENT_DESCRIPTORS,
         metrics.client_out_of_descriptors(load.outcomes, load.open_file_limit))
    rule(InvalidKind.TOKEN_COUNTS, metrics.inconsistent_counts(load.outcomes, config.ignore_eos))
    if rules.virtual_clock:
        out.not_applied[InvalidKind.CLIENT_FELL_BEHIND] = (
            "the virtual clock's client keeps its schedule by construction")
        out.not_applied[InvalidKind.CLIENT_SATURATED] = (
            "the virtual clock's client has no event loop and no core to wait for")
    else:
        rule(InvalidKind.CLIENT_FELL_BEHIND,
             metrics.client_fell_behind(health, rules.max_schedule_lag_ms))
        rule(InvalidKind.CLIENT_SATURATED,
             metrics.client_saturated(health, rules.max_schedule_lag_ms, rules.max_client_wait))
    before, after = window
    if usable(before) is None or usable(after) is None:
        unread = after if usable(after) is None else before
        why = ("the virtual clock has no server" if rules.virtual_clock
               else f"the server's /metrics {unread_reason(unread)} around the load")
        for kind in (InvalidKind.SIMULATOR_LATENESS, InvalidKind.CACHE,
                     InvalidKind.CLIENT_OVERHEAD):
            out.not_applied[kind] = why
    else:
        rule(InvalidKind.SIMULATOR_LATENESS, sim_fell_behind(before, after, rules.lag_limit_ms))
        rule(InvalidKind.CACHE, cache_problem(before, after, config, facts.own_hits))
        _overhead(out, facts, window, rules)
    _overhead_tail(out, facts, window, rules)
    if facts.foreign_share is None:
        out.not_applied[InvalidKind.FOREIGN_CPU] = (
            "the virtual clock runs on no host's cores" if rules.virtual_clock
            else "no load cores were leased apart from the server's, so others' use of them "
                 "is not told apart")
    else:
        rule(InvalidKind.FOREIGN_CPU, foreign_problem(facts.foreign_share, rules.max_foreign_cpu))
    return out


def _overhead(out: Judgement, facts: LoadFacts, window: ServerWindow, rules: Rules) -> None:
    """What the client added to the server's own mean TTFT, judged where the server is on
    this host (elsewhere the figure includes the network, and is only reported)."""
    if not rules.server_on_this_host:
        out.not_applied[InvalidKind.CLIENT_OVERHEAD] = (
            "the server is on another host: the client's overhead includes the network")
        return
    view, _ = load_view(window[0], window[1], facts.results)
    server_ttft = view.get("server_ttft_mean_ms")
    # The default bound grows with the server's own TTFT; one the user set holds as set.
    default_bound = rules.max_client_overhead_ms == DEFAULT_MAX_CLIENT_OVERHEAD_MS
    text = overhead_problem(
        {**facts.results, **view}, rules.max_client_overhead_ms,
        float(server_ttft) if default_bound and isinstance(server_ttft, int | float) else None,
    )
    if text and rules.max_client_overhead_ms is not None:
        cleared = outside_client(facts.health, rules.max_client_overhead_ms,
                                 facts.results.get("client_overhead_ttft_ms"), "mean TTFT")
        if cleared:
            out.outside_client = cleared
        else:
            out.reasons.append(Invalid(InvalidKind.CLIENT_OVERHEAD, text))


def _overhead_tail(
    out: Judgement, facts: LoadFacts, window: ServerWindow, rules: Rules
) -> None:
    """What the client added to a request's TTFT at p99, judged where nearly every request's
    server span was joined to its row and the server is on this host."""
    kind = InvalidKind.CLIENT_OVERHEAD_TAIL
    share = facts.spans_joined_share
    p99 = facts.results.get("client_overhead_ttft_p99_ms")
    if rules.virtual_clock:
        out.not_applied[kind] = "the virtual clock has no server to trace"
    elif not rules.server_on_this_host:
        out.not_applied[kind] = (
            "the server is on another host: the client's overhead includes the network")
    elif share is None:
        out.not_applied[kind] = facts.spans_problem or "requests were not traced"
    elif share < MIN_JOINED_SHARE:
        out.not_applied[kind] = (
            f"only {share:.1%} of the completed requests' server spans were joined (under "
            f"{MIN_JOINED_SHARE:.0%}): the mean's rule applies alone")
    elif not isinstance(p99, int | float):
        out.not_applied[kind] = "the load has no TTFT (a pooling load)"
    else:
        server_p99 = None
        # The default bound grows with the server's own p99 TTFT; one set holds as set. The
        # joined spans' p99 is exact; the histogram's, interpolated within a bucket, is the
        # fallback where the spans carry no TTFT.
        if rules.max_client_overhead_p99_ms != DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS:
            pass
        elif facts.spans_server_ttft_p99_ms is not None:
            server_p99 = facts.spans_server_ttft_p99_ms
        elif usable(window[0]) is not None and usable(window[1]) is not None:
            view, _ = load_view(window[0], window[1], facts.results)
            found = view.get("server_ttft_p99_ms")
            server_p99 = float(found) if isinstance(found, int | float) else None
        text = tail_problem(facts.results, rules.max_client_overhead_p99_ms, server_p99)
        if text and rules.max_client_overhead_p99_ms is not None:
            cleared = outside_client(facts.health, rules.max_client_overhead_p99_ms, p99,
                                     "TTFT at p99")
            if cleared:
                out.outside_client = cleared
            else:
                out.reasons.append(Invalid(kind, text))


# What the client itself adds to a message it reads when its loop is on time: parsing the
# event and stamping it (well under a ms a message at 1,000 streams, benchmarks/perf/
# client_cpu.py); counted on top of the loop's lateness below.
CLIENT_HANDLING_MS = 1.0


def outside_client(
    health: Mapping[str, Any], bound_ms: float, gap_ms: Any, what: str
) -> str | None:
    """Why a gap over its bound between the client's TTFT and the server's own (`gap_ms` on
    `what`) is not the client's, or None where it may be.

    The client stamps a message when its event loop gets to the bytes, so what it adds to a
    request is at most how late its loop ran then, and its own handling: a load whose loop
    was never late by the bound (`client_loop_lag_max_ms`, every moment of the load watched,
    load/client_watch.py) cannot have had the bound added by the client. The gap is then
    the server's own, before and after the span it reports: vLLM stamps a request's arrival
    after its API server has read and tokenized it, and on vLLM's CPU build at 256 streams
    that front end added 185-312 ms at p99 while the client's loop was never more than
    12 ms late (docs/how-a-case-is-measured.md). Where the loop was not watched (None), the
    gap is held against the client, as before the watch."""
    lag_max = health.get("client_loop_lag_max_ms")
    if not isinstance(lag_max, int | float) or lag_max + CLIENT_HANDLING_MS >= bound_ms:
        return None
    gap = f"{gap_ms:.1f} ms" if isinstance(gap_ms, int | float) else "the gap"
    return (f"{gap} between the client's {what} and the server's own is over the bound, and "
            f"not the client's: its event loop was never more than {lag_max:.1f} ms late "
            f"(under the {bound_ms:g} ms bound), so the time is the server's, outside what it "
            "reports (its API front end)")


def on_this_host(base_url: str) -> bool:
    """Whether `base_url` names this host (loopback), where the client's overhead over the
    server's own figures is the client's alone."""
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
