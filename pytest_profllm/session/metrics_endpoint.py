"""The session's `/metrics` endpoint (`--profllm-metrics-port`), served by the controller.

The numbers come from every process of the session through prometheus-client's multiprocess
folder (see `load/prometheus_counters.py` for why); this module makes the folder, tells the
children where it is (an environment variable they inherit, set before xdist starts its
workers), serves it, and stops serving at the session's end.

Two things the multiprocess folder does not do by itself:
- A process that ends keeps its files. Its counters and histograms stay counted, as they
  should; its "live" gauges (a case's stage, requests in flight, schedule lag) must go, or an
  xdist worker killed with -9 shows its case in its stage for the rest of the session. Each
  scrape first drops the live gauges of every process of the folder that no longer runs
  (prometheus-client's `mark_process_dead`), told apart from a later process given its pid by
  the start time each process notes in the folder (load/prometheus_counters.py).
- The session ends as its last case's final counts are written. Where a scraper has scraped
  the endpoint and its last scrape did not see the final figures, `stop` keeps serving until
  the next scrape has been answered, for at most `LINGER_S`; where it saw them, or nothing
  ever scraped, the endpoint stops at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

from pytest_profllm.load import live_status, prometheus_counters

# How long the endpoint waits, after the session's last record, for a scraper whose last
# scrape missed the final figures (a scrape interval of 15 s or less gets them).
LINGER_S = 15.0
# A process's live gauge files (prometheus-client's names: gauge_<mode>_<pid>.db).
_LIVE_GAUGE = re.compile(r"gauge_live[a-z]*_(\d+)\.db")

Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class _SessionCollector:
    """The folder's metrics, the live gauges of processes that ended dropped first; notes
    what each scrape served."""

    def __init__(self, folder: str) -> None:
        # Deferred: prometheus-client only where the option is given (see `start`).
        from prometheus_client.multiprocess import MultiProcessCollector

        self.folder = folder
        self._inner = MultiProcessCollector(None, path=folder)  # type: ignore[no-untyped-call]
        self.lock = threading.Condition()
        self.scrapes = 0  # scrapes answered
        self.served: Values | None = None  # what the last scrape served

    def collect(self) -> Iterator[Any]:
        """A scrape: only the endpoint's app calls this (the registry is ours alone, and asks
        no collector for its names on registration)."""
        families = self.current()
        with self.lock:
            self.served = values_of(families)
        return iter(families)

    def current(self) -> list[Any]:
        drop_dead_processes(self.folder)
        return list(self._inner.collect())  # type: ignore[no-untyped-call]

    def answered(self) -> None:
        with self.lock:
            self.scrapes += 1
            self.lock.notify_all()


def values_of(families: Iterable[Any]) -> Values:
    """Each sample's value by its name and labels; a zero left out (a series at 0 and one
    that is gone tell a scraper the same)."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in families for sample in family.samples if sample.value != 0}


def drop_dead_processes(folder: str) -> list[int]:
    """Drops the live gauges of each process of `folder` that no longer runs (or whose pid a
    later process took); returns their pids."""
    # Deferred: prometheus-client only where the option is given (see `start`).
    from prometheus_client.multiprocess import mark_process_dead

    pids = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if (match := _LIVE_GAUGE.fullmatch(name)) is not None:
                pids.add(int(match.group(1)))
    dead = []
    for pid in sorted(pids):
        noted = Path(folder) / prometheus_counters.process_file_name(pid)
        started = None
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            started = json.loads(noted.read_text())["started"]
        if live_status.writer_alive(pid, started if isinstance(started, float) else None,
                                    None):
            continue
        mark_process_dead(pid, folder)  # type: ignore[no-untyped-call]
        with contextlib.suppress(OSError):
            noted.unlink()
        dead.append(pid)
    return dead


class _Served:
    """A response body that says when the server has written it all (WSGI servers call
    `close` after the last byte)."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self.body, self.done = body, done

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        self.done()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Nothing in the session's output per scrape."""


@dataclass
class MetricsEndpoint:
    host: str
    port: int
    folder: str
    _server: Any
    _thread: threading.Thread
    _collector: _SessionCollector = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self, linger_s: float = LINGER_S) -> None:
        """Stops serving; first, where the last scrape missed the final figures, waits for
        the next one to be answered, `linger_s` at most."""
        collector = self._collector
        with collector.lock:
            scraped, served, answered = (collector.scrapes > 0, collector.served,
                                         collector.scrapes)
        if scraped and served != values_of(collector.current()):
            deadline = time.monotonic() + linger_s
            with collector.lock:
                while collector.scrapes == answered and (left := deadline - time.monotonic()) > 0:
                    collector.lock.wait(left)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        os.environ.pop(prometheus_counters.DIR_ENV, None)
        shutil.rmtree(self.folder, ignore_errors=True)


def start(host: str, port: int) -> MetricsEndpoint:
    """Serve the session's metrics on host:port; a port that is taken is a usage error."""
    # prometheus-client is imported only when the option is given (a pytest11 plugin is
    # imported by every pytest run).
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    folder = tempfile.mkdtemp(prefix="profllm-metrics-")
    collector = _SessionCollector(folder)
    registry = CollectorRegistry()
    registry.register(collector)
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> _Served:
        return _Served(metrics(environ, start_response), collector.answered)

    try:
        server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise pytest.UsageError(
            f"--profllm-metrics-port {port}: cannot serve metrics on {host}:{port} "
            f"({error.strerror or error}); pick a free port"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="profllm-metrics", daemon=True)
    thread.start()
    # Children (xdist workers, client processes) inherit it; this process records too (-n 0).
    os.environ[prometheus_counters.DIR_ENV] = folder
    return MetricsEndpoint(host, port, folder, server, thread, collector)
