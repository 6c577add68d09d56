"""What the project's own tests need: a lease pool of their own, apart from real benchmark runs
on this host, and a fresh range of ports for each end-to-end run."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]
# tests/helpers.py asserts for the tests that call it: its failures read as the tests' own do.
pytest.register_assert_rewrite("helpers")

_PORT_RANGES = itertools.count()

# The sessions these tests start run side by side with each other (xdist) on a host they
# oversubscribe: to each, the others are foreign load, which the plugin rightly calls a busy
# host. What they test is the path, not the host, so the rule is off in every pytest they
# start (the tests of the rule itself pass --profllm-max-foreign-cpu, which wins).
os.environ["PROFLLM_MAX_FOREIGN_CPU"] = "1"
# For the same reason the client's own watch is not held to this host either: its wait for a
# core and its event loop's lag (held to the schedule-lag bound) are the other sessions' doing
# (the suite at -n 4 on 2 cores had clients that ran 2 % of a load and waited for a core 54 %).
# The tests of these rules pass their bounds, which win.
os.environ["PROFLLM_MAX_CLIENT_WAIT"] = "1"
os.environ["PROFLLM_MAX_SCHEDULE_LAG"] = "1000"
# The simulated engine's requests are traced by default, so the client's tail is judged too:
# held against the client where its loop ran late by the bound, which the others' load makes.
os.environ["PROFLLM_MAX_CLIENT_OVERHEAD_TAIL"] = "1000"

# Each test starts Python processes (pytest sessions, their xdist workers, simulated servers)
# that import the plugin. Where PYTHONDONTWRITEBYTECODE is set (the development host sets it),
# each process compiled the plugin's modules from source again (the 12 test_bad_suite_* tests:
# 34.8 s, 32.5 s without it). The tests let Python keep its bytecode (__pycache__ is
# git-ignored); xdist's workers, started after this file is read, inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def test_pool_dir() -> Iterator[Path]:
    """A lease pool for the tests' runs, shared by every test (and xdist worker) of the
    session, as the host-wide pool is by design; real benchmark runs use their own."""
    directory = Path(tempfile.gettempdir()) / f"pytest-profllm-tests-pool-{os.getuid()}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROFLLM_POOL_DIR", str(directory))
        yield directory


# The fixtures of a whole module or session that run pytest sessions of their own: each has
# ranges of 100 ports apart from every test's (`shared_ports`).
SHARED_PORT_USERS = (
    "request_accounting", "gate_accuracy", "browser_dashboards", "run_page", "client_metrics",
    "example_run",
)


def _port_layout(worker_id: str) -> tuple[int, int, int]:
    """(the first port of this run, this worker's index, how many workers the run has).
    PROFLLM_TEST_PORT_BASE keeps two checkouts' test runs on one host apart."""
    base = int(os.environ.get("PROFLLM_TEST_PORT_BASE", "25000"))
    worker = int(worker_id[2:]) if worker_id.startswith("gw") else 0
    # xdist sets the count in its workers, so the layout grows with -n and no range is shared.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return base, worker, max(workers, worker + 1)


# Each worker takes turns over this many ranges of 100 ports. At the default base and -n 4
# every range is below Linux's ephemeral ports (32768 up), where a client connection's own
# port could take a server's.
WORKER_PORT_RANGES = 10


def shared_ports(user: str, worker_id: str) -> str:
    """100 ports for `user` (one of SHARED_PORT_USERS) on this worker: above every worker's
    test ranges (`port_range`), one block per user and worker."""
    base, worker, workers = _port_layout(worker_id)
    first = base + workers * WORKER_PORT_RANGES * 100
    start = first + (SHARED_PORT_USERS.index(user) * workers + worker) * 100
    return f"{start}-{start + 99}"


@pytest.fixture
def port_range(worker_id: str, test_pool_dir: Path) -> str:
    """100 ports no other test of this run uses, so a leak is easy to pin on its test: each
    worker takes turns over WORKER_PORT_RANGES ranges of its own."""
    base, worker, _ = _port_layout(worker_id)
    turn = next(_PORT_RANGES) % WORKER_PORT_RANGES
    start = base + (worker * WORKER_PORT_RANGES + turn) * 100
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


REPO = Path(__file__).resolve().parent
EXAMPLE_RUN_TIMEOUT_S = 900
# The example suites whose cases run on the virtual clock in the tests' example run: the
# three that take most of its time in real time (a capacity search of probes of at least 3 s
# each, a trace replayed for 10 s, four tensor-parallel loads of ~11 s together), and two
# whose figures the virtual clock keeps apart from the host (adapter swaps, speculative
# TPOT), all modelled by it. Their real-time client is tested where it is the subject
# (tests/test_capacity*.py, tests/test_trace.py; multi-GPU servers in tests/test_scheduler.py),
# and README's main job itself runs in real time in CI's own stage (.ci/run).
EXAMPLE_VIRTUAL_SUITES = (
    "bench_capacity.yaml", "bench_lora.yaml", "bench_parallel.yaml", "bench_speculative.yaml",
    "bench_trace.yaml",
)


@dataclass(frozen=True)
class ExampleRun:
    """README's main job as the tests run it: the example suites copied to `folder` (but
    EXAMPLE_VIRTUAL_SUITES, in `virtual_folder`), their records and results.db under
    `folder/results`; `result` is what the real-time session (at -n 2) printed, `virtual`
    what the virtual-clock session of EXAMPLE_VIRTUAL_SUITES, run first, printed."""

    folder: Path
    result: pytest.RunResult
    virtual: pytest.RunResult

    @property
    def results(self) -> Path:
        return self.folder / "results"


def _run_example(argv: list[str], cwd: Path, log: Path) -> pytest.RunResult:
    """Runs `argv` in `cwd` once: its output and duration kept under `log` (a folder)."""
    done = log / "returncode"
    if not done.exists():
        log.mkdir(exist_ok=True)
        started = time.monotonic()
        run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                             timeout=EXAMPLE_RUN_TIMEOUT_S)
        (log / "stdout.txt").write_text(run.stdout)
        (log / "stderr.txt").write_text(run.stderr)
        (log / "duration").write_text(f"{time.monotonic() - started:.3f}")
        done.write_text(str(run.returncode))
    return pytest.RunResult(
        int(done.read_text()),
        (log / "stdout.txt").read_text().splitlines(),
        (log / "stderr.txt").read_text().splitlines(),
        float((log / "duration").read_text()),
    )


