"""A device profile file in use: `--sim-profile` / `--profllm-sim-profile` replace the shipped
profile, a bad file is one line naming it, every record names the file that priced it, and the
regression gate's fingerprint tells runs of two profiles (or none) apart."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import math
import sqlite3
import tomllib
from pathlib import Path
from typing import Any

import pytest
from helpers import run_records, run_suites
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.options import Settings, parse_sim_profile
from pytest_profllm.results.fingerprint import digests
from pytest_profllm.results.record import SIM_DEFAULT_DEVICE
from pytest_profllm.sim.cli import main as sim_main
from pytest_profllm.sim.config import NoCacheMemory, build_setup
from pytest_profllm.sim.hardware import DEFAULT_DEVICE, PROFILE_DIR, Overheads, device_profile
from pytest_profllm.sim.profile_file import (
    FittedOn,
    ProfileFileError,
    identity,
    load_profile_file,
    profile_toml,
)
from pytest_profllm.sim.virtual import Request, ServerSettings, simulate

FITTED = """
[fitted]
run_ids = ["run-a", "run-b"]
device = "NVIDIA H100 80GB HBM3"
vllm_version = "0.33.0"
model = "Qwen/Qwen3-8B"
date = "2026-11-27"
"""


def a_profile(tmp_path: Path, step_ms: float = 3.5, name: str = "my-h100") -> Path:
    """The shipped H100 profile with another name, a changed overhead and a [fitted] table."""
    text = (PROFILE_DIR / "h100-sxm.toml").read_text()
    text = text.replace('name = "H100-SXM"', f'name = "{name}"')
    text = text.replace("[overheads]", f"[overheads]\nstep_ms = {step_ms}\nseq_us = 31.0")
    path = tmp_path / f"{name}-{step_ms}.toml"
    path.write_text(text + FITTED)
    return path


def test_a_profile_file_replaces_the_shipped_figures(tmp_path: Path) -> None:
    profile = load_profile_file(a_profile(tmp_path))
    shipped = device_profile("H100-SXM")
    assert profile.name == "my-h100"
    assert profile.overheads.step_ms == 3.5 and profile.overheads.seq_us == 31.0
    # What the file leaves out is the shipped default, the rest as the file says.
    assert profile.overheads.frontend_token_us == shipped.overheads.frontend_token_us
    assert profile.memory_bandwidth_gbs == shipped.memory_bandwidth_gbs
    assert profile.achieved_bf16_tflops == shipped.achieved_bf16_tflops


def test_what_calibrate_writes_reads_back_as_the_same_profile(tmp_path: Path) -> None:
    profile = device_profile("A100-80GB").with_overheads(step_ms=2.25, roofline_sharpness=math_inf)
    fitted = FittedOn(run_ids=["r1"], device="A100", vllm_version="0.33.0", model="m", date="d")
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(profile, fitted, ["fitted on two runs"]))
    again = load_profile_file(path)
    assert again.overheads == profile.overheads
    assert again.bf16_tflops == profile.bf16_tflops
    assert identity(path)["fitted"]["run_ids"] == ["r1"]


math_inf = float("inf")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.replace("memory_gib = 79.6", ""), "memory_gib: Field required"),
        (lambda t: t + "\nwarp_drive = 1\n", "warp_drive: Extra inputs are not permitted"),
        (
            lambda t: t.replace("[overheads]", "[overheads]\nstep_msec = 2"),
            "overheads.step_msec: Extra inputs are not permitted",
        ),
        (
            lambda t: t.replace("[overheads]", "[overheads]\nstep_ms = -1"),
            "overheads.step_ms: Input should be greater than or equal to 0",
        ),
        (lambda t: t.replace("memory_gib = 79.6", "memory_gib = ="), "not a TOML file"),
        # Past a float's range in the engine model: a case priced at 0 tokens/s, INTERNALERROR.
        (lambda t: t.replace("bf16_tflops = 989", "bf16_tflops = inf"), "bf16_tflops: "),
        (lambda t: t.replace("[overheads]", "host_cpu_factor = inf\n[overheads]"),
         "host_cpu_factor: "),
    ],
)
def test_a_bad_profile_file_is_one_line_naming_it(
    tmp_path: Path, change: Any, expected: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(change((PROFILE_DIR / "h100-sxm.toml").read_text()))
    with pytest.raises(ProfileFileError) as error:
        load_profile_file(path)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and expected in message
    assert "\n" not in message


def test_a_missing_profile_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match=r"nope.toml: cannot read the profile: No such"):
        load_profile_file(tmp_path / "nope.toml")


def test_the_option_reads_the_file_at_once(tmp_path: Path) -> None:
    good = a_profile(tmp_path)
    snapshot = parse_sim_profile(str(good))
    assert snapshot.path == good.resolve() and snapshot.content == good.read_bytes()
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--profllm-sim-profile: .*nope"):
        parse_sim_profile(str(tmp_path / "nope.toml"))


def test_the_ini_key_sets_it_and_a_bad_one_is_a_usage_error(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    good = a_profile(tmp_path)
    pytester.makeini(f"[pytest]\nprofllm_sim_profile = {good}\n")
    snapshot = Settings.from_config(pytester.parseconfig()).sim_profile
    assert snapshot is not None and snapshot.path == good.resolve()
    pytester.makeini(f"[pytest]\nprofllm_sim_profile = {tmp_path / 'nope.toml'}\n")
    with pytest.raises(pytest.UsageError, match="ini option profllm_sim_profile: "):
        Settings.from_config(pytester.parseconfig())


def test_the_simulator_refuses_a_bad_profile_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    with caplog.at_level(logging.ERROR, logger="profllm.sim"):
        assert sim_main(["m", "--sim-profile", str(bad)]) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith(f"{bad}: ") and "Field required" in line


def _record(sim_profile: dict[str, Any] | None) -> dict[str, Any]:
    engine: dict[str, Any] = {"name": "sim", "reason": "x", "version": "1"}
    if sim_profile is not None:
        engine["sim_profile"] = sim_profile
    return {
        "engine": engine,
        "config": {"server": {"model": "m"}, "benchmark": {"num_prompts": 4}},
        "system": {},
        "runtime": {},
    }


def test_the_fingerprint_tells_profiles_apart_and_leaves_runs_without_one_as_they_were(
    tmp_path: Path,
) -> None:
    one, other = a_profile(tmp_path, 3.5), a_profile(tmp_path, 4.0)
    without = _record(None)
    with_one, with_other = _record(identity(one)), _record(identity(other))
    assert len({digests(r)[0] for r in (without, with_one, with_other)}) == 3
    assert len({digests(r)[1] for r in (without, with_one, with_other)}) == 3
    # The same file elsewhere is the same profile: the digest of its bytes, not its path.
    moved = tmp_path / "moved.toml"
    moved.write_bytes(one.read_bytes())
    assert digests(_record(identity(moved))) == digests(with_one)
    # A record without a profile keeps the digest it had before profiles existed.
    old = copy.deepcopy(without)
    assert "sim_profile" not in old["engine"]
    assert digests(old) == digests(without)


def test_the_plugin_runs_the_simulator_on_the_profile_and_records_it(
    pytester: pytest.Pytester, ports: str, tmp_path: Path
) -> None:
    profile = a_profile(tmp_path)
    pytester.makefile(
        ".yaml",
        bench_profile="""
