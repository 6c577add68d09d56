"""The session's `/metrics` endpoint (`--profllm-metrics-port`), served by the controller.

The numbers come from every process of the session through prometheus-client's multiprocess
folder (see `load/prometheus_counters.py` for why); this module makes the folder, tells the
children where it is (an environment variable they inherit, set before xdist starts its
workers), serves it, and stops serving at the session's end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_profllm.load import prometheus_counters


@dataclass
class MetricsEndpoint:
    host: str
    port: int
    folder: str
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        os.environ.pop(prometheus_counters.DIR_ENV, None)
        shutil.rmtree(self.folder, ignore_errors=True)


def start(host: str, port: int) -> MetricsEndpoint:
    """Serve the session's metrics on host:port; a port that is taken is a usage error."""
    # prometheus-client is imported only when the option is given (a pytest11 plugin is
    # imported by every pytest run).
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    folder = tempfile.mkdtemp(prefix="profllm-metrics-")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)  # type: ignore[no-untyped-call]
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise pytest.UsageError(
            f"--profllm-metrics-port {port}: cannot serve metrics on {host}:{port} "
            f"({error.strerror or error}); pick a free port"
        ) from None
    # Children (xdist workers, client processes) inherit it; this process records too (-n 0).
    os.environ[prometheus_counters.DIR_ENV] = folder
    return MetricsEndpoint(host, port, folder, server, thread)
