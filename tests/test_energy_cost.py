"""Energy per token from NVML's energy counters, and cost per million tokens at a GPU-hour
price: in the record, the database and the run page. NVML is faked at the library boundary
only: the real `pynvml` module's functions are replaced, nothing of ours."""

from __future__ import annotations

import argparse
import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from helpers import run_records, run_suites
from hypothesis import given
from hypothesis import strategies as st
from test_datasette import make_record

from pytest_profllm.browse.run_page import run_page
from pytest_profllm.options import parse_gpu_hour_price
from pytest_profllm.results.ingest import ingest
from pytest_profllm.run.cost import case_cost, energy_per_output_token, priced_gpus
from pytest_profllm.run.telemetry import Sampler

MIB = 2**20


class Board:
    """One GPU as NVML's functions see it: its energy counter (millijoules since the driver
    loaded) moves on by `step_mj` at every read; None: the board has no counter."""

    def __init__(self, start_mj: int, step_mj: int | None) -> None:
        self.counter = start_mj
        self.step_mj = step_mj

    def energy(self) -> int:
        if self.step_mj is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        reading = self.counter
        self.counter += self.step_mj
        return reading


def fake_nvml(monkeypatch: pytest.MonkeyPatch, boards: list[Board]) -> None:
    """Replaces the `pynvml` functions hosts/nvml.py calls with ones over `boards`."""

    def unsupported(*_: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    calls: dict[str, Callable[..., Any]] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(boards),
        "nvmlDeviceGetHandleByIndex": lambda index: boards[index],
        "nvmlDeviceGetTotalEnergyConsumption": lambda board: board.energy(),
        "nvmlDeviceGetUtilizationRates": unsupported,
        "nvmlDeviceGetMemoryInfo": unsupported,
        "nvmlDeviceGetPowerUsage": unsupported,
        "nvmlDeviceGetClockInfo": unsupported,
        "nvmlDeviceGetTemperature": unsupported,
    }
    for name, call in calls.items():
        monkeypatch.setattr(pynvml, name, call)


def sampled(gpu_ids: list[str]) -> dict[str, Any]:
    with Sampler(None, gpu_ids, None, interval_s=0.05) as sampler:
        pass
    return sampler.record()


def test_energy_is_the_counters_difference_summed_over_the_leased_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GPU 1 is not leased: its counter must not count.
    fake_nvml(monkeypatch, [Board(5_000_000, 300_000), Board(0, 999_000),
                            Board(7_000_000, 100_000)])
    figures = sampled(["0", "2"])
    assert figures["gpu_energy_j"] == pytest.approx(400.0)  # 300 J + 100 J
    assert figures["gpu_energy_window_s"] > 0
    assert figures["mean_gpu_power_from_energy_w"] == pytest.approx(
        400.0 / figures["gpu_energy_window_s"])
    assert figures["gpu_energy_problem"] is None
    assert energy_per_output_token(figures["gpu_energy_j"], {"total_output_tokens": 800}) == 0.5
    # A capacity search's energy spans all its probes, its results one: no per-token figure.
    assert energy_per_output_token(400.0, {"total_output_tokens": 800}, "capacity") is None


def test_a_gpu_without_an_energy_counter_makes_the_energy_null_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_nvml(monkeypatch, [Board(5_000_000, 300_000), Board(0, None)])
    figures = sampled(["0", "1"])
    assert figures["gpu_energy_j"] is None
    assert figures["mean_gpu_power_from_energy_w"] is None
    assert figures["gpu_energy_problem"] == "GPU 1: NVML energy counter: Not Supported"
    assert energy_per_output_token(figures["gpu_energy_j"], {"total_output_tokens": 800}) is None


def test_without_nvml_the_energy_is_null_and_nothing_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    with caplog.at_level(logging.DEBUG, logger="profllm"):
        figures = sampled(["0"])
    assert {name: figures[name] for name in ("gpu_energy_j", "gpu_energy_window_s",
                                             "mean_gpu_power_from_energy_w",
                                             "gpu_energy_problem", "telemetry_problem")} == (
        dict.fromkeys(("gpu_energy_j", "gpu_energy_window_s", "mean_gpu_power_from_energy_w",
                       "gpu_energy_problem", "telemetry_problem")))
    assert caplog.records == []


