"""What the project's own tests need: a lease pool of their own, apart from real benchmark runs
on this host, and a fresh range of ports for each end-to-end run."""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]
# tests/helpers.py asserts for the tests that call it: its failures read as the tests' own do.
pytest.register_assert_rewrite("helpers")

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


def sim_processes(ports: str) -> list[psutil.Process]:
    """Simulated-engine processes serving on a port of this range."""
    low, high = (int(p) for p in ports.split("-"))
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "pytest_profllm.sim" not in cmdline or "--port" not in cmdline:
            continue
        port = int(cmdline[cmdline.index("--port") + 1])
        if low <= port <= high:
            found.append(process)
    return found


@pytest.fixture
def ports(port_range: str) -> Iterator[str]:
    """A port range for a whole pytest run; no simulated server may outlive the test."""
    yield port_range
    leaked = sim_processes(port_range)
    for process in leaked:
        process.kill()
    assert not leaked, f"servers left running: {[p.cmdline() for p in leaked]}"


@pytest.fixture
def sim_url(port_range: str, tmp_path: Path) -> Iterator[str]:
    """A running simulated engine (served name `sim`), its emission log at
    `tmp_path/emissions.jsonl`; stopped and reaped whatever the test does."""
    # tests/helpers.py is importable once pytest has imported a test module from tests/ (its
    # folder goes on sys.path), as it has by the time a fixture runs; not when this file loads.
    from helpers import simulator

    env = {**os.environ, "PROFLLM_SIM_EMISSION_LOG": str(tmp_path / "emissions.jsonl")}
    first = int(port_range.split("-")[0]) + 50
    with simulator(
        first, tmp_path / "sim.log", "sim", "--enable-prompt-tokens-details", env=env
    ) as url:
        yield url