@pytest.fixture(scope="session")
def example_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str,
                test_pool_dir: Path) -> ExampleRun:
    """README's main job (every example suite but lm-eval's accuracy one, on the simulated
    engine), run once for the whole test session: the first xdist worker to ask runs it,
    under a file lock, and the others read what it left. The capacity, parallel and trace
    suites run on the virtual clock (EXAMPLE_VIRTUAL_SUITES: in real time they took most of
    the run), the others at -n 2 in real time, both sessions into one results folder. Its checks
    (tests/test_end_to_end.py) and its pages (tests/test_browser_dashboards.py) read the
    same run: two runs of it took a fifth of the suite's time. Tests copy what they change."""
    from filelock import FileLock
    from helpers import pytest_argv

    # xdist's workers each have a base folder under one the session made for them all.
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    folder = shared / "example-run"
    virtual_folder = shared / "example-run-virtual"
    with FileLock(str(shared / "example-run.lock")):
        if not folder.exists():
            folder.mkdir()
            virtual_folder.mkdir()
            for suite in (REPO / "benchmarks").iterdir():
                # The accuracy example runs where lm-eval is installed and is skipped
                # elsewhere: tests/test_accuracy.py checks the skip on it.
                if suite.suffix in (".yaml", ".py") and suite.name != "bench_accuracy.yaml":
                    into = virtual_folder if suite.name in EXAMPLE_VIRTUAL_SUITES else folder
                    shutil.copy(suite, into)
        # One session runs it for all workers: the first worker's block.
        ports = shared_ports("example_run", "gw0")
        out = str(folder / "results")
        virtual = _run_example(
            pytest_argv(ports, "-n", "0", "--profllm-sim-clock=virtual", out=out, cache=False),
            virtual_folder, shared / "example-run-virtual-log")
        result = _run_example(pytest_argv(ports, "-n", "2", out=out, cache=False), folder,
                              shared / "example-run-log")
    return ExampleRun(folder, result, virtual)

