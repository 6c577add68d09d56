"""The server's own view of a load: vLLM's latency histograms over the load's window.

vLLM 0.33 (`vllm/v1/metrics/loggers.py`; timestamps in `vllm/v1/metrics/stats.py`) keeps a
histogram per request phase: arrival to first token (TTFT), arrival to last token (E2E),
queued to scheduled (queue), scheduled to first token (prefill), first to last token (decode),
scheduled to last token (inference), and the gaps between tokens. Two scrapes of `/metrics`
around a load (`scrape_metrics` keeps each bucket by its `le`, summed over the engines) give
each histogram's change over the load: its `_sum`/`_count` an exact mean, its buckets the
quantiles to within a bucket (estimated as Prometheus' `histogram_quantile` does: linearly
within the bucket the rank falls in).

`client_overhead` is what the client and the HTTP path added: the client's mean less the
server's. `overhead_problem` makes a case whose client added more than the bound an invalid
measurement, which the host caused (measured again, load/attempts.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_profllm.load.scrape import left_out, unread_reason, usable

# (short name, vLLM's histogram, the record's unit): seconds are kept in milliseconds.
HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("ttft", "vllm:time_to_first_token_seconds", "ms"),
    ("e2el", "vllm:e2e_request_latency_seconds", "ms"),
    ("queue", "vllm:request_queue_time_seconds", "ms"),
    ("prefill", "vllm:request_prefill_time_seconds", "ms"),
    ("decode", "vllm:request_decode_time_seconds", "ms"),
    ("inference", "vllm:request_inference_time_seconds", "ms"),
    ("itl", "vllm:inter_token_latency_seconds", "ms"),
    ("tpot", "vllm:request_time_per_output_token_seconds", "ms"),
    ("iteration_tokens", "vllm:iteration_tokens_total", "tokens"),
    ("preemptions", "vllm:request_num_preemptions", "preemptions"),
)
QUANTILES: tuple[tuple[str, float], ...] = (("median", 0.5), ("p90", 0.9), ("p99", 0.99))
_STATISTICS = ("mean", *(name for name, _ in QUANTILES))

# The default bound on what the client (and the API server's work outside vLLM's
# histograms: reading the request, streaming the answer) may add to the server's mean TTFT
# before the figures measure the host (--profllm-max-client-overhead sets it). Measured on
# the simulated engine on 2 shared cores (benchmarks/perf/client_overhead.py and the smoke
# suite): 1.0-1.8 ms at concurrency 1, 4.2-6.0 ms at 16, 12-16 ms for a burst of 32, all
# valid runs; 39-275 ms at 256, where the host could not keep up (the simulator fell behind
# too). vLLM measured its own Python client at 8-12 ms (concurrency 8, PR #54628). 50 ms is
# three times the largest valid figure, so a burst on a small host passes, and a client the
# host starved (tens to hundreds of ms) does not.
DEFAULT_MAX_CLIENT_OVERHEAD_MS = 50.0
# Under a heavy load the API server's own share grows with the server's queue: vLLM's CPU
# build at 256 streams on an idle host added 62-63 ms to a server mean TTFT of 566-581 ms
# (11 %; benchmarks/perf/client_overhead.py, docs/developing/performance.md), over the 50 ms
# above though nothing on the host was busy. So the default bound is the larger of the 50 ms
# and this share of the server's own mean TTFT: a passing figure is never more than 15 % over
# it. A bound the user sets (--profllm-max-client-overhead) is used as it is.
MAX_CLIENT_OVERHEAD_SHARE = 0.15
# The default bound on what the client added to a request's TTFT at p99, where each
# request's server span was joined to its row (--profllm-trace-requests; load/trace_join.py;
# --profllm-max-client-overhead-tail sets it). The mean bound above misses a client-made tail:
# on a paced server at 1,000 streams the p50 was 3-6 ms, the p99 111-127 ms, and the load
# passed. Measured on the simulated engine on 2 shared cores (load average 8-9), the client
# pinned to one core, 2-3 runs each (benchmarks/perf/client_overhead_tail.py; the table is
# in docs/how-a-case-is-measured.md), p99: alone, 4.8-18 ms at concurrency 1, 4.1-23 ms at
# 16, 15-138 ms for a burst of 32, 53-133 ms at 64, 276-1,272 ms at 256; with a busy loop
# on the client's core, 10-111 ms at 1, 9-50 ms at 16. Without the hog, a run whose mean the
# mean's rule passes had a p99 of 53 ms at most; with it, up to 60 and 111 ms at concurrency
# 1 (medians 12 ms): the tail this rule is for. 100 ms is about twice that 53 ms, so a busy
# but fair host passes, and a tail over a hundred ms does not. On a busy host the hog's
# effect is not steady (its runs overlap the quiet ones): the rule bounds the tail, it does
# not find every hog. As the mean's, the default grows to MAX_CLIENT_OVERHEAD_SHARE of the
# server's own p99 TTFT where that is more. A gap over it counts against the client only
# where its own loop was that late (load/validity.py `outside_client`).
DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS = 100.0
# The share of a load's completed requests whose span must be joined for the tail rule to
# be applied: fewer, and the spread is not the load's (the mean rule applies alone).
MIN_JOINED_SHARE = 0.99
# How far a client's mean may lie below the server's and still be the same requests' times:
# the client starts its clock before it sends and stops it after the bytes came back, the
# server stamps arrival after it read the request and the token before it sent it, so the
# client's interval contains the server's. What separates them is the clocks: vLLM stamps
# with time.time() (wall clock, which NTP may slew by up to 500 ppm: 0.5 ms over a 1 s
# latency) and both sides' resolution (microseconds); 1 ms covers both for latencies up to
# about a second. Measured on the simulated engine (one perf_counter clock), the client was
# never below the server: 0.97 ms over it at the least (benchmarks/perf/client_overhead.py).
CLOCK_NOISE_MS = 1.0
OVERHEAD_PREFIX = "the client added"


def missing(problem: str) -> dict[str, Any]:
    """The record's `server_view` block of a case that has none, saying why."""
    return {"problem": problem, "histograms": {}}


