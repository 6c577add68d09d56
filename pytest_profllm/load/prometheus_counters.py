"""The client's own Prometheus metrics (`--profllm-metrics-port`): what each case's load sends
and sees, and the stage the case is in, labelled by `case`, `suite` and `server`.

One endpoint for the whole session, fed through prometheus-client's multiprocess mode: the
load runs in xdist workers and in client subprocesses, while the port belongs to the pytest
controller. Every process that records writes its own mmap files in one folder the controller
made (`DIR_ENV`, inherited by every child), and the controller's endpoint reads that folder at
each scrape. This needs no message over xdist's channel per request, and a worker that dies
leaves what it counted. Metrics are updated once per request (sent, done), never per SSE message.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pytest_profllm.load import live_status
from pytest_profllm.load.metrics import RequestOutcome

DIR_ENV = "PROFLLM_METRICS_DIR"  # the controller's folder; unset: metrics are off
LABELS_ENV = "PROFLLM_METRICS_CASE"  # the running case's labels, as JSON, for client processes
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's own; never a server's
LABELS = ("case", "suite", "server")
# A load's request accounting as its record names it. The counters count every load a case
# ran, kept or run again: a record's `attempts` (and a capacity search's `requests_sent`)
# carry these per load, and add up to them.
REQUEST_TOTALS = ("completed", "failed", "total_input_tokens", "total_output_tokens")
# load/stages.py says what each means.
STAGES = ("waiting", "starting", "loading", "searching", "remeasuring", "profiling")

# vLLM 0.33.0's bounds (vllm/v1/metrics/loggers.py, from vllm/v1/metrics/buckets.py), so a
# dashboard can set the client's histograms beside the server's, bucket for bucket.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (  # also vLLM's time per output token
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def process_file_name(pid: int) -> str:
    """Where in the folder a process notes its start time (JSON: live_status.writer_identity),
    so that the endpoint tells it from a later process given its pid once it ended
    (session/metrics_endpoint.py drops an ended process's live gauges)."""
    return f"process_{pid}.json"


def enabled() -> bool:
    return bool(os.environ.get(DIR_ENV))


class Instruments:
    """This process's metric families, written to the session's folder."""

    def __init__(self, folder: str) -> None:
        # prometheus-client is imported only where metrics are on (it is light, but a pytest11
        # plugin is imported by every pytest run); its value class is chosen from the
        # environment at import, so it is set here in case someone imported it before.
        os.environ[PROMETHEUS_DIR_ENV] = folder
        from prometheus_client import Counter, Gauge, values

        with contextlib.suppress(OSError):  # before any value: a folder gone at the end
            path = os.path.join(folder, process_file_name(os.getpid()))
            with open(path, "w") as noted:
                json.dump(live_status.writer_identity(), noted)

        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        labels = LABELS
        self.sent = Counter(
            "profllm_client_requests_sent", "Requests the client sent.", labels, registry=None
        )
        self.completed = Counter(
            "profllm_client_requests_completed",
            "Requests that completed (the record's `completed`).",
            labels,
            registry=None,
        )
        self.failed = Counter(
            "profllm_client_requests_failed",
            "Requests that failed (the record's `failed`), by reason.",
            (*labels, "reason"),
            registry=None,
        )
        self.input_tokens = Counter(
            "profllm_client_input_tokens",
            "Prompt tokens of completed requests (the record's `total_input_tokens`).",
            labels,
            registry=None,
        )
        self.output_tokens = Counter(
            "profllm_client_output_tokens",
            "Output tokens of completed requests (the record's `total_output_tokens`).",
            labels,
            registry=None,
        )
        self.in_flight = Gauge(
            "profllm_client_requests_in_flight",
            "Requests sent and not yet finished.",
            labels,
            registry=None,
            multiprocess_mode="livesum",
        )
        self.schedule_lag = Gauge(
            "profllm_client_schedule_lag_seconds",
            "How late the last request was sent against its arrival schedule.",
            labels,
            registry=None,
            multiprocess_mode="livemax",
        )
        self.stage = Gauge(
            "profllm_case_stage",
            "1 for the stage a running case is in, else 0.",
            (*labels, "stage"),
            registry=None,
            multiprocess_mode="livemax",
        )
        self.ttft = self._histogram("time_to_first_token", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.tpot = self._histogram("time_per_output_token", INTER_TOKEN_LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency", REQUEST_LATENCY_BUCKETS)

    @staticmethod
    def _histogram(name: str, buckets: tuple[float, ...]) -> Any:
        from prometheus_client import Histogram  # deferred: see __init__

        return Histogram(
            f"profllm_client_{name}_seconds",
            f"{name.replace('_', ' ').capitalize()} as the client measured it, in seconds.",
            LABELS,
            registry=None,
            buckets=buckets,
        )


_instruments: Instruments | None = None


def instruments() -> Instruments | None:
    """This process's instruments, None where metrics are off."""
    global _instruments
    if _instruments is None and enabled():
        _instruments = Instruments(os.environ[DIR_ENV])
    return _instruments


@dataclass(frozen=True)
class CaseLabels:
    case: str
    suite: str
    server: str

    def values(self) -> tuple[str, str, str]:
        return (self.case, self.suite, self.server)


def current_labels() -> CaseLabels | None:
    raw = os.environ.get(LABELS_ENV)
    if not raw:
        return None
    try:
        return CaseLabels(**json.loads(raw))
    except (ValueError, TypeError):
        return None


@contextlib.contextmanager
def running(labels: CaseLabels) -> Iterator[None]:
    """The case's labels for this process and the client processes it starts; its stage is
    cleared when it ends."""
    if instruments() is None:
        yield
        return
    os.environ[LABELS_ENV] = json.dumps(labels.__dict__)
    try:
        set_stage("starting")
        yield
    finally:
        set_stage(None)
        os.environ.pop(LABELS_ENV, None)


def set_stage(stage: str | None) -> None:
    """Mark the running case as in `stage` (one of STAGES), or in none."""
    found, labels = instruments(), current_labels()
    if found is None or labels is None:
        return
    for name in STAGES:
        found.stage.labels(*labels.values(), name).set(1 if name == stage else 0)


class CaseRecorder:
    """One load's instruments bound to its case's labels: a listener of its requests
    (load/request_observer.py), two calls per request."""

    def __init__(self, found: Instruments, labels: CaseLabels) -> None:
        values = labels.values()
        self._labels = values
        self._sent = found.sent.labels(*values)
        self._completed = found.completed.labels(*values)
        self._failed = found.failed
        self._input = found.input_tokens.labels(*values)
        self._output = found.output_tokens.labels(*values)
        self._in_flight = found.in_flight.labels(*values)
        self._lag = found.schedule_lag.labels(*values)
        self._e2e = found.e2e.labels(*values)
        # The token histograms are made at the first request that streamed tokens: a series
        # exists from its making, and a pooling load's requests have no first token (its
        # record has no TTFT or TPOT).
        self._found = found
        self._streamed: tuple[Any, Any, Any] | None = None

    def sent(self, outcome: RequestOutcome) -> None:
        self._sent.inc()
        self._in_flight.inc()
        self._lag.set(outcome.schedule_lag)

    def lost(self, outcome: RequestOutcome) -> None:
        """A request that was never sent (a conversation's turns after one that failed): a
        failure of the load, as its record counts it, but never in flight."""
        self._failed.labels(*self._labels, failure_reason(outcome)).inc()

    def done(self, outcome: RequestOutcome) -> None:
        self._in_flight.dec()
        if not outcome.success:
            self._failed.labels(*self._labels, failure_reason(outcome)).inc()
            return
        self._completed.inc()
        output = outcome.output_tokens or 0
        self._input.inc(outcome.prompt_len)
        self._output.inc(output)
        self._e2e.observe(outcome.latency)
        if outcome.pooled:
            return
        if self._streamed is None:
            found = self._found
            self._streamed = (found.ttft.labels(*self._labels), found.tpot.labels(*self._labels),
                              found.itl.labels(*self._labels))
        ttft, tpot, itl = self._streamed
        ttft.observe(outcome.ttft)
        if output > 1:  # vLLM's TPOT: (E2EL - TTFT) / (output - 1)
            tpot.observe((outcome.latency - outcome.ttft) / (output - 1))
        _observe_many(itl, outcome.itl)


def _observe_many(histogram: Any, samples: list[float]) -> None:
    """Every sample of one request into `histogram`, one write per bucket rather than one per
    sample: a request's ITLs are as many as its SSE messages, and the multiprocess value takes
    a lock and an mmap write per increment. Uses the histogram child's `_buckets`/`_sum`
    (prometheus-client's own layout since 0.4: per-bucket, not cumulative, counts)."""
    if not samples:
        return
    # Sorted once (in C), then one bisection per bucket bound: a Python step per sample cost
    # 0.13 us a message, a few per cent of the client's whole cost per message.
    ordered = sorted(samples)
    below = 0
    for bucket, bound in zip(histogram._buckets, histogram._upper_bounds, strict=True):
        upto = bisect.bisect_right(ordered, bound)  # `le`: a sample on a bound is in its bucket
        if upto > below:
            bucket.inc(upto - below)
            below = upto
            if below == len(ordered):
                break
    histogram._sum.inc(sum(ordered))


def recorder() -> CaseRecorder | None:
    """A recorder for the running case's load in this process, None where metrics are off."""
    found, labels = instruments(), current_labels()
    if found is None or labels is None:
        return None
    return CaseRecorder(found, labels)


def failure_reason(outcome: RequestOutcome) -> str:
    """A failed request's reason as a label of few values: its HTTP status class, or how the
    client lost it."""
    if not outcome.sent:
        return "not_sent"
    if outcome.out_of_descriptors:
        return "client_out_of_descriptors"
    if outcome.status is None:
        return "no_response"
    if outcome.status >= 400:
        return f"http_{outcome.status}"
    return "stream"


def without_session_metrics(environ: dict[str, str]) -> dict[str, str]:
    """`environ` for a server: vLLM (and the simulator) would write their own metrics into the
    session's folder under PROMETHEUS_MULTIPROC_DIR, and they are served on their own port."""
    ours = environ.get(DIR_ENV)
    return {
        key: value
        for key, value in environ.items()
        if key not in (DIR_ENV, LABELS_ENV)
        and not (key == PROMETHEUS_DIR_ENV and ours is not None and value == ours)
    }
