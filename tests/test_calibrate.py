"""`profllm calibrate`: the simulator's profile fitted to one host's runs. Records made by the
simulated engine itself under a changed profile give their parameters back; runs too few or
too alike are refused in one line that says which runs would help."""

from __future__ import annotations

import gzip
import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.cli.fit_runs import (
    Calibration,
    CalibrationError,
    base_profile,
    calibrate,
    host_of,
    observation,
    read_runs,
    report_lines,
    usable,
)
from pytest_profllm.cli.main import main
from pytest_profllm.limits import MAX_CALIBRATE_REQUESTS
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results.record import normalize
from pytest_profllm.results.record_files import write_requests
from pytest_profllm.results.store import load_records
from pytest_profllm.sim.calibration import ROWS, observation_of, one_host_groups, random_lengths
from pytest_profllm.sim.fit_records import METRICS, Observation, fit, predict
from pytest_profllm.sim.hardware import device_profile
from pytest_profllm.sim.profile_file import FittedOn, identity, load_profile_file, profile_toml
from pytest_profllm.sim.virtual import ServerSettings

MODEL = "Qwen/Qwen3-8B"
GPU = "NVIDIA H100 80GB HBM3"  # an alias of the shipped H100-SXM profile
BASE = device_profile("H100-SXM")
# The host the records come from: a slower matmul (0.6 x), a slower host (2 x per step), a
# lower share of the bandwidth and a quicker API server than the shipped profile's.
CHANGED = {
    "compute_efficiency": 0.30,
    "step_ms": 3.2,
    "bandwidth_efficiency": 0.60,
    "request_ms": 25.0,
}
TRUE = BASE.with_overheads(**CHANGED)
# Concurrency 1, 8 and 64 with short and long prompts: the loads tell the cost per step from
# the bandwidth, the prompt lengths the matmul rate from the API server's latency.
GRID = [(concurrency, input_len) for concurrency in (1, 8, 64) for input_len in (256, 4096)]
OUTPUT_LEN = 32


def a_record(index: int, concurrency: int, input_len: int, **changes: Any) -> dict[str, Any]:
    """A valid vLLM record whose figures are the simulator's under the changed profile."""
    benchmark = BenchmarkConfig.model_validate(
        {
            # One wave of requests at each load (the fit and its six folds replay every record
            # at each step: with two waves the fixture took twice as long; the fit is as sure).
            "num_prompts": max(8, concurrency),
            "random_input_len": input_len,
            "random_output_len": OUTPUT_LEN,
            "random_range_ratio": 0.2,
            "max_concurrency": concurrency,
            "seed": index,
        }
    )
    requests = random_lengths(benchmark.num_prompts, input_len, OUTPUT_LEN, 0.2, seed=index)
    observation = Observation("x", "x", MODEL, tuple(requests), {}, max_concurrency=concurrency)
    results: dict[str, Any] = {
        name: value for name, value in predict(observation, TRUE).items() if name in METRICS
    }
    results.update(completed=benchmark.num_prompts, failed=0)
    record = {
        "schema_version": 1,
        "run_id": f"run-{index:02d}",
        "session_id": "s1",
        "suite": "host",
        "source": "benchmarks/bench_host.yaml",
        "case_id": f"bench_host.yaml::qwen::c{concurrency}-in{input_len}",
        "nodeid": f"benchmarks/bench_host.yaml::qwen::c{concurrency}-in{input_len}",
        "timestamp": f"2026-11-27T00:00:{index:02d}+00:00",
        "duration": 10.0,
        "status": "passed",
        "engine": {"name": "vllm", "reason": "--profllm-engine vllm", "version": "0.33.0"},
        "config": {"server": {"model": MODEL}, "benchmark": benchmark.model_dump(mode="json")},
        "results": results,
        "system": {
            "host": "gpu-host",
            "platform": "Linux",
            "python": "3.12",
            "gpu_names": [GPU],
            "vllm_version": "0.33.0",
        },
        "runtime": {"worker": "gw0", "server_key": "k", "gpus": ["0"], "port": 1},
        "validity": "valid",
    }
    for key, value in changes.items():
        record[key] = value
    return normalize(record).model_dump(mode="json")