OVERHEAD_KEYS = ("client_overhead_ttft_ms", "client_overhead_e2el_ms")


def result_keys() -> list[str]:
    """The keys of the server's view (the record's `system.server_*`) and the client's
    overhead over it (`results.client_overhead_*`), in order."""
    keys: list[str] = []
    for short, _, unit in HISTOGRAMS:
        suffix = "_ms" if unit == "ms" else ""
        keys.append(f"server_{short}_count")
        keys += [f"server_{short}_{statistic}{suffix}" for statistic in _STATISTICS]
    return [*keys, *OVERHEAD_KEYS]


def bucket_key(name: str, bound: float) -> str:
    """The scrape's key of a histogram's cumulative bucket with upper bound `bound`."""
    return f"{name}_bucket@{bound!r}"


@dataclass(frozen=True)
class Histogram:
    """One histogram as one scrape has it: its count, its sum and its cumulative bucket counts
    by upper bound (the last +Inf)."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]


def read_histogram(scraped: Mapping[str, float], name: str) -> Histogram | str | None:
    """`name` as one scrape has it; why it cannot be believed (a text); or None where the
    scrape has no such histogram. A histogram is believed only as Prometheus defines one:
    finite, whole, never negative counts, buckets that only grow with their bound, and the
    +Inf bucket equal to the count."""
    why = left_out(scraped, name)
    if why is not None:
        return why
    count, total = scraped.get(f"{name}_count"), scraped.get(f"{name}_sum")
    if count is None:
        return None
    if total is None:
        return "it has a _count and no _sum"
    prefix = f"{name}_bucket@"
    buckets = tuple(sorted(
        (float(key[len(prefix):]), value) for key, value in scraped.items()
        if key.startswith(prefix)
    ))
    numbers = (("_count", count), ("_sum", total),
               *((f"_bucket {bound!r}", value) for bound, value in buckets))
    for what, value in numbers:
        if not math.isfinite(value) or value < 0:
            return f"its {what} is {value!r}"
    for what, value in numbers:
        if what != "_sum" and value != int(value):
            return f"its {what} is {value!r}, not a whole count"
    if not buckets:
        return Histogram(count, total, buckets)  # a mean without quantiles
    if not math.isinf(buckets[-1][0]):
        return "it has no +Inf bucket"
    for (bound, cumulative), (_, below) in zip(buckets[1:], buckets, strict=False):
        if cumulative < below:
            return (f"its buckets are not cumulative ({below:.0f} up to the one below "
                    f"{bound!r}, {cumulative:.0f} up to it)")
    if buckets[-1][1] != count:
        return f"its +Inf bucket ({buckets[-1][1]:.0f}) is not its _count ({count:.0f})"
    # Each observation is at least its bucket's lower bound: a smaller sum was never observed.
    # (prometheus_client adds to the sum before the bucket, so a scrape's sum may run ahead of
    # its buckets by an observation, never behind; floats' rounding is allowed for.)
    least = sum(lower * (cumulative - below) for (lower, below), (_, cumulative)
                in zip(((0.0, 0.0), *buckets), buckets, strict=False))
    if total < least * (1 - 1e-9):
        return f"its _sum ({total!r}) is less than its buckets hold at least ({least!r})"
    return Histogram(count, total, buckets)


@dataclass(frozen=True)
class Window:
    """One histogram's change over a window: count, sum and the cumulative bucket counts by
    upper bound (the last +Inf)."""

    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]
    reset: bool = False  # the counters went back: only what was counted since the restart


_NONE = Histogram(0.0, 0.0, ())


def histogram_window(
    before: Mapping[str, float] | None, after: Mapping[str, float], name: str
) -> Window | str | None:
    """`name`'s change between two scrapes; why it cannot be believed (a text); or None where
    the later one has no such histogram. Any of its counters that went back (its count, its
    sum, a bucket), or bounds that changed, mean the server restarted within the window: the
    later scrape is the window on its own, what the restarted server counted."""
    now = read_histogram(after, name)
    if now is None or isinstance(now, str):
        return now
    then = read_histogram(before, name) if before is not None else None
    if isinstance(then, str):
        return f"before the load, {then}"
    then = then or _NONE
    reset = then is not _NONE and (
        [bound for bound, _ in then.buckets] != [bound for bound, _ in now.buckets]
        or now.count < then.count or now.total < then.total
        or any(new < old for (_, new), (_, old) in zip(now.buckets, then.buckets, strict=True))
    )
    if reset:
        then = _NONE
    old = dict(then.buckets)
    buckets = tuple((bound, value - old.get(bound, 0.0)) for bound, value in now.buckets)
    for (bound, cumulative), (_, below) in zip(buckets[1:], buckets, strict=False):
        if cumulative < below:
            return (f"its buckets did not grow as one histogram's over the load (up to "
                    f"{bound!r}: {cumulative:.0f}, fewer than the {below:.0f} below it)")
    return Window(now.count - then.count, now.total - then.total, buckets, reset)


@dataclass(frozen=True)
class Estimate:
    value: float
    lower: float  # the bucket's bounds the estimate lies between
    upper: float  # +Inf where the rank fell beyond the last finite bound


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> Estimate | None:
    """The q-quantile of cumulative buckets, as Prometheus' `histogram_quantile`: linear
    within the bucket the rank falls in; the first bucket starts at 0 (vLLM's quantities are
    never negative); a rank in the +Inf bucket is the last finite bound. None without
    observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return Estimate(lower, lower, bound)
            share = (rank - below) / (cumulative - below)
            return Estimate(lower + (bound - lower) * share, lower, bound)
        lower, below = bound, cumulative
    return Estimate(lower, lower, math.inf)


