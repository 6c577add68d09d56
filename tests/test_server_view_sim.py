"""The simulated engine's latency histograms mean what vLLM's do, and `profllm bench` reports
them: checked against the request timeline the simulator logged and against two raw scrapes
of its /metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pytest_profllm.cli.main import main

NAMES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "e2el": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "inference": "vllm:request_inference_time_seconds",
}


def raw_scrape(url: str) -> dict[str, float]:
    """`_sum`, `_count` and TTFT's buckets, read here with prometheus_client's parser alone
    (not the plugin's scrape), summed over engines."""
    text = requests.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if sample.name.endswith("_bucket"):
                key += "@" + sample.labels["le"]
            values[key] = values.get(key, 0.0) + sample.value
    return values


def run_bench(url: str, tmp_path: Path, *flags: str, model: str = "sim") -> dict[str, Any]:
    code = main(
        [
            "bench", "--base-url", url, "--model", model, "--num-prompts", "24",
            "--random-input-len", "64", "--random-output-len", "8", "--max-concurrency", "4",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
            *flags,
        ]
    )  # fmt: skip
    assert code in (0, 3)  # 3: the busy host made it invalid; the server's view stands
    result: dict[str, Any] = json.loads((tmp_path / "out.json").read_text())
    return result


def test_the_record_has_the_servers_means_of_the_window(sim_url: str, tmp_path: Path) -> None:
    check_means_of_the_window(sim_url, tmp_path)


def check_means_of_the_window(url: str, tmp_path: Path, *flags: str, model: str = "sim") -> None:
    """The server's mean TTFT and E2E in `profllm bench`'s result are within 1 % of those of
    two scrapes of /metrics just around it; the client's means are never under them."""
    before = raw_scrape(url)
    result = run_bench(url, tmp_path, *flags, model=model)
    after = raw_scrape(url)
    for short in ("ttft", "e2el"):
        name = NAMES[short]
        count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
        mean_ms = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count * 1000
        assert count == 24
        assert result[f"server_{short}_count"] == 24
        assert result[f"server_{short}_mean_ms"] == pytest.approx(mean_ms, rel=0.01)
    assert result["server_view"]["problem"] is None
    median = result["server_view"]["histograms"]["ttft"]["median"]
    assert median["lower"] <= median["estimate"] <= median["upper"]
    # The client's clock starts before the server's and stops after it.
    assert result["client_overhead_ttft_ms"] >= -1.0
    assert result["client_overhead_e2el_ms"] >= -1.0
    assert result["client_overhead_ttft_ms"] == pytest.approx(
        result["mean_ttft_ms"] - result["server_ttft_mean_ms"]
    )


# vLLM's phases (vllm/v1/metrics/stats.py) from the timestamps the simulator logged.
PHASES = {
    "ttft": ("arrived", "first_token"),
    "e2el": ("arrived", "last_token"),
    "queue": ("queued", "scheduled"),
    "prefill": ("scheduled", "first_token"),
    "decode": ("first_token", "last_token"),
    "inference": ("scheduled", "last_token"),
}


def test_the_histograms_agree_with_the_logged_timeline(sim_url: str, tmp_path: Path) -> None:
    before = raw_scrape(sim_url)
    run_bench(sim_url, tmp_path, "--request-rate", "200")
    after = raw_scrape(sim_url)
    lines = (tmp_path / "emissions.jsonl").read_text().splitlines()
    timeline = [json.loads(line) for line in lines]
    timeline = [t for t in timeline if t["emitted"]][-24:]
    assert len(timeline) == 24

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    for short, (start, end) in PHASES.items():
        name = NAMES[short]
        values = [t["timeline"][end] - t["timeline"][start] for t in timeline]
        assert delta(name + "_count") == 24
        assert delta(name + "_sum") == pytest.approx(sum(values), abs=1e-6), short
        # Each bucket counts the logged phases at or under its bound.
        for key in after:
            if key.startswith(name + "_bucket@"):
                bound = float(key.split("@")[1])
                assert delta(key) == sum(1 for v in values if v <= bound), (key, values)
    for t in timeline:
        stamps = t["timeline"]
        assert stamps["arrived"] <= stamps["queued"] <= stamps["scheduled"]
        assert stamps["scheduled"] <= stamps["first_token"] <= stamps["last_token"]
        # A token is stamped before its message is written to the socket.
        assert stamps["first_token"] <= t["emitted"][0]
        assert stamps["last_token"] <= t["emitted"][-1]
