"""What the project's own tests need: a lease pool of their own, apart from real benchmark runs
on this host, and a fresh range of ports for each end-to-end run."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_PORT_RANGES = itertools.count()


@pytest.fixture(scope="session")
def test_pool_dir() -> Iterator[Path]:
    """A lease pool for the tests' runs, shared by every test (and xdist worker) of the
    session, as the host-wide pool is by design; real benchmark runs use their own."""
    directory = Path(tempfile.gettempdir()) / f"pytest-profllm-tests-pool-{os.getuid()}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROFLLM_POOL_DIR", str(directory))
        yield directory


@pytest.fixture
def port_range(worker_id: str, test_pool_dir: Path) -> str:
    """100 ports no other test of this run uses, so a leak is easy to pin on its test."""
    worker = int(worker_id[2:]) if worker_id.startswith("gw") else 0
    # PROFLLM_TEST_PORT_BASE keeps two checkouts' test runs on one host apart.
    base = int(os.environ.get("PROFLLM_TEST_PORT_BASE", "25000"))
    start = base + worker * 2000 + (next(_PORT_RANGES) % 20) * 100
    return f"{start}-{start + 99}"


@pytest.fixture
def sim_url(port_range: str, tmp_path: Path) -> Iterator[str]:
    """A running simulated engine (served name `sim`), its emission log at
    `tmp_path/emissions.jsonl`; stopped and reaped whatever the test does."""
    import socket
    import subprocess
    import sys
    import time

    env = {**os.environ, "PROFLLM_SIM_EMISSION_LOG": str(tmp_path / "emissions.jsonl")}
    log = tmp_path / "sim.log"
    first = int(port_range.split("-")[0]) + 50
    for port in range(first, first + 5):  # a port still held by someone else: the next one
        argv = [sys.executable, "-m", "pytest_profllm.sim", "sim", "--port", str(port)]
        with log.open("wb") as handle:
            process = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            if process.poll() is None and time.monotonic() < deadline:
                yield f"http://127.0.0.1:{port}"
                return
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    raise RuntimeError(f"the simulator did not start on ports {first}-{first + 4}: {tail}")
