"""Which servers export each request's span (server/tracing.py): --profllm-trace-requests
auto|on|off read from the command line and the ini file, auto's decision for each engine,
capacity group, gate run and vLLM Python with or without OpenTelemetry (engine/otel.py)."""

from __future__ import annotations

import argparse
import itertools
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.engine.otel import INSTALL_HINT, OTEL_PACKAGES, otel_missing
from pytest_profllm.hosts.pool import HostPool
from pytest_profllm.options import Settings
from pytest_profllm.options.parsers import parse_trace_mode
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig
from pytest_profllm.server.process import ServerStartError
from pytest_profllm.server.tracing import (
    AUTO_VLLM,
    OFF,
    TRACE_MODES,
    TraceChoice,
    TraceMode,
    Tracing,
    choose,
    wanting_spans,
)
from pytest_profllm.server.workers import WorkerServers

MISSING = f"vLLM's Python has no opentelemetry-exporter-otlp: {INSTALL_HINT}"


def _otel(present: bool) -> tuple[list[int], Callable[[], str | None]]:
    asked: list[int] = []

    def missing() -> str | None:
        asked.append(1)
        return None if present else MISSING

    return asked, missing


def _expected(
    mode: TraceMode, engine: str, wants: bool, present: bool
) -> TraceChoice:
    if mode == "off":
        return TraceChoice(False, OFF)
    if engine == "sim":
        return TraceChoice(True)
    if mode == "auto" and not wants:
        return TraceChoice(False, AUTO_VLLM)
    if present:
        return TraceChoice(True)
    if mode == "on":
        return TraceChoice(False, error=f"--profllm-trace-requests on: {MISSING}")
    return TraceChoice(False, f"not traced: {MISSING}")


@pytest.mark.parametrize(
    ("mode", "engine", "capacity", "gated", "present"),
    list(itertools.product(TRACE_MODES, ("sim", "vllm"), (False, True), (False, True),
                           (False, True))),
)
def test_each_server_is_traced_by_mode_engine_group_and_opentelemetry(
    mode: TraceMode, engine: str, capacity: bool, gated: bool, present: bool
) -> None:
    case = _case(capacity=capacity, regression=gated)
    # The group wants spans where it measures capacity, or is gated in a gate run.
    wants = case.server_key in wanting_spans([case], gated=True)
    assert wants is (capacity or gated)
    asked, missing = _otel(present)
    choice = choose(mode, engine, wants, missing)
    assert choice == _expected(mode, engine, wants, present)
    # vLLM's Python is asked only where its answer decides: a vLLM server that would be
    # traced.
    assert bool(asked) is (engine == "vllm" and (mode == "on" or (mode == "auto" and wants)))


def test_a_regression_block_wants_spans_only_in_a_gate_run() -> None:
    serve, gated = _case(), _case(regression=True, server="other")
    capacity = _case(capacity=True, server="third")
    cases = [serve, gated, capacity]
    assert wanting_spans(cases, gated=False) == {capacity.server_key}
    assert wanting_spans(cases, gated=True) == {capacity.server_key, gated.server_key}


def test_the_untraced_say_why_in_one_line() -> None:
    for line in (OFF, AUTO_VLLM, MISSING):
        assert "\n" not in line
    assert AUTO_VLLM.startswith("not traced: --profllm-trace-requests auto traces vLLM servers")


# --- the option ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", "auto"), ("on", "on"), ("OFF", "off"), ("true", "on"), ("1", "on"),
     ("false", "off"), ("no", "off")],
)
def test_parse_trace_mode(text: str, expected: str) -> None:
    assert parse_trace_mode(text) == expected


def test_parse_trace_mode_says_how_to_write_it_before_a_path() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"--profllm-trace-requests=on"):
        parse_trace_mode("benchmarks/")


@pytest.mark.parametrize(
    ("args", "ini", "expected"),
    [
        ((), "", "auto"),
        (("--profllm-trace-requests",), "", "on"),  # the flag alone, as when it was a switch
        (("--profllm-trace-requests=off",), "", "off"),
        (("--profllm-trace-requests", "auto"), "", "auto"),
        ((), "profllm_trace_requests = true\n", "on"),  # an ini file of the switch's days
        ((), "profllm_trace_requests = false\n", "off"),
        ((), "profllm_trace_requests = auto\n", "auto"),
        (("--profllm-trace-requests=on",), "profllm_trace_requests = off\n", "on"),
    ],
)
def test_the_mode_from_the_command_line_and_the_ini_file(
    pytester: pytest.Pytester, args: tuple[str, ...], ini: str, expected: str
) -> None:
    pytester.makeini("[pytest]\n" + ini)
    assert Settings.from_config(pytester.parseconfig(*args)).trace_requests == expected