server:
  model: meta-llama/Llama-3.1-8B-Instruct
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
""",
    )
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        f"--profllm-sim-profile={profile}",
        "--profllm-max-schedule-lag=1000",
        timeout=120,
    )
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    engine = record["engine"]
    assert engine["sim"]["device"]["name"] == "my-h100"
    assert engine["sim"]["device"]["overheads"]["step_ms"] == 3.5
    assert engine["sim_profile"] == {
        "name": "my-h100",
        "path": str(profile.resolve()),
        "sha256": hashlib.sha256(profile.read_bytes()).hexdigest(),
        "fitted": {
            "run_ids": ["run-a", "run-b"],
            "device": "NVIDIA H100 80GB HBM3",
            "vllm_version": "0.33.0",
            "model": "Qwen/Qwen3-8B",
            "date": "2026-11-27",
        },
    }
    # Its row names the profile, so a calibration's runs are found with one filter.
    db = sqlite3.connect(pytester.path / "results" / "results.db")
    (shown,) = db.execute("SELECT engine_sim_profile FROM benchmark_runs").fetchone()
    db.close()
    assert shown == f"my-h100 ({engine['sim_profile']['sha256'][:12]})"
    # The server read the session's copy beside the logs, the bytes the session checked.
    (log,) = (pytester.path / "results" / "logs").glob("*.log")
    (copy,) = (pytester.path / "results" / "logs").glob("*.toml")
    assert copy.name == f"{profile.stem}-{engine['sim_profile']['sha256'][:12]}.toml"
    assert copy.read_bytes() == profile.read_bytes()
    assert f"--sim-profile {copy}" in log.read_text()
    assert "on 1 x my-h100" in log.read_text()


SLOW_SUITE = """
server:
  model: meta-llama/Llama-3.1-8B-Instruct
  max_num_seqs: [4, 8]
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 8
"""


@pytest.mark.parametrize("clock", ["real", "virtual"])
def test_the_profile_the_session_read_prices_every_case_though_the_file_goes(
    pytester: pytest.Pytester, ports: str, tmp_path: Path, clock: str
) -> None:
    """The profile's figures price the cases on either clock, and the file deleted once the
    session has started (by the first case's setup, before either server starts) changes
    neither the figures nor the records that name it: the session uses what it read."""
    slow = a_profile(tmp_path, step_ms=40.0, name="slow-h100")
    digest = hashlib.sha256(slow.read_bytes()).hexdigest()
    pytester.makefile(".yaml", bench_slow=SLOW_SUITE)
    pytester.makeconftest(f"""
        from pathlib import Path

        def pytest_runtest_setup(item):
            Path({str(slow)!r}).unlink(missing_ok=True)
    """)
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        f"--profllm-sim-profile={slow}",
        f"--profllm-sim-clock={clock}",
        "--profllm-max-schedule-lag=1000",
        timeout=120,
    )
    result.assert_outcomes(passed=2)
    assert not slow.exists()
    records = run_records(pytester)
    assert len(records) == 2
    for record in records:
        engine = record["engine"]
        assert engine["sim_profile"]["sha256"] == digest
        assert engine["sim"]["device"]["overheads"]["step_ms"] == 40.0
        # Each decode step costs the profile's 40 ms: a shipped H100 takes about 8.
        assert record["results"]["median_tpot_ms"] > 40.0


def test_the_default_device_is_the_simulators() -> None:
    assert SIM_DEFAULT_DEVICE == DEFAULT_DEVICE


def test_the_fingerprint_tells_shipped_devices_apart_and_keeps_the_defaults() -> None:
    def record(device: str | None) -> dict[str, Any]:
        engine: dict[str, Any] = {"name": "sim", "version": "0.1.0", "clock": "real"}
        if device is not None:
            engine["sim"] = {"device": {"name": device}}
        return {"engine": engine, "config": {"server": {"model": "m"}, "benchmark": {}},
                "system": {"device_kind": "virtual"}, "runtime": {}}

    older = record(None)  # a record that does not say which device the simulator modelled
    assert digests(record(DEFAULT_DEVICE)) == digests(older)
    assert digests(record("A100-80GB"))[0] != digests(record(DEFAULT_DEVICE))[0]
    assert digests(record("A100-80GB"))[1] != digests(record(DEFAULT_DEVICE))[1]
    assert digests(record("A100-80GB")) != digests(record("H200"))


GATED = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 32
  random_input_len: 128
  random_output_len: 16
  max_concurrency: 8
regression: [median_tpot_ms]
"""


@pytest.mark.parametrize("clock", ["real", "virtual"])
def test_a_run_simulated_on_another_gpu_is_not_gated_against_the_default(
    pytester: pytest.Pytester, ports: str, clock: str
) -> None:
    """A baseline simulated as an H100 (the default) does not judge a run simulated as an
    A100, which serves the same suite at a third of the throughput: before, the gate said
    `regressed`. The device column names the GPU modelled on either clock."""
    pytester.makefile(".yaml", bench_gated=GATED)
    common = [f"--profllm-sim-clock={clock}", "--profllm-baseline=base/results.db"]
    base = run_suites(pytester, ports, *common, "--profllm-baseline-update", out="base",
                      cache=False)
    base.assert_outcomes(passed=1)
    other = run_suites(pytester, ports, *common, "--profllm-sim-device=A100-80GB",
                       out="a100", cache=False)
    other.assert_outcomes(passed=1)
    (h100,) = run_records(pytester, "base")
    (a100,) = run_records(pytester, "a100")
    assert a100["results"]["output_throughput"] < 0.7 * h100["results"]["output_throughput"]
    assert [v["decision"] for v in a100["regression"]] == ["no-baseline"]
    prefix = "virtual clock: " if clock == "virtual" else "virtual: "
    for out, device in (("base", DEFAULT_DEVICE), ("a100", "A100-80GB")):
        with sqlite3.connect(pytester.path / out / "results.db") as db:
            assert db.execute("SELECT device FROM benchmark_runs").fetchall() == [
                (prefix + device,)]


PROFILE_FIGURES = [
    "memory_gib", "memory_bandwidth_gbs", "bf16_tflops", "fp8_tflops", "achieved_bf16_tflops",
    "interconnect_gbs", "default_max_num_seqs", "default_max_num_batched_tokens",
    "host_cpu_factor", *(f"overheads.{f.name}" for f in dataclasses.fields(Overheads)),
]
HOSTILE_NUMBERS = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e300, 1.7e308, math.inf, -math.inf, math.nan])
    | st.integers(-(2**63), 2**63 - 1)
    # The ends of what a profile may say (sim/profile_file.py), where the arithmetic is worst.
    | st.sampled_from([1e-3, 0.01, 0.05, 1.0, 2.0, 64.0, 100.0, 1e4, 1e5, 1e6, 1 << 20, 1 << 24])
    | st.floats(1e-3, 1e6)
)


