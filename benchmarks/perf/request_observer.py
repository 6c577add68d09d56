"""What the request observer costs the client per request (load/request_observer.py): the
time of one `sent` and one `done` on a completed request's outcome, over 200,000 requests,
with nothing listening, with the live status only, and with the live status and the
Prometheus counters (their mmap files in a temporary folder).

    python benchmarks/perf/request_observer.py [REQUESTS]

Prints the best of three runs of each, in ns per request; asserts nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from pytest_profllm.load import live_status, prometheus_counters, request_observer
from pytest_profllm.load.metrics import RequestOutcome


def per_request_ns(observer: request_observer.RequestObserver, count: int) -> float:
    outcome = RequestOutcome(
        prompt_len=16, success=True, ttft=0.01, itl=[0.005] * 7, latency=0.05,
        output_tokens=8, intended_start=1.0, dispatch_time=1.001,
    )  # fmt: skip
    sent, done = observer.sent, observer.done
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(count):
            sent(outcome)
            done(outcome)
        best = min(best, time.perf_counter() - start)
    return best / count * 1e9


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    folder = tempfile.mkdtemp(prefix="profllm-observer-")
    print(f"no listener: {per_request_ns(request_observer.for_load(count, 10.0), count):.0f} ns")
    os.environ[live_status.DIR_ENV] = os.path.join(folder, "live")
    os.environ[live_status.CASE_ENV] = "case"
    os.makedirs(os.environ[live_status.DIR_ENV])
    live = request_observer.for_load(count, 10.0)
    print(f"live status: {per_request_ns(live, count):.0f} ns")
    os.environ[prometheus_counters.DIR_ENV] = os.path.join(folder, "metrics")
    os.environ[prometheus_counters.LABELS_ENV] = json.dumps(
        {"case": "case", "suite": "suite", "server": "server"}
    )
    os.makedirs(os.environ[prometheus_counters.DIR_ENV])
    both = request_observer.for_load(count, 10.0)
    assert len(both.listeners) == 2
    print(f"live status and Prometheus: {per_request_ns(both, count):.0f} ns")


if __name__ == "__main__":
    main()