def test_a_gate_run_is_one_with_a_baseline(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    assert not Settings.from_config(pytester.parseconfig()).gated
    base = pytester.path / "baseline.json"
    base.write_text("{}")
    assert Settings.from_config(pytester.parseconfig(f"--profllm-baseline={base}")).gated
    assert Settings.from_config(pytester.parseconfig("--profllm-require-baseline")).gated


# --- vLLM's Python and OpenTelemetry -----------------------------------------------------


def test_a_python_without_opentelemetry_is_told_how_to_install_it(tmp_path: Path) -> None:
    python = _python_with(tmp_path / "bare", ())
    problem = otel_missing(python)
    assert problem is not None
    assert problem.startswith("vLLM's Python has no opentelemetry-exporter-otlp")
    assert problem.endswith(INSTALL_HINT)
    assert "\n" not in problem


def test_a_python_with_opentelemetry_can_trace(tmp_path: Path) -> None:
    assert otel_missing(_python_with(tmp_path / "otel", OTEL_PACKAGES)) is None


def test_a_python_that_does_not_run_is_one_line(tmp_path: Path) -> None:
    problem = otel_missing(str(tmp_path / "no-such-python"))
    assert problem is not None and "\n" not in problem


def _python_with(folder: Path, packages: tuple[str, ...]) -> str:
    """A `python` that is this one without its site-packages (-S), finding only `packages`
    (empty stubs): none of OpenTelemetry's own, whatever this environment holds."""
    site = folder / "site"
    site.mkdir(parents=True)
    for name in packages:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            package = site.joinpath(*parts[:depth])
            package.mkdir(exist_ok=True)
            (package / "__init__.py").touch()
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _case(capacity: bool = False, regression: bool = False, server: str = "m") -> Case:
    benchmark = (
        CapacityConfig(slo={"p99_ttft_ms": 500}) if capacity else BenchmarkConfig()
    )
    return Case(
        suite="s",
        source="bench_s.yaml",
        server_label="srv",
        workload_label="w",
        server={"model": server},
        benchmark=benchmark,
        thresholds={},
        regression={"output_throughput": 0.05} if regression else {},
    )



def test_on_with_a_vllm_python_without_opentelemetry_fails_the_group_in_one_line(
    tmp_path: Path,
) -> None:
    python = _python_with(tmp_path / "bare", ())
    vllm = VllmInstall(python=python, distribution="vllm", version="0.32.0", device="cpu",
                       launcher="vllm.entrypoints.cli.main", parser_module=None, can_serve=True)
    servers = WorkerServers(
        engine="vllm", pool=HostPool(tmp_path / "pool", (), (), range(31990, 32000)),
        log_dir=tmp_path, startup_timeout=1, lease_timeout=1, vllm=vllm,
        tracing=Tracing("on"),
    )
    case = _case()
    with pytest.raises(ServerStartError) as first:
        servers.server_for(case)  # refused before any lease or process
    assert str(first.value) == (
        f"--profllm-trace-requests on: vLLM's Python has no opentelemetry-exporter-otlp "
        f"({', '.join(OTEL_PACKAGES)} missing in {python}): {INSTALL_HINT}"
    )
    with pytest.raises(ServerStartError, match="see the first case"):
        servers.server_for(case)  # the group's next case, without asking again
    assert servers.span_receiver is None and servers.starts == 0


def test_auto_leaves_a_vllm_server_untraced_outside_capacity_and_gate_runs(
    tmp_path: Path,
) -> None:
    servers = WorkerServers(
        engine="vllm", pool=HostPool(tmp_path / "pool", (), (), range(31990, 32000)),
        log_dir=tmp_path, startup_timeout=1, lease_timeout=1, tracing=Tracing("auto"),
    )
    case = _case()
    assert servers._traces_endpoint(case) is None
    assert servers.untraced[case.server_key] == AUTO_VLLM
    sim = WorkerServers(
        engine="sim", pool=HostPool(tmp_path / "pool", (), (), range(31990, 32000)),
        log_dir=tmp_path, startup_timeout=1, lease_timeout=1,
    )
    try:
        endpoint = sim._traces_endpoint(case)
        assert sim.span_receiver is not None and endpoint == sim.span_receiver.url
        assert case.server_key not in sim.untraced
    finally:
        sim.close_receiver()


def test_a_path_after_the_bare_flag_is_one_line_saying_how_to_write_it(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_subprocess("--profllm-trace-requests", "benchmarks/")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "*argument --profllm-trace-requests: expected auto, on or off, got 'benchmarks/' "
        "(write --profllm-trace-requests=on, or put paths before the flag)",
    ])
