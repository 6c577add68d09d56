"""The session's settings, read from the options of the table: the command line's value, else
the ini file's, else the default (declare.value_of); and what the settings make of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from pytest_profllm.engine.choice import Clock
from pytest_profllm.gates.config import GateConfig
from pytest_profllm.gates.regression import GateSettings
from pytest_profllm.hosts.foreign_cpu import DEFAULT_MAX_FOREIGN_CPU
from pytest_profllm.load.metrics import MAX_CLIENT_RUNQUEUE_WAIT_SHARE
from pytest_profllm.load.server_view import (
    DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
)
from pytest_profllm.options.declare import Option, value_of
from pytest_profllm.options.parsers import InvalidPolicy
from pytest_profllm.options.table import (
    DEFAULT_MAX_SCHEDULE_LAG_MS,
    DEFAULT_REMEASURE,
    DEFAULT_SATURATION_MARGIN,
    Table,
)
from pytest_profllm.plan.case import MAX_CASES
from pytest_profllm.server.tracing import TraceMode
from pytest_profllm.sim.profile_file import ProfileSnapshot

T = TypeVar("T")


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
    max_client_overhead_p99_ms: float = DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS
    max_foreign_cpu: float = DEFAULT_MAX_FOREIGN_CPU
    max_client_wait: float = MAX_CLIENT_RUNQUEUE_WAIT_SHARE
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
    # What an invalid case does to the session (--profllm-invalid).
    invalid: InvalidPolicy = field(default_factory=InvalidPolicy)
    # Which servers export per-request spans (server/tracing.py, load/span_receiver.py).
    trace_requests: TraceMode = "auto"
    # The session compares with or writes a --profllm-baseline, or requires one: the gate's
    # server groups are traced under `auto` (server/tracing.py).
    gated: bool = False

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        def get(option: Option[T]) -> T:
            return value_of(config, option)

        engine = get(Table.engine)
        out_dir = _path(config, get(Table.out))
        db_path = _path(config, get(Table.db)) or (out_dir / "results.db" if out_dir else None)
        return cls(
            out_dir=out_dir,
            db_path=db_path,
            engine=engine,
            gpus=get(Table.gpus),
            ports=get(Table.ports),
            startup_timeout=get(Table.startup_timeout),
            lease_timeout=get(Table.lease_timeout),
            suite_glob=get(Table.suite_glob),
            wait_for_busy_gpus=get(Table.busy_gpus) == "wait",
            max_schedule_lag_ms=get(Table.max_schedule_lag),
            max_client_overhead_ms=get(Table.max_client_overhead),
            max_client_overhead_p99_ms=get(Table.max_client_overhead_tail),
            max_foreign_cpu=get(Table.max_foreign_cpu),
            max_client_wait=get(Table.max_client_wait),
            remeasure=get(Table.remeasure),
            load_cores=not get(Table.no_load_cores),
            vllm_python=get(Table.vllm_python),
            cpus=get(Table.cpus),
            sim_device=get(Table.sim_device),
            sim_clock=get(Table.sim_clock),
            sim_profile=get(Table.sim_profile),
            ray=get(Table.ray) or None,
            max_cases=get(Table.max_cases),
            ray_retry=get(Table.ray_retry),
            # 0 (or off) is no stop, as --profllm-no-saturation-stop is.
            saturation_margin=None
            if get(Table.no_saturation_stop)
            else get(Table.saturation_margin) or None,
            resume=_resume(get(Table.resume), out_dir),
            gpu_hour_price=get(Table.gpu_hour_price),
            invalid=get(Table.invalid),
            trace_requests=get(Table.trace_requests),
            gated=get(Table.baseline) is not None or get(Table.require_baseline),
        )


def _path(config: pytest.Config, value: str | None) -> Path | None:
    # Relative paths are from where pytest was started, whatever the rootdir.
    return config.invocation_params.dir / value if value else None


def _resume(resume: bool, out_dir: Path | None) -> bool:
    if resume and out_dir is None:
        raise pytest.UsageError(
            "--profllm-resume reads the records of earlier sessions from --profllm-out: "
            "give the same --profllm-out as the session to resume"
        )
    return resume


def gate_config(config: pytest.Config, out_dir: Path | None) -> GateConfig:
    """The regression gate's settings from its options."""
    baseline = _path(config, value_of(config, Table.baseline))
    update = value_of(config, Table.baseline_update)
    if update and baseline is None:
        raise pytest.UsageError(
            "--profllm-baseline-update needs --profllm-baseline PATH (where to write it)"
        )
    if baseline is not None and not update and not baseline.exists():
        raise pytest.UsageError(
            f"--profllm-baseline {baseline}: no such file or folder "
            "(write one with --profllm-baseline-update)"
        )
    summary = _path(config, value_of(config, Table.summary))
    if summary is None and out_dir is not None:
        summary = out_dir / "summary.md"
    return GateConfig(
        baseline=baseline,
        with_version=not value_of(config, Table.baseline_any_version),
        update_baseline=update,
        summary=summary,
        require_baseline=value_of(config, Table.require_baseline),
        settings=GateSettings(
            confidence=value_of(config, Table.gate_confidence),
            resamples=value_of(config, Table.gate_resamples),
        ),
    )