def test_a_counter_that_goes_back_gives_no_energy(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, [Board(5_000_000, -1_000)])
    figures = sampled(["0"])
    assert figures["gpu_energy_j"] is None
    assert "went back" in figures["gpu_energy_problem"]


@given(
    price=st.floats(0, 1000),
    gpus=st.integers(1, 64),
    duration=st.floats(0.001, 1e6),
    tokens=st.integers(1, 10**9),
)
def test_cost_is_the_price_of_the_gpu_seconds_over_the_output_tokens(
    price: float, gpus: int, duration: float, tokens: int
) -> None:
    cost = case_cost(price, {"duration": duration, "total_output_tokens": tokens}, gpus,
                     "leased")
    assert cost is not None
    assert cost["gpu_seconds"] == pytest.approx(gpus * duration)
    assert cost["usd"] == pytest.approx(price * gpus * duration / 3600)
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        price / 3600 * gpus * duration / tokens * 1e6)
    assert cost["problem"] is None


@given(price=st.text(max_size=40) | st.floats().map(repr))
def test_any_price_gives_finite_cost_figures_or_one_line(price: str) -> None:
    # Any price the option takes prices any finite record with finite figures (or null ones
    # with the reason); any other is refused as a usage error, before a case runs.
    try:
        value = parse_gpu_hour_price(price)
    except argparse.ArgumentTypeError as refused:
        assert "\n" not in str(refused) and "price" in str(refused)
        return
    for duration, tokens, gpus in [(1e-3, 1, 1), (1e308, 1, 1024), (3600.0, 10**9, 8)]:
        cost = case_cost(value, {"duration": duration, "total_output_tokens": tokens}, gpus,
                         "leased")
        assert cost is not None
        json.dumps(cost, allow_nan=False)  # no inf or NaN: the record stays plain JSON
        if cost["usd_per_million_output_tokens"] is None:
            assert cost["problem"]


def test_nothing_to_price_gives_null_figures_with_the_reason() -> None:
    assert case_cost(None, {"duration": 1.0, "total_output_tokens": 5}, 1, "leased") is None
    on_cpu = case_cost(2.5, {"duration": 1.0, "total_output_tokens": 5}, *priced_gpus("cpu", 2))
    assert on_cpu is not None
    assert on_cpu["gpu_hour_price_usd"] == 2.5
    assert on_cpu["usd_per_million_output_tokens"] is None
    assert "no GPUs" in on_cpu["problem"]
    pooled = case_cost(2.5, {"duration": 1.0, "total_output_tokens": 0}, 1, "simulated")
    assert pooled is not None and pooled["problem"] == "the load made no output tokens"
    assert priced_gpus("gpu", 2) == (2, "leased")
    assert priced_gpus("virtual", 4) == (4, "simulated")


PRICED_SUITE = """
server:
  model: Qwen/Qwen3-8B
  tensor_parallel_size: 2
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 8
"""


def test_a_priced_run_has_its_cost_in_the_record_and_the_database(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_priced=PRICED_SUITE)
    pytester.makeini("[pytest]\nprofllm_gpu_hour_price = 9\n")
    result = run_suites(pytester, ports, "--profllm-gpu-hour-price=2.50")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    cost = record["cost"]
    results = record["results"]
    # The option wins over the ini key; the simulator's two virtual GPUs are counted.
    assert cost["gpu_hour_price_usd"] == 2.5
    assert (cost["gpus"], cost["gpus_counted"]) == (2, "simulated")
    assert cost["window_s"] == results["duration"]
    assert cost["gpu_seconds"] == pytest.approx(2 * results["duration"])
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        2.5 / 3600 * 2 * results["duration"] / results["total_output_tokens"] * 1e6)
    # The simulator's GPUs are virtual: no NVML energy, and no reason to say so.
    assert record["system"]["gpu_energy_j"] is None
    assert record["system"]["gpu_energy_j_per_output_token"] is None
    assert record["system"]["gpu_energy_problem"] is None
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        row = db.execute(
            "SELECT cost_gpu_hour_price_usd, cost_gpus, cost_gpus_counted, cost_gpu_seconds, "
            "cost_usd_per_million_output_tokens, system_gpu_energy_j FROM benchmark_runs"
        ).fetchone()
    assert row == (2.5, 2, "simulated", pytest.approx(cost["gpu_seconds"]),
                   pytest.approx(cost["usd_per_million_output_tokens"]), None)