def a_database(tmp_path: Path, grid: list[tuple[int, int]]) -> Path:
    db = tmp_path / "results.db"
    load_records(db, [a_record(i, c, n) for i, (c, n) in enumerate(grid)])
    return db


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Calibration:
    """The runs of GRID calibrated on (one fit and its six folds: the slow part, done once)."""
    return calibrate(a_database(tmp_path_factory.mktemp("calibrate"), GRID))


def test_the_fit_gives_back_the_profile_the_records_were_made_with(
    calibrated: Calibration,
) -> None:
    calibration = calibrated
    assert calibration.host.device == GPU and calibration.base.name == "H100-SXM"
    fitted = calibration.fitted.params
    # Within 5 % of the changed figures; what these runs cannot show (the cost per sequence
    # and per token: no step here is CPU-bound) stays where it started, and is said so.
    for name, value in CHANGED.items():
        assert fitted[name] == pytest.approx(value, rel=0.05), name
    assert set(CHANGED) <= set(calibration.fitted.pinned)
    assert "frontend_token_us" not in calibration.fitted.pinned
    # Every configuration predicted by a fit on the five others: within 3 % on every figure.
    assert len(calibration.held_out) == len(GRID)
    worst = max(abs(e) for item in calibration.held_out for e in item.errors.values())
    assert worst < 0.03
    assert all(set(item.errors) == set(METRICS) for item in calibration.held_out)