def server_view(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """The server's view over a window: its figures (`result_keys`: the record's
    `system.server_*`, and the client's overhead left null for `load_view`) and the record's
    `server_view` block (each histogram's count, mean and quantiles with the bucket bounds they
    lie between, and the reason where there are none). A histogram that cannot be believed
    (load/scrape.py's rule, `read_histogram`'s) has null figures, and the problem says why."""
    figures, view, _ = _server_view(before, after)
    return figures, view


def _server_view(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> tuple[dict[str, float | None], dict[str, Any], list[str]]:
    """`server_view`, and the histograms whose counters went back within the window."""
    figures: dict[str, float | None] = dict.fromkeys(result_keys())
    if usable(after) is None:
        return figures, missing(f"the server's /metrics {unread_reason(after)}"), []
    assert after is not None
    # A scrape before the load that could not be read: as good as none, and the reason kept.
    before_unread = (unread_reason(before)
                     if before is not None and usable(before) is None else None)
    before = usable(before)
    histograms: dict[str, Any] = {}
    resets: list[str] = []
    unbelieved: list[str] = []
    for short, name, unit in HISTOGRAMS:
        window = histogram_window(before, after, name)
        if window is None:
            continue
        detail = window if isinstance(window, str) else _figures(short, unit, window, figures)
        if isinstance(detail, str):
            unbelieved.append(f"{short} ({detail})")
            continue
        resets += [short] if isinstance(window, Window) and window.reset else []
        histograms[short] = detail
    problems: list[str] = []
    if not histograms and not unbelieved:
        problems.append("the server's /metrics has none of vLLM's latency histograms (not vLLM?)")
    elif before is None:
        why = f" (it {before_unread})" if before_unread else ""
        problems.append(f"no /metrics scrape before the load{why}: the figures count since "
                        "the server began")
    if resets:
        problems.append(f"the server's counters went back during the load (a restart): "
                        f"{', '.join(resets)} count only since then")
    if unbelieved:
        problems.append("left out, not to be believed: " + "; ".join(unbelieved))
    return figures, {"problem": "; ".join(problems) or None, "histograms": histograms}, resets


def _figures(
    short: str, unit: str, window: Window, figures: dict[str, float | None]
) -> dict[str, Any] | str:
    """The record's figures of one histogram's window (written into `figures`) and its
    `server_view` entry; or why there are none (a figure past what a float holds)."""
    scale = 1000.0 if unit == "ms" else 1.0
    suffix = "_ms" if unit == "ms" else ""
    mean = window.total / window.count * scale if window.count > 0 else None
    found: dict[str, float | None] = {
        f"server_{short}_count": window.count, f"server_{short}_mean{suffix}": mean,
    }
    detail: dict[str, Any] = {"count": window.count, "mean": mean, "unit": unit}
    for label, q in QUANTILES:
        estimate = quantile(q, window.buckets)
        if estimate is None:
            detail[label] = None
            continue
        found[f"server_{short}_{label}{suffix}"] = estimate.value * scale
        detail[label] = {
            "estimate": estimate.value * scale,
            "lower": estimate.lower * scale,
            # JSON has no infinity: an open bucket's upper bound is null.
            "upper": None if math.isinf(estimate.upper) else estimate.upper * scale,
        }
    overflow = [key for key, value in found.items()
                if value is not None and not math.isfinite(value)]
    if overflow or any(
        not math.isfinite(value) for entry in detail.values() if isinstance(entry, dict)
        for value in entry.values() if value is not None
    ):
        return f"its figures pass what a float holds ({', '.join(overflow) or 'a bound'})"
    figures.update(found)
    return detail


def load_view(
    before: Mapping[str, float] | None,
    after: Mapping[str, float] | None,
    results: Mapping[str, Any],
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """`server_view` of a load's window with the client's overhead over it (`results`: the
    client's figures), and where the window holds other requests too, the view says so. A
    histogram that went back (a restart) counts only since then: no overhead is taken from it."""
    figures, view, resets = _server_view(before, after)
    figures.update(client_overhead({**results, **figures}))
    for metric in resets:
        if f"client_overhead_{metric}_ms" in figures:
            figures[f"client_overhead_{metric}_ms"] = None
    problems = [view["problem"], other_requests({**results, **figures})]
    for metric in ("ttft", "e2el"):
        overhead = figures[f"client_overhead_{metric}_ms"]
        if overhead is not None and overhead < -CLOCK_NOISE_MS:
            # The client's interval contains the server's: below it, the two did not time
            # the same requests (or a clock was stepped).
            problems.append(f"the client's mean {metric.upper()} is {-overhead:.1f} ms under "
                            "the server's, beyond clock noise: not the same requests' times")
    view["problem"] = "; ".join(problem for problem in problems if problem) or None
    return figures, view


def other_requests(results: Mapping[str, Any]) -> str | None:
    """Why the server's window is not this load's alone: it finished another number of
    requests than the client completed (warm-ups, another client on the server), so its
    means are not the load's and no overhead is taken from them. None: the same count."""
    served, completed = results.get("server_e2el_count"), results.get("completed")
    if not isinstance(served, int | float) or not isinstance(completed, int | float):
        return None
    if served == completed:
        return None
    return (f"the server finished {served:.0f} requests in the load's window, the client "
            f"completed {completed:.0f}: its means are not this load's alone")


def client_overhead(results: Mapping[str, Any]) -> dict[str, float | None]:
    """What the client and the HTTP path added to the server's mean TTFT and E2E (ms); null
    where the server's window holds other requests too (`other_requests`)."""
    out: dict[str, float | None] = dict.fromkeys(
        ("client_overhead_ttft_ms", "client_overhead_e2el_ms")
    )
    if other_requests(results) is not None:
        return out
    for metric in ("ttft", "e2el"):
        client, server = results.get(f"mean_{metric}_ms"), results.get(f"server_{metric}_mean_ms")
        out[f"client_overhead_{metric}_ms"] = (
            float(client) - float(server)
            if isinstance(client, int | float) and isinstance(server, int | float)
            else None
        )
    return out


def overhead_problem(
    results: Mapping[str, Any], bound_ms: float | None, server_ttft_mean_ms: float | None = None
) -> str | None:
    """Why the client's figures measure the client: it added more than the bound to the
    server's mean TTFT, the bound being the larger of `bound_ms` and
    MAX_CLIENT_OVERHEAD_SHARE of the server's own mean TTFT (None: within the bound, no
    bound, or no server view)."""
    overhead = results.get("client_overhead_ttft_ms")
    if bound_ms is None or not isinstance(overhead, int | float):
        return None
    return _over_bound(overhead, bound_ms, server_ttft_mean_ms, "", "mean TTFT")


def tail_problem(
    results: Mapping[str, Any], bound_ms: float | None, server_ttft_p99_ms: float | None = None
) -> str | None:
    """Why the client's figures measure the client at the tail: what it added to a request's
    TTFT at p99 (`client_overhead_ttft_p99_ms`, from the requests' joined spans) is over the
    bound, the larger of `bound_ms` and MAX_CLIENT_OVERHEAD_SHARE of the server's own p99
    TTFT (None: within it, no bound, or no such figure)."""
    overhead = results.get("client_overhead_ttft_p99_ms")
    if bound_ms is None or not isinstance(overhead, int | float) or not math.isfinite(overhead):
        return None
    return _over_bound(overhead, bound_ms, server_ttft_p99_ms, "p99 ", "a request's TTFT at p99")


def _over_bound(
    overhead: float, bound_ms: float, server_ms: float | None, server_figure: str, what: str
) -> str | None:
    """The problem line where `overhead` is over the larger of `bound_ms` and
    MAX_CLIENT_OVERHEAD_SHARE of the server's own figure (`server_ms`, its `server_figure`
    named in the line); None within it."""
    share = MAX_CLIENT_OVERHEAD_SHARE * (server_ms or 0.0)
    if overhead <= max(bound_ms, share):
        return None
    bound = (f"bound {bound_ms:g} ms" if share <= bound_ms else
             f"bound {share:.1f} ms, {MAX_CLIENT_OVERHEAD_SHARE:.0%} of the server's "
             f"{server_figure}{server_ms:.1f} ms")
    return f"{OVERHEAD_PREFIX} {overhead:.1f} ms to {what} ({bound}): host busy"
