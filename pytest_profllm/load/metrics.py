"""Serving metrics with the definitions of `vllm bench serve` (vllm/benchmarks/serve.py).

TTFT runs from a request's start to its first content message; ITL are the gaps between content
messages, pooled over requests; E2EL runs to the last content message; TPOT is
(E2EL - TTFT) / (output_tokens - 1) for requests with more than one output token. Failed requests
are left out of the statistics, but the duration that divides the throughputs includes them.
Percentiles use numpy's linear interpolation, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from pytest_profllm.load import client_watch
from pytest_profllm.load.client_watch import WatchFigures
from pytest_profllm.plan.metric_names import (
    LATENCY_METRICS,
    PROFLLM_ALIASES,
    percentile_key,
    percentiles_for,
)

K = TypeVar("K")


@dataclass
class RequestOutcome:
    """What the client saw of one request; times in seconds on a monotonic clock."""

    prompt_len: int
    success: bool = False
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # when it was sent (after any max_concurrency wait)
    intended_start: float = 0.0  # when the arrival schedule wanted it to arrive
    dispatch_time: float = 0.0  # when its task actually ran (before any max_concurrency wait)
    end_time: float = 0.0  # when the response ended (or failed)
    message_times: list[float] = field(default_factory=list)  # every content message
    status: int | None = None  # HTTP status, None where no response came
    generated_text: str = ""
    error: str = ""
    output_len: int | None = None  # the output tokens asked for (max_tokens)
    # The server's usage count where it is not a count (a string, negative): never believed.
    usage_problem: str | None = None
    # A conversation's requests (load/conversation.py): which conversation and which of its
    # turns (both from 0); None for a workload of single requests.
    conversation: int | None = None
    turn: int | None = None
    # Prompt tokens the server found in its prefix cache (usage.prompt_tokens_details
    # .cached_tokens; vLLM sends it with --enable-prompt-tokens-details), None where not sent.
    cached_tokens: int | None = None
    # False for a conversation's turn never sent because an earlier turn failed: it counts as
    # a failed request, so completed + failed is every request planned.
    sent: bool = True
    # The prompt's text tokens as the client counted them (prompt_len becomes the server's
    # count, images included), and a multimodal request's items, their bytes and pixels.
    text_prompt_len: int | None = None
    mm_items: int = 0
    mm_bytes: int = 0
    mm_pixels: int = 0
    mm_audio_clips: int = 0  # of mm_items, the audio clips (no pixels)
    mm_audio_s: float = 0.0
    # A pooling request: one JSON response, no token stream, so no first token of its own.
    pooled: bool = False
    # The client could not open a connection for it: it ran out of file descriptors (EMFILE,
    # ENFILE). The request never reached the server: no failure of the server's.
    out_of_descriptors: bool = False
    # The W3C trace id it was sent with (load/trace_context.py): the server's span of it has
    # the same (load/span_receiver.py). None where it was never sent.
    trace_id: str | None = None
    # The model it asked for, where a LoRA mix named one (load/lora_mix.py); None otherwise.
    model: str | None = None

    @property
    def mm_tokens(self) -> int | None:
        """The prompt tokens the server counted beyond the text: its images', videos' and
        audio clips' placeholders (on vLLM, plus the chat template's few tokens). None
        without media."""
        if not self.mm_items or self.text_prompt_len is None or not self.success:
            return None
        return max(0, self.prompt_len - self.text_prompt_len)

    @property
    def schedule_lag(self) -> float:
        """How late the client itself was: the task ran this long after its intended time."""
        return max(0.0, self.dispatch_time - self.intended_start)

    @property
    def client_queue(self) -> float:
        """How long it waited in the client for a free slot (`max_concurrency`) before it was
        sent: from its task's run to its send. vLLM's TTFT and E2EL start at the send, so
        they leave this wait out."""
        return max(0.0, self.start_time - self.dispatch_time)


def compute(
    outcomes: Sequence[RequestOutcome],
    duration: float,
    *,
    latency_metrics: Sequence[str] = LATENCY_METRICS,
    percentiles: Sequence[float] = (50.0, 90.0, 95.0, 99.0),
    goodput_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    pooling: bool = False,
) -> dict[str, float | int | None]:
    """The summary vLLM's client prints and saves, plus ProfLLM's names, from per-request outcomes.

    `count_tokens` counts output tokens of a request whose stream carried no usage chunk, as
    vLLM's client does with its tokenizer.
    """
    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    all_tpots: list[float] = []  # with 0 for single-token outputs, as vLLM's goodput uses
    completed = total_input = total_output = 0
    for outcome in outcomes:
        if not outcome.success:
            continue
        output_len = outcome.output_tokens
        if not output_len and count_tokens is not None:
            output_len = count_tokens(outcome.generated_text)
        output_len = output_len or 0
        total_output += output_len
        total_input += outcome.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (outcome.latency - outcome.ttft) / (output_len - 1)
            samples["tpot"].append(tpot)
        all_tpots.append(tpot)
        samples["itl"].extend(outcome.itl)
        samples["ttft"].append(outcome.ttft)
        samples["e2el"].append(outcome.latency)
        completed += 1

    good = _good_count(samples["ttft"], all_tpots, samples["e2el"], goodput_ms)
    results: dict[str, float | int | None] = {
        "completed": completed,
        "failed": len(outcomes) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "request_goodput": good / duration if good is not None and duration > 0 else None,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "duration": duration,
    }
    if pooling:  # a pooling model makes no tokens: vLLM reports no output figures for it
        results.update(total_output_tokens=None, output_throughput=None)
    for alias, name in PROFLLM_ALIASES.items():
        results[alias] = results[name]
    for metric in latency_metrics:
        values = samples[metric] or [0.0]  # vLLM's `x or 0`: an empty list reports zeros
        results[f"mean_{metric}_ms"] = float(np.mean(values)) * 1000
        results[f"median_{metric}_ms"] = float(np.median(values)) * 1000
        results[f"std_{metric}_ms"] = float(np.std(values)) * 1000
        for percentile in percentiles_for(metric, percentiles):
            key = f"{percentile_key(percentile)}_{metric}_ms"
            results[key] = float(np.percentile(values, percentile)) * 1000
    return results


def client_queue_summary(outcomes: Sequence[RequestOutcome]) -> dict[str, float]:
    """The client's queue over the completed requests: the wait for a free slot under
    `max_concurrency` (mean, median, p99), and E2EL with that wait in it, from when the
    request was due to its last token, beside vLLM's E2EL, which starts at the send. As
    vLLM's figures, zeros where none completed."""
    done = [outcome for outcome in outcomes if outcome.success]
    queue = np.array([outcome.client_queue for outcome in done] or [0.0]) * 1000
    whole = np.array([outcome.client_queue + outcome.latency for outcome in done] or [0.0]) * 1000
    results: dict[str, float] = {}
    for name, values in (("client_queue", queue), ("e2el_with_queue", whole)):
        results[f"mean_{name}_ms"] = float(np.mean(values))
        results[f"median_{name}_ms"] = float(np.median(values))
        results[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    return results


def multimodal_summary(outcomes: Sequence[RequestOutcome]) -> dict[str, float | int | None]:
    """A multimodal workload's items over its completed requests: how many, how large, and
    how many prompt tokens the server counted for them; empty for a text workload."""
    if not any(outcome.mm_items for outcome in outcomes):
        return {}
    done = [outcome for outcome in outcomes if outcome.success]
    items = sum(outcome.mm_items for outcome in done)
    visual = items - sum(outcome.mm_audio_clips for outcome in done)  # images and videos
    vision = [v for outcome in done if (v := outcome.mm_tokens) is not None]
    return {
        "total_mm_items": items,
        "mean_mm_items_per_request": items / len(done) if done else None,
        "mean_mm_bytes_per_request": (
            sum(outcome.mm_bytes for outcome in done) / len(done) if done else None
        ),
        "mean_mm_pixels_per_item": (
            sum(outcome.mm_pixels for outcome in done) / visual if visual else None
        ),
        "mean_mm_tokens_per_request": float(np.mean(vision)) if vision else None,
        "mean_mm_audio_s_per_request": (
            sum(outcome.mm_audio_s for outcome in done) / len(done)
            if done and any(outcome.mm_audio_s for outcome in done)
            else None
        ),
    }


def _good_count(
    ttfts: list[float],
    tpots: list[float],
    e2els: list[float],
    goodput_ms: dict[str, float] | None,
) -> int | None:
    if not goodput_ms:
        return None
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    chosen = [(columns[name], limit / 1000) for name, limit in goodput_ms.items()]
    return sum(
        1 for index in range(len(ttfts)) if all(values[index] <= limit for values, limit in chosen)
    )


# When the client, not the server, set the pace, the figures measure the client: such a case
# is `invalid`. The limits are those the issue set: 95 % of the rate, 10 ms p99 lag, a busy core.
MIN_ACHIEVED_RATE_FRACTION = 0.95
MAX_P99_SCHEDULE_LAG_S = 0.010
MAX_CLIENT_CPU_PERCENT = 95.0


def client_health(
    outcomes: Sequence[RequestOutcome],
    intended_offsets: Sequence[float],
    clock_start: float,
    duration: float,
    cpu_seconds: float,
    processes: int = 1,
    watch: Sequence[WatchFigures] = (),
    cores: int | None = None,
) -> dict[str, float | int | None]:
    """How well the client kept its schedule: lag statistics, rates and its CPU use (per
    client process, so 100 is one busy core each); and what each client process saw of
    itself (`watch`, load/client_watch.py): its event loop's lag, its CPU and run-queue wait
    shares, the worst process's (None where no watch ran); and how many processes the client
    ran and on how many cores (its affinity; None where not known).

    The target rate is the schedule's own (requests over the last intended offset, so ramps
    count too); the achieved rate is the same count over the last actual dispatch. Both are
    None for an infinite rate, where there is no schedule to keep.
    """
    lags = [outcome.schedule_lag for outcome in outcomes] or [0.0]
    last_intended = max(intended_offsets, default=0.0)
    target: float | None = None
    achieved: float | None = None
    if last_intended > 0:
        target = len(outcomes) / last_intended
        last_dispatch = max(outcome.dispatch_time for outcome in outcomes) - clock_start
        achieved = len(outcomes) / last_dispatch if last_dispatch > 0 else None
    return {
        "mean_schedule_lag_ms": float(np.mean(lags)) * 1000,
        "median_schedule_lag_ms": float(np.median(lags)) * 1000,
        # The lower of the two lags around the 99th percentile: with under a hundred requests
        # the interpolated p99 is all but the largest lag, so one request the host held up
        # for a moment would decide the verdict alone; a client that fell behind is late on
        # at least two.
        "p99_schedule_lag_ms": float(np.percentile(lags, 99, method="lower")) * 1000,
        "max_schedule_lag_ms": float(np.max(lags)) * 1000,
        "target_request_rate": target,
        "achieved_request_rate": achieved,
        "client_cpu_percent": (
            100.0 * cpu_seconds / processes / duration if duration > 0 else 0.0
        ),
        **client_watch.worst(list(watch)),
        "client_processes": processes,
        "client_cores": cores,
    }


def client_fell_behind(
    health: Mapping[str, float | int | None], max_p99_lag_ms: float | None = None
) -> str | None:
    """Why these figures measure the client rather than the server, or None if they do not.
    `max_p99_lag_ms` overrides the default limit of the p99 schedule lag."""
    lag_limit_ms = MAX_P99_SCHEDULE_LAG_S * 1000 if max_p99_lag_ms is None else max_p99_lag_ms
    reasons = []
    target, achieved = health.get("target_request_rate"), health.get("achieved_request_rate")
    # The achieved rate falls short of the target by the last request's lateness over the
    # whole schedule, and that lateness is at most the largest lag: over a short schedule (a
    # trace of two requests 5 ms apart) a fraction of a millisecond of jitter would be 5 %. A
    # client never later than the lag limit did not fall behind, whatever that ratio says.
    latest = health.get("max_schedule_lag_ms")
    within_limit = latest is not None and latest <= lag_limit_ms
    if (
        target
        and achieved is not None
        and achieved < MIN_ACHIEVED_RATE_FRACTION * target
        and not within_limit
    ):
        reasons.append(
            f"achieved request rate {achieved:.3g}/s is under "
            f"{MIN_ACHIEVED_RATE_FRACTION:.0%} of the target {target:.3g}/s"
        )
    lag = health.get("p99_schedule_lag_ms")
    # An infinite rate has no schedule: all requests are due at once, and lag is only reported.
    if target and lag is not None and lag > lag_limit_ms:
        reasons.append(f"p99 schedule lag {lag:.3g} ms is over {lag_limit_ms:g} ms")
    cpu = health.get("client_cpu_percent")
    if cpu is not None and cpu >= MAX_CLIENT_CPU_PERCENT:
        reasons.append(f"client CPU saturated ({cpu:.0f}% of a core)")
    if not reasons:
        return None
    return "client fell behind: " + "; ".join(reasons)


# The client watching itself (load/client_watch.py). Its event loop's p99 lag is held to the
# schedule lag's bound (`--profllm-max-schedule-lag`, 10 ms by default): a loop that late
# stamps what it reads as late, at any rate, infinite too. Its run-queue wait share is held
# to MAX_CLIENT_RUNQUEUE_WAIT_SHARE. Measured with benchmarks/perf/client_error.py against
# its paced server on the 2-core development host, shared with other jobs (the tables are in
# docs/developing/performance.md): 50 streams, the client pinned to a core (load average
# 3.7-4.7), waited for a core 0.14 and 0.29 of the load with a p99 loop lag of 4.6 and
# 9.2 ms; beside a CPU hog pinned to its core, 0.60 and 0.74 with 14.9 and 24.9 ms. Loads
# of 6 to 16 streams at load average 9.5 waited 0.05 to 0.22. Every load that waited over
# half its time had a p99 loop lag over 10 ms and a median TTFT error of 26 ms or more.
MAX_CLIENT_RUNQUEUE_WAIT_SHARE = 0.5


def client_saturated(
    health: Mapping[str, float | int | None],
    max_loop_lag_ms: float | None = None,
    max_wait_share: float | None = MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
) -> str | None:
    """Why the client's own watch says it could not keep up with what it read, or None: its
    event loop ran later than the bound (its p99 lag), or it waited for a core over
    `max_wait_share` of the load (None: not judged; --profllm-max-client-wait).
    `max_loop_lag_ms` overrides the lag bound (the schedule lag's default). A figure that was
    not measured (no watch, no schedstat) decides nothing."""
    lag_limit_ms = MAX_P99_SCHEDULE_LAG_S * 1000 if max_loop_lag_ms is None else max_loop_lag_ms
    reasons = []
    lag = health.get("client_loop_lag_p99_ms")
    if lag is not None and lag > lag_limit_ms:
        reasons.append(f"event loop p99 lag {lag:.4g} ms is over {lag_limit_ms:g} ms")
    wait = health.get("client_runqueue_wait_share")
    if wait is not None and max_wait_share is not None and wait > max_wait_share:
        reasons.append(f"it waited for a core {wait:.0%} of the load, over {max_wait_share:.0%}")
    if not reasons:
        return None
    cpu = health.get("client_cpu_share")
    used = "" if cpu is None else f" (it ran {cpu:.0%} of the load)"
    return "client saturated: " + "; ".join(reasons) + used


_ERRORS_QUOTED = 3


def served_problem(
    outcomes: Sequence[RequestOutcome],
    results: dict[str, float | int | None],
    allowed_failures: int = 0,
) -> str | None:
    """Why these outcomes must not pass, or None: vLLM's client exits 0 even when every
    request failed; we do not. A failed request (an error status, no response, a stream cut,
    stalled, or with an error event or a message that is not JSON) fails the case unless the
    suite allows that many (`thresholds: {failed: {max: N}}`). Quotes the first errors."""
    # A request the client could not send for want of descriptors is the client's: the
    # measurement is invalid for it (client_out_of_descriptors), the server is not blamed.
    failed = [o for o in outcomes if _failed(o) and not o.out_of_descriptors]
    if not results.get("completed"):
        if not failed:
            return f"all {len(outcomes)} requests failed in the client: {_OUT_OF_DESCRIPTORS}"
        return f"all {len(outcomes)} requests failed; first errors: {_first_errors(failed)}"
    # No HTTP response at all (connection refused, reset, closed): the server went away or
    # was not there; a figure over the requests that got through would hide it.
    unanswered = [o for o in failed if o.status is None and o.sent]
    unsent = [o for o in failed if not o.sent]
    rejected = [o for o in failed if o.status is not None and o.status != 200]
    cut = [o for o in failed if o.status == 200]
    if len(failed) > allowed_failures:
        kinds = [
            f"{len(group)} {what}"
            for group, what in (
                (unanswered, "got no response (connection refused, reset or closed)"),
                (rejected, "got a non-200 status"),
                (cut, "failed in the middle of their stream"),
                (unsent, "were not sent (an earlier turn of their conversation failed)"),
            )
            if group
        ]
        allowed = f"the suite allows {allowed_failures}" if allowed_failures else "none allowed"
        return (
            f"{len(failed)} of {len(outcomes)} requests failed ({'; '.join(kinds)}; "
            f"{allowed}: thresholds: {{failed: {{max: N}}}}); first errors: "
            f"{_first_errors(failed)}"
        )
    if results.get("total_output_tokens") == 0:  # None: a pooling model's, which makes none
        return "the server returned no output tokens for any request"
    return None


def request_failures(outcomes: Sequence[RequestOutcome]) -> str | None:
    """How many requests failed at the server and the first reasons; None where none did
    (those the client could not send are `client_out_of_descriptors`'s)."""
    failed = [o for o in outcomes if _failed(o) and not o.out_of_descriptors]
    if not failed:
        return None
    return f"{len(failed)} of {len(outcomes)} requests failed: {_first_errors(failed)}"


_OUT_OF_DESCRIPTORS = "it ran out of file descriptors (EMFILE), not the server's failure"


def client_out_of_descriptors(
    outcomes: Sequence[RequestOutcome], open_file_limit: int | None
) -> str | None:
    """Why the figures are not a valid measurement where the client could not open
    connections for some requests, or None: those requests never reached the server."""
    count = sum(1 for outcome in outcomes if outcome.out_of_descriptors)
    if not count:
        return None
    limit = "unlimited" if open_file_limit is None else str(open_file_limit)
    return (
        f"client ran out of file descriptors on {count} of {len(outcomes)} requests "
        f"(its open-file limit {limit}; raise it with ulimit -n or lower max_concurrency): "
        "not the server's failures"
    )


def _failed(outcome: RequestOutcome) -> bool:
    return not outcome.success or bool(outcome.error) or outcome.status not in (None, 200)


def _first_errors(outcomes: Sequence[RequestOutcome]) -> str:
    first = list(dict.fromkeys(o.error.splitlines()[0] for o in outcomes if o.error))
    return "; ".join(first[:_ERRORS_QUOTED]) or "none given"


def token_problem(outcome: RequestOutcome, ignore_eos: bool) -> str | None:
    """Why a completed request's token counts cannot be believed, or None. The server's usage
    count must be a count; it may not fall short of the content messages streamed (each
    carries at least one token; the last may carry none), nor exceed what was asked for, and
    under `ignore_eos` it must reach it (the server ignored the limit otherwise)."""
    if outcome.usage_problem is not None:
        return outcome.usage_problem
    tokens = outcome.output_tokens
    if tokens is None:
        return None  # no usage chunk: the tokens are counted from the text, as vLLM's client
    messages = len(outcome.message_times)
    if tokens < messages - 1:
        return f"usage says {tokens} output tokens but {messages} content messages streamed"
    asked = outcome.output_len
    if asked is not None and tokens > asked:
        return f"usage says {tokens} output tokens, more than the {asked} asked for"
    if asked is not None and ignore_eos and tokens < asked:
        return f"{tokens} of {asked} output tokens under ignore_eos"
    return None


def inconsistent_counts(outcomes: Sequence[RequestOutcome], ignore_eos: bool) -> str | None:
    """Why the figures of these outcomes are not a valid measurement, from their token
    counts, or None: the throughputs and TPOT would rest on counts the server made up."""
    problems = [
        (index, problem)
        for index, outcome in enumerate(outcomes)
        if outcome.success and (problem := token_problem(outcome, ignore_eos)) is not None
    ]
    if not problems:
        return None
    shown = "; ".join(f"request {index}: {problem}" for index, problem in problems[:3])
    return f"inconsistent token counts in {len(problems)} of {len(outcomes)} requests: {shown}"


def grouped(
    outcomes: Iterable[RequestOutcome], key: Callable[[RequestOutcome], K | None]
) -> dict[K, list[RequestOutcome]]:
    """The outcomes by their `key` (in the order the keys first come), those whose key is
    None left out."""
    groups: dict[K, list[RequestOutcome]] = {}
    for outcome in outcomes:
        value = key(outcome)
        if value is not None:
            groups.setdefault(value, []).append(outcome)
    return groups