def test_the_cost_per_sequence_comes_back_where_steps_are_cpu_bound() -> None:
    # A small model at 256 sequences: the host's work per sequence outlasts the GPU's step.
    true = BASE.with_overheads(seq_us=60.0, step_ms=3.2)
    observations = []
    for concurrency in (1, 16, 256):
        for input_len in (256, 4096):
            requests = tuple(random_lengths(concurrency + concurrency // 2, input_len, 32))
            made = Observation(
                "x", "x", "Qwen/Qwen3-0.6B", requests, {}, max_concurrency=concurrency
            )
            measured = {k: v for k, v in predict(made, true).items() if k in METRICS}
            observations.append(
                Observation(
                    f"c{concurrency}-{input_len}",
                    f"c{concurrency}-{input_len}",
                    made.model,
                    requests,
                    measured,
                    max_concurrency=concurrency,
                )
            )
    fitted = fit(observations, BASE, free=("step_ms", "seq_us", "bandwidth_efficiency"))
    assert fitted.params["seq_us"] == pytest.approx(60.0, rel=0.05)
    assert fitted.params["step_ms"] == pytest.approx(3.2, rel=0.05)
    assert "seq_us" in fitted.pinned


def test_the_command_prints_every_run_and_writes_a_profile_the_plugin_takes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    calibrated: Calibration,
) -> None:
    asked: list[tuple[Any, ...]] = []

    def known(*args: Any, **kwargs: Any) -> Calibration:  # the fixture's: the fit is slow
        asked.append((*args, kwargs))
        return calibrated

    monkeypatch.setattr("pytest_profllm.cli.calibrate.calibrate", known)
    out = tmp_path / "host.toml"
    where = "bench_max_concurrency > 0"
    assert main(["calibrate", "results.db", "-o", str(out), "--where", where]) == 0
    assert asked == [(Path("results.db"), where, None, {"hold_out": None})]
    printed = capsys.readouterr().out
    for index in range(len(GRID)):
        assert f"run-{index:02d}  concurrency" in printed
    assert "TPOT ms: median error" in printed and "ITL ms: median error" in printed
    profile = load_profile_file(out)
    assert profile.name == "H100-SXM-calibrated"
    assert profile.overheads.step_ms == pytest.approx(3.2, rel=0.05)
    fitted_on = identity(out)["fitted"]
    assert fitted_on["run_ids"] == [f"run-{i:02d}" for i in range(len(GRID))]
    assert fitted_on["device"] == GPU and fitted_on["vllm_version"] == "0.33.0"
    assert fitted_on["model"] == MODEL


@pytest.mark.parametrize(
    ("grid", "expected"),
    [
        (GRID[:3], "3 distinct configuration(s), at least 4 needed"),
        (
            [(8, 256), (8, 1024), (8, 4096), (8, 512)],
            "every run at one load (concurrency 8): the cost per sequence cannot be told",
        ),
        (
            [(1, 256), (4, 256), (16, 256), (64, 256)],
            "tokens long: the matmul rate cannot be told",
        ),
    ],
)
def test_runs_too_few_or_too_alike_are_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    grid: list[tuple[int, int]],
    expected: str,
) -> None:
    db = a_database(tmp_path, grid)
    assert main(["calibrate", str(db)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"profllm calibrate: cannot fit {len(grid)} runs: ")
    assert expected in line and "add runs" in line


def test_runs_of_several_hosts_and_a_bad_condition_are_refused(tmp_path: Path) -> None:
    db = a_database(tmp_path, GRID)
    other = a_record(50, 4, 512)
    other["system"]["vllm_version"] = "0.32.0"
    load_records(db, [other])
    with pytest.raises(CalibrationError, match=r"runs of 2 hosts .*vLLM 0.32.0.*--where"):
        calibrate(db)
    with pytest.raises(CalibrationError, match=r"^--where: no such column: nope"):
        calibrate(db, "nope = 1")
    with pytest.raises(CalibrationError, match="no valid vLLM run"):
        calibrate(db, "run_id = 'none'")
    with pytest.raises(CalibrationError, match="no such database"):
        calibrate(tmp_path / "missing.db")


def test_simulated_and_invalid_runs_are_not_calibrated_on(tmp_path: Path) -> None:
    db = tmp_path / "results.db"
    sim = a_record(1, 1, 256)
    sim["engine"] = {"name": "sim", "reason": "x", "version": "1"}
    load_records(db, [sim])
    with sqlite3.connect(db) as connection:
        assert connection.execute("select count(*) from benchmark_runs").fetchone() == (1,)
    with pytest.raises(CalibrationError, match="no valid vLLM run"):
        calibrate(db)
    assert math.isfinite(sim["results"]["median_tpot_ms"])


def test_published_rows_of_one_host_are_grouped_and_read_as_measured() -> None:
    groups = one_host_groups()
    assert {key: [row.number for row in rows] for key, rows in groups.items()} == {
        ("S2", "H100-SXM"): [7, 8, 9, 10, 11, 12, 13, 14],
        ("N1", "H200-DGX"): [101, 102, 103, 104, 105],
    }
    row = next(row for row in ROWS if row.number == 113)  # a source giving ITL, not TPOT
    assert observation_of(row).measured == {"output_throughput": 450.3, "median_itl_ms": 15.18}
    mlperf = next(row for row in ROWS if row.number == 126)  # 8 replicas, its own TPOT
    observed = observation_of(mlperf)
    assert observed.measured == {"output_throughput": 21028.23}
    assert observed.throughput_scale == 8 and len(observed.requests) == 2000


def test_hold_out_fits_on_the_other_runs_and_predicts_the_ones_it_picks(tmp_path: Path) -> None:
    db = a_database(tmp_path, GRID)
    calibration = calibrate(db, hold_out="bench_max_concurrency = 8")
    held = {item.observation.label for item in calibration.held_out}
    assert held == {"run-02", "run-03"}  # concurrency 8, both prompt lengths
    assert set(calibration.run_ids) == {f"run-{i:02d}" for i in range(len(GRID))} - held
    # Fitted on concurrency 1 and 64 alone, the runs at 8 come out as they were made.
    worst = max(abs(e) for item in calibration.held_out for e in item.errors.values())
    assert worst < 0.03
    lines = report_lines(calibration)
    assert "the 2 runs of --hold-out 'bench_max_concurrency = 8' predicted by a fit on the " \
        "other 4" in lines[0]
    with pytest.raises(CalibrationError, match="picks none of the runs") as none:
        calibrate(db, hold_out="bench_max_concurrency = 3")
    assert none.value.code == 2
    with pytest.raises(CalibrationError, match=r"^--hold-out: no such column: nope"):
        calibrate(db, hold_out="nope = 1")
    with pytest.raises(CalibrationError, match="cannot fit 2 runs outside --hold-out: 2 distinct"):
        calibrate(db, hold_out="bench_max_concurrency > 1")


def test_runs_of_vllms_cpu_build_are_fitted_from_the_cpu_base() -> None:
    row = {"system_gpu_names": "[]", "device": "cpu: Intel(R) Xeon(R) Processor",
           "system_vllm_version": "0.32.0", "server_model": "/models/tiny"}
    host = host_of(row)
    assert host.device == "cpu: Intel(R) Xeon(R) Processor"
    base = base_profile(host, None)
    assert base.name == "CPU" and base.serial_host
    assert base_profile(host, "H100-SXM").name == "H100-SXM"  # --base still wins


def test_a_run_is_replayed_with_the_requests_and_send_times_of_its_requests_file(
    tmp_path: Path,
) -> None:
    db = a_database(tmp_path, GRID[:1])
    (row,) = read_runs(db, None)
    flags = observation(row, tmp_path)  # no file: vLLM's random dataset from its flags
    assert flags.arrivals is None
    assert {r.prompt_len for r in flags.requests} != {100, 300}
    sent = [
        {"index": 0, "success": True, "prompt_len": 300, "output_tokens": 20,
         "intended_start_s": 5.5},
        {"index": 1, "success": False, "prompt_len": 999, "output_tokens": 0,
         "intended_start_s": 5.0},  # failed: out of the measured figures, out of the replay
        {"index": 2, "success": True, "prompt_len": 100, "output_tokens": 10,
         "intended_start_s": 5.25},
    ]
    path = tmp_path / f"{row['run_id']}.requests.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in sent)))
    replayed = observation(row, tmp_path)
    assert [(r.prompt_len, r.output_len) for r in replayed.requests] == [(100, 10), (300, 20)]
    assert replayed.arrivals == (0.0, 0.25)
    path.write_bytes(b"not gzip")  # unreadable: replayed from its flags, as without one
    assert observation(row, tmp_path).requests == flags.requests
    for bad in ({"prompt_len": -3}, {"output_tokens": True}, {"intended_start_s": "soon"}):
        lines = [json.dumps({**sent[0], **bad}).encode(), json.dumps(sent[2]).encode()]
        path.write_bytes(gzip.compress(b"\n".join(lines)))
        assert observation(row, tmp_path).requests == flags.requests, bad  # not a figure


def test_a_run_that_fills_its_kv_cache_is_replayed_with_the_cache_its_server_had(
    tmp_path: Path,
) -> None:
    # A server that sized its cache at 300 blocks of 16 tokens (its /metrics said so; no flag
    # set it), under 64 prompts of 4,096 tokens: the cache, not the GPU, bounds the run.
    concurrency, input_len, blocks = 64, 4096, 300
    base = a_record(0, concurrency, input_len)
    prompts = base["config"]["benchmark"]["num_prompts"]
    requests = random_lengths(prompts, input_len, OUTPUT_LEN, 0.2, seed=0)
    run = Observation("x", "x", MODEL, tuple(requests), {}, max_concurrency=concurrency,
                      settings=ServerSettings(num_gpu_blocks=blocks))
    measured = {name: value for name, value in predict(run, TRUE).items() if name in METRICS}
    record = a_record(
        0, concurrency, input_len,
        results={**measured, "completed": prompts, "failed": 0},
        system={**base["system"], "server_num_gpu_blocks": blocks, "server_kv_block_size": 16,
                "server_kv_cache_tokens": blocks * 16},
    )
    db = tmp_path / "results.db"
    load_records(db, [record])
    (row,) = read_runs(db, None)
    replayed = observation(row, tmp_path)
    assert (replayed.settings.num_gpu_blocks, replayed.settings.block_size) == (blocks, 16)
    # Replayed so, the true profile gives the run's figures back; sized by the simulator's
    # own memory estimate instead (as before the record said), it gives other ones.
    assert predict(replayed, TRUE)["median_tpot_ms"] == pytest.approx(
        measured["median_tpot_ms"], rel=1e-9
    )
    # A count that is not one (a record from elsewhere) falls back to the estimate.
    for bad in (-300, 0):
        row_bad = {**row, "system_server_num_gpu_blocks": bad}
        assert observation(row_bad, tmp_path).settings.num_gpu_blocks is None, bad
    estimated = Observation(
        "x", "x", MODEL, replayed.requests, {}, max_concurrency=concurrency, seed=replayed.seed
    )
    assert predict(estimated, TRUE)["median_tpot_ms"] > 1.5 * measured["median_tpot_ms"]


BENCH_CHANGES = st.fixed_dictionaries({}, optional={
    "random_input_len": st.none() | st.integers(-5, 10**12) | st.floats() | st.text(max_size=3),
    "random_output_len": st.none() | st.integers(-5, 10**12) | st.floats(),
    "random_range_ratio": st.none() | st.floats(),
    "num_prompts": st.integers(-5, 10**10) | st.floats() | st.none(),
    "seed": st.integers() | st.text(max_size=3) | st.floats() | st.none(),
    "request_rate": st.floats() | st.text(max_size=3),
    "kind": st.sampled_from(["serve", "capacity", "throughput", "latency"]),
})
RESULT_CHANGES = st.fixed_dictionaries({}, optional={
    name: st.floats() | st.integers(-5, 10**12) for name in METRICS
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bench=BENCH_CHANGES, results=RESULT_CHANGES, run_id=st.text(min_size=1, max_size=8))
def test_any_row_ingest_accepts_is_replayed_or_named_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, bench: dict[str, Any], results: dict[str, Any],
    run_id: str,
) -> None:
    good = a_record(0, 8, 256)
    hostile = json.loads(json.dumps(good))
    hostile["config"]["benchmark"].update(bench)
    hostile["results"].update(results)
    hostile["run_id"] = run_id
    try:
        record = normalize(hostile).model_dump(mode="json")
    except ValueError:
        return  # ingest refuses it: no row
    db = tmp_path_factory.mktemp("rows") / "results.db"
    try:
        load_records(db, [record])
    except ValueError:
        return
    rows = read_runs(db, None)
    kept, left = usable(rows, db.parent)
    assert len(kept) + len(left) == len(rows)  # each row replayed or named
    for named, why in left:
        assert named == run_id and why and "\n" not in why
    for _, made in kept:
        assert 1 <= len(made.requests) <= MAX_CALIBRATE_REQUESTS
        assert all(math.isfinite(v) for v in made.measured.values())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"random_input_len": None}, "bench_random_input_len"),
        ({"seed": "x"}, "seed"),
        ({"random_range_ratio": 7.5}, "ratio"),
        ({"num_prompts": 200_000_000}, "200000000"),
        ({"kind": "capacity"}, "capacity"),
    ],
)
def test_a_row_that_cannot_be_replayed_is_left_out_and_named(
    tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    # Before: TypeError, ValueError, a math domain error, 2.2 GB of prompts drawn, or a
    # capacity search fitted as one serving load.
    hostile = a_record(9, 8, 256)
    hostile["config"]["benchmark"].update(change)
    db = tmp_path / "results.db"
    load_records(db, [normalize(hostile).model_dump(mode="json")])
    kept, left = usable(read_runs(db, None), tmp_path)
    assert kept == []
    ((run_id, why),) = left
    assert run_id == "run-09" and named in why and "\n" not in why


def test_a_requests_file_past_the_limits_leaves_the_run_replayed_from_its_flags(
    tmp_path: Path,
) -> None:
    # Before: one line of 100,000,000 output tokens ran the fit for minutes.
    record = a_record(3, 8, 256)
    db = tmp_path / "results.db"
    load_records(db, [record])
    rows = [{"index": i, "success": True, "prompt_len": 256, "output_tokens": 100_000_000,
             "intended_start_s": 0.0} for i in range(record["results"]["completed"])]
    write_requests(tmp_path, "run-03", rows)
    ((_, made),), left = usable(read_runs(db, None), tmp_path)
    assert left == []
    assert max(r.output_len for r in made.requests) < 10_000


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_a_profile_path_that_cannot_be_written_is_one_line_before_the_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    db = a_database(tmp_path, GRID[:1])  # too few runs to fit: the path is checked first
    output = tmp_path if where == "folder" else tmp_path / "nonexistent" / "dir" / "x.toml"
    assert main(["calibrate", str(db), "-o", str(output)]) != 0
    said = capsys.readouterr().err.strip()
    assert str(output) in said and "\n" not in said and "cannot fit" not in said
    assert not (tmp_path / "nonexistent").exists()


def test_a_run_id_with_a_newline_writes_a_profile_that_reads_back(tmp_path: Path) -> None:
    profile = device_profile("A100-80GB")
    fitted = FittedOn(run_ids=["run\nid", 'q"\\\x07'], device="A100")
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(profile, fitted, ["fitted on run\nid", "x = 1"]))
    assert identity(path)["fitted"]["run_ids"] == ["run\nid", 'q"\\\x07']
    assert load_profile_file(path).bf16_tflops == profile.bf16_tflops
