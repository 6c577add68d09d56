"""One load's requests told to whoever listens, once per event: the client's Prometheus series
(`--profllm-metrics-port`, load/prometheus_counters.py) and the live status (`--profllm-live`,
load/live_status.py).

Every load loop (client.run_share, which also serves every client process and every
capacity probe, and conversation.run_conversations) holds one observer and tells it, for each
request it plans, either `sent` then `done`, or `lost` alone (never sent), so that at a load's
end sent == done and done + lost is every request planned. Where nothing listens the loop
holds `NO_OBSERVER`, whose calls do nothing: no loop checks for None per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from pytest_profllm.load import live_status, prometheus_counters
from pytest_profllm.load.metrics import RequestOutcome


class RequestListener(Protocol):
    """What hears of a load's requests. Each call gets the request's outcome as far as it
    went: at `sent` its intended and dispatch times (its `schedule_lag`); at `done` its
    result; at `lost` a failed outcome with `sent` False."""

    def sent(self, outcome: RequestOutcome) -> None: ...

    def done(self, outcome: RequestOutcome) -> None: ...

    def lost(self, outcome: RequestOutcome) -> None: ...


class RequestObserver:
    """A load's listeners behind one object: a RequestListener that tells each of them."""

    __slots__ = ("listeners",)

    def __init__(self, listeners: Iterable[RequestListener] = ()) -> None:
        self.listeners = tuple(listeners)

    def sent(self, outcome: RequestOutcome) -> None:
        """The request leaves now (after any max_concurrency wait)."""
        for listener in self.listeners:
            listener.sent(outcome)

    def done(self, outcome: RequestOutcome) -> None:
        """A sent request ended, completed or failed."""
        for listener in self.listeners:
            listener.done(outcome)

    def lost(self, outcome: RequestOutcome) -> None:
        """A planned request that will never be sent (a conversation's turn after a failed
        one): a failed request of the load, never in flight."""
        for listener in self.listeners:
            listener.lost(outcome)


class _Unheard(RequestObserver):
    """Nothing listens: each call returns at once (half the cost of a loop over no one)."""

    __slots__ = ()

    def sent(self, outcome: RequestOutcome) -> None:
        pass

    def done(self, outcome: RequestOutcome) -> None:
        pass

    def lost(self, outcome: RequestOutcome) -> None:
        pass


NO_OBSERVER: RequestObserver = _Unheard()

# What may listen to a load in this process, given its planned request count and target rate
# (requests per second, inf: as fast as it goes); each gives None where its option is off.
LISTENERS: tuple[Callable[[int, float], RequestListener | None], ...] = (
    lambda total, rate: prometheus_counters.recorder(),
    live_status.load_progress,
)


def for_load(total: int, rate: float) -> RequestObserver:
    """The observer of one load of `total` requests at `rate` in this process: made once per
    load, before its first request (the live status starts its counts afresh here)."""
    listeners = [found for make in LISTENERS if (found := make(total, rate)) is not None]
    return RequestObserver(listeners) if listeners else NO_OBSERVER
