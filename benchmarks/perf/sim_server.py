"""A fresh simulated server on 127.0.0.1 for the scripts here: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import requests

from pytest_profllm.server.process import die_with_parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def simulator(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m pytest_profllm.sim ARGS` on a free port, with `env` over this process's
    environment and vLLM's development routes on (as the plugin starts one); yields its URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pytest_profllm.sim", *args, "--port", str(port)],
        env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # A script stopped by a signal runs no `finally`: the kernel then stops the server.
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the simulator did not start")
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