def test_the_virtual_clock_prices_the_same_simulated_gpus_as_the_real_time_simulator(
    pytester: pytest.Pytester, ports: str
) -> None:
    # Before: null, "the server held no GPUs (vLLM on CPU cores)", where the real-time
    # simulator counted its virtual GPUs for the same suite.
    pytester.makefile(".yaml", bench_priced=PRICED_SUITE)
    result = run_suites(pytester, ports, "--profllm-gpu-hour-price=2.50",
                        "--profllm-sim-clock=virtual")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    cost, results = record["cost"], record["results"]
    assert record["engine"]["clock"] == "virtual"
    assert (cost["gpus"], cost["gpus_counted"], cost["problem"]) == (2, "simulated", None)
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        2.5 / 3600 * 2 * results["duration"] / results["total_output_tokens"] * 1e6)


def test_an_unpriced_run_has_no_cost(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_priced=PRICED_SUITE)
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["cost"] is None
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        row = db.execute(
            "SELECT cost_gpu_hour_price_usd, cost_usd_per_million_output_tokens "
            "FROM benchmark_runs").fetchone()
    assert row == (None, None)
    json.dumps(record)  # the record stays plain JSON


@pytest.mark.parametrize("price", ["-1", "1e308"])
def test_a_bad_price_is_one_line_naming_the_option(
    pytester: pytest.Pytester, ports: str, price: str
) -> None:
    pytester.makefile(".yaml", bench_priced=PRICED_SUITE)
    result = run_suites(pytester, ports, f"--profllm-gpu-hour-price={price}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--profllm-gpu-hour-price:*{price!r}*"])
    assert "INTERNALERROR" not in result.stderr.str() + result.stdout.str()


def test_a_bad_price_in_the_ini_file_is_one_line(pytester: pytest.Pytester, ports: str) -> None:
    # Apart from the command line's: one session for the ini file, not one per bad price.
    pytester.makefile(".yaml", bench_priced=PRICED_SUITE)
    pytester.makeini("[pytest]\nprofllm_gpu_hour_price = cheap\n")
    result = run_suites(pytester, ports)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*ini option profllm_gpu_hour_price: expected a price*"])


def test_the_run_page_shows_energy_and_the_cost_at_its_own_price(tmp_path: Path) -> None:
    record = make_record("priced", "s1", "bench_smoke.yaml::qwen3-8b::random",
                         "2026-01-01T10:00:00+00:00")
    record["system"].update(gpu_energy_j=1200.0, gpu_energy_window_s=10.0,
                            mean_gpu_power_from_energy_w=120.0,
                            gpu_energy_j_per_output_token=0.6)
    record["cost"] = case_cost(2.5, {"duration": 10.0, "total_output_tokens": 2000}, 2,
                               "leased")
    unpriced = make_record("unpriced", "s1", "bench_smoke.yaml::qwen3-8b::other",
                           "2026-01-01T10:01:00+00:00")
    for each in (record, unpriced):
        (tmp_path / f"{each['run_id']}.json").write_text(json.dumps(each))
    db = tmp_path / "results.db"
    ingest(db, sorted(tmp_path.glob("*.json")))
    with sqlite3.connect(db) as connection:
        page = run_page(connection, "priced")
        plain = run_page(connection, "unpriced")
    assert page is not None and plain is not None
    shown = {label: (value, unit) for label, value, unit in page.headlines}
    assert shown["GPU energy per output token"] == ("0.6", "J/tok")
    assert shown["mean GPU power (energy counter)"] == ("120", "W")
    # 2.5 $/h x 2 GPUs x 10 s = $0.01389, over 2000 tokens: $6.944 per million.
    assert shown["cost per million output tokens (at $2.5 per GPU-hour, 2 GPUs)"] == (
        "6.944", "USD")
    assert ("cost_gpus_counted", "leased") in page.system
    assert not any("energy" in label or "cost" in label for label, _, _ in plain.headlines)


def test_a_case_that_measured_nothing_says_so_before_it_says_anything_of_gpus() -> None:
    cost = case_cost(2.5, {}, *priced_gpus("gpu", 0))
    assert cost is not None and cost["problem"] == "no load duration was measured"