def _toml_number(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))


@settings(max_examples=80, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(PROFILE_FIGURES), HOSTILE_NUMBERS, max_size=4))
def test_any_profile_is_refused_in_one_line_or_prices_with_finite_figures(
    tmp_path_factory: pytest.TempPathFactory, changes: dict[str, float | int]
) -> None:
    shipped = tomllib.loads((PROFILE_DIR / "h100-sxm.toml").read_text())
    overheads = shipped.pop("overheads", {})
    for key, value in changes.items():
        table, _, name = key.rpartition(".")
        (overheads if table else shipped)[name] = value

    def toml_value(value: object) -> str:
        if isinstance(value, bool | str | list):
            return json.dumps(value)  # TOML's strings, booleans and arrays read as JSON's
        return _toml_number(value)  # type: ignore[arg-type]

    text = "\n".join([*(f"{k} = {toml_value(v)}" for k, v in shipped.items()), "[overheads]",
                      *(f"{k} = {toml_value(v)}" for k, v in overheads.items())])
    path = tmp_path_factory.mktemp("profile") / "hostile.toml"
    path.write_text(text + "\n")
    try:
        profile = load_profile_file(path)
    except ProfileFileError as refused:
        message = str(refused)
        assert "\n" not in message and message.startswith(f"{path}: ")
        assert any(key in message for key in changes)  # names the key it refuses
        return
    requests = [Request(prompt_len=200, output_len=20) for _ in range(8)]
    for concurrency, tp in [(4, 1), (8, 2)]:
        try:  # as the simulator and the virtual clock size a server
            setup = build_setup("Qwen/Qwen3-8B", profile, tensor_parallel_size=tp)
        except NoCacheMemory as unfit:  # the model leaves no cache on the GPU: one line
            assert "\n" not in str(unfit)
            continue
        served = ServerSettings(num_gpu_blocks=setup.num_gpu_blocks)
        figures = simulate(setup.engine, requests, served, max_concurrency=concurrency).summary()
        assert all(math.isfinite(value) for value in figures.values()), figures
        assert figures["output_throughput"] > 0
