"""LoRA adapter mixes: a workload's `lora_mix` gives each request (or conversation) a model by
weight or in turn, from its seed; a bad mix is one line before any server starts; the
simulated engine serves `--lora-modules` by name, holds `--max-loras` resident and loads the
others (the batch waits); the record and the run page carry each model's figures."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from datasette.app import Datasette
from helpers import run_records, run_suites, simulator
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.browse.run_page import run_page
from pytest_profllm.engine.registry import bundled
from pytest_profllm.load.bench import load_settings
from pytest_profllm.load.client import request_payload
from pytest_profllm.load.conversation import Conversations, make_workload
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.lora_mix import assign_models, by_adapter
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.plan.suite import BenchmarkConfig, SuiteError
from pytest_profllm.plan.suite.validate import validate_suite
from pytest_profllm.sim.batching import ConstantStepCost, Scheduler
from pytest_profllm.sim.lora import LoraCost, LoraSlots, adapter_paths
from pytest_profllm.sim.model_files import MODEL_DIR

ROOT = Path(__file__).parent.parent
SHIPPED = ROOT / "benchmarks" / "bench_lora.yaml"
SERVER = {
    "model": "m",
    "enable_lora": True,
    "lora_modules": ["a=/adapters/a", {"name": "b", "path": "/adapters/b"}],
}

names = st.text(alphabet="abcdefgh", min_size=1, max_size=4)
mixes = st.dictionaries(names, st.floats(0.01, 100), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(mix=mixes, seed=st.integers(0, 2**31 - 1), count=st.integers(0, 300),
       assignment=st.sampled_from(["weighted", "round_robin"]))
def test_every_request_gets_a_model_of_the_mix_the_same_for_a_seed(
    mix: dict[str, float], seed: int, count: int, assignment: str
) -> None:
    models = assign_models(count, mix, assignment, seed)
    assert len(models) == count and set(models) <= set(mix)
    assert models == assign_models(count, mix, assignment, seed)


def test_round_robin_keeps_the_weights_exactly_and_weighted_draws_near_them() -> None:
    cycle = assign_models(12, {"a": 2, "b": 1, "c": 1}, "round_robin", 0)
    assert cycle == ["a", "a", "b", "c"] * 3
    drawn = Counter(assign_models(10_000, {"a": 50, "b": 30, "c": 20}, "weighted", 3))
    assert {name: round(n / 10_000, 1) for name, n in drawn.items()} == {
        "a": 0.5, "b": 0.3, "c": 0.2
    }
    assert assign_models(50, {"a": 1, "b": 1}, "weighted", 1) != assign_models(
        50, {"a": 1, "b": 1}, "weighted", 2
    )


def test_a_conversation_keeps_one_model_and_single_requests_each_get_theirs() -> None:
    codec = TokenizerCodec.load(str(MODEL_DIR))
    mix = {"a": 1.0, "b": 1.0, "m": 1.0}
    chat = BenchmarkConfig(backend="openai-chat", dataset_name="conversation", num_prompts=9,
                           conversation_turns=3, conversation_input_len=8,
                           conversation_output_len=4, lora_mix=mix,
                           lora_assignment="round_robin")
    workload = make_workload(chat, codec)
    assert isinstance(workload, Conversations)
    assert [c.model for c in workload.sessions] == ["a", "b", "m"] * 3
    single = BenchmarkConfig(num_prompts=20, random_input_len=8, random_output_len=4,
                             lora_mix=mix, seed=4)
    prompts = make_prompts(single, codec)
    assert [p.model for p in prompts] == assign_models(20, mix, "weighted", 4)
    assert request_payload(load_settings(single, "http://x", "m"), prompts[0])["model"] == (
        prompts[0].model
    )


def _problems(server: dict[str, Any], workload: dict[str, Any]) -> str:
    with pytest.raises(SuiteError) as error:
        validate_suite({"server": server, "benchmark": workload}, "bench_l.yaml")
    return str(error.value)


@pytest.mark.parametrize(
    ("server", "workload", "message"),
    [
        (SERVER, {"lora_mix": {"a": 1, "zz": 1}},
         "bench_l.yaml: benchmark.lora_mix: 'zz' is neither an adapter of server.lora_modules "
         "(a, b) nor the base model ('m')"),
        ({"model": "m"}, {"lora_mix": {"a": 1}},
         "bench_l.yaml: benchmark.lora_mix: 'a' is neither an adapter of server.lora_modules "
         "(none) nor the base model ('m')"),
        ({**SERVER, "enable_lora": False}, {"lora_mix": {"a": 1}},
         "bench_l.yaml: benchmark.lora_mix asks for adapters: the server needs "
         "enable_lora: true"),
        (SERVER, {"lora_mix": {"a": 0}},
         "bench_l.yaml: benchmark.lora_mix: lora_mix weight of 'a' is 0; weights must be "
         "positive"),
        (SERVER, {"lora_mix": {}},
         "bench_l.yaml: benchmark.lora_mix: lora_mix names no model; give adapter names "
         "with weights"),
        (SERVER, {"lora_assignment": "round_robin"},
         "bench_l.yaml: benchmark: lora_assignment needs lora_mix (the adapters and their "
         "weights)"),
        (SERVER, {"lora_mix": {"a": 1}, "lora_assignment": "sticky"},
         "bench_l.yaml: benchmark.lora_assignment: Input should be 'weighted' or "
         "'round_robin' (got 'sticky')"),
    ],
)
def test_a_bad_mix_is_one_line(
    server: dict[str, Any], workload: dict[str, Any], message: str
) -> None:
    assert _problems(server, workload) == message


def test_a_mix_may_name_the_base_model_by_its_served_name() -> None:
    suite = validate_suite(
        {"server": {**SERVER, "served_model_name": ["base"]},
         "benchmark": {"lora_mix": {"a": 2, "b": 1, "base": 1}}},
        "bench_l.yaml",
    )
    assert suite.benchmark["lora_mix"] == {"a": 2, "b": 1, "base": 1}


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        ("a=/p", True),
        ({"name": "a", "path": "/p", "base_model_name": "m"}, True),
        ('{"name": "a", "path": "/p"}', True),
        ("a=/p,q", False),  # vLLM reads a text with a comma as JSON, and fails
        ({"name": "a"}, False),
        ({"name": "a", "path": "/p", "rank": 8}, False),
        ("=/p", False),
    ],
)
def test_lora_modules_values_are_checked_as_vllm_reads_them(value: Any, accepted: bool) -> None:
    option = bundled().options["lora_modules"]
    if accepted:
        option.check([value])
        return
    with pytest.raises(ValueError):
        option.check([value])


def test_lora_modules_render_as_vllm_parses_them() -> None:
    option = bundled().options["lora_modules"]
    argv = option.render(SERVER["lora_modules"])
    assert argv == ["--lora-modules", "a=/adapters/a", '{"name":"b","path":"/adapters/b"}']
    assert adapter_paths(argv[1:]) == {"a": "/adapters/a", "b": "/adapters/b"}


def test_by_adapter_counts_each_models_requests_failures_and_latencies() -> None:
    def outcome(model: str, ok: bool, ttft: float) -> RequestOutcome:
        return RequestOutcome(prompt_len=10, success=ok, output_tokens=11 if ok else None,
                              ttft=ttft, latency=ttft + 1.0, model=model)

    rows = by_adapter(
        [outcome("a", True, 0.1), outcome("a", True, 0.3), outcome("b", False, 0.0),
         outcome("b", True, 0.2)],
        duration=2.0,
    )
    assert rows is not None
    table = {row["model"]: row for row in rows}
    assert (table["a"]["requests"], table["a"]["completed"], table["a"]["failed"]) == (2, 2, 0)
    assert (table["b"]["requests"], table["b"]["completed"], table["b"]["failed"]) == (2, 1, 1)
    assert table["a"]["median_ttft_ms"] == pytest.approx(200.0)
    assert table["a"]["median_tpot_ms"] == pytest.approx(100.0)  # 1 s over 10 tokens
    assert table["a"]["request_throughput"] == 1.0
    assert table["a"]["output_throughput"] == 11.0
    assert by_adapter([RequestOutcome(prompt_len=1)], 1.0) is None


def _slots(max_loras: int) -> LoraSlots:
    return LoraSlots({"a": "/a", "b": "/b", "c": "/c"}, max_loras, 16,
                     LoraCost(load_s=0.05, token_s=0.0, weights_s=0.0))


def _ttfts(max_loras: int) -> tuple[dict[str, list[float]], int]:
    scheduler = Scheduler(ConstantStepCost(0.01), max_num_seqs=16, max_num_batched_tokens=4096,
                          stream_tokens=False, lora=_slots(max_loras))
    now = 0.0
    scheduler.clock = lambda: now
    adapters = ["a", "b", "c"] * 8
    sequences = [scheduler.submit(64, 8, None, adapter=name) for name in adapters]
    while (step := scheduler.plan_step()) is not None:
        assert len({s.adapter for s in scheduler.running}) <= max_loras
        now += scheduler.step_duration(step)
        scheduler.finish_step(step, now)
    ttfts: dict[str, list[float]] = {}
    for sequence in sequences:
        assert sequence.first_token_at is not None
        ttfts.setdefault(str(sequence.adapter), []).append(sequence.first_token_at)
    assert scheduler.lora is not None
    return ttfts, scheduler.lora.loads


def test_one_slot_runs_one_adapter_at_a_time_and_reloads_on_each_swap() -> None:
    one, loads_one = _ttfts(1)
    three, loads_three = _ttfts(3)
    assert loads_three == 3  # each adapter loaded once, then resident
    assert loads_one >= 3
    # The first adapter's burst runs alone and early; the others wait for it to finish.
    assert np.mean([t for v in one.values() for t in v]) > np.mean(
        [t for v in three.values() for t in v]
    )
    assert np.median(one["c"]) > np.median(three["c"])


def test_the_simulator_serves_its_adapters_and_refuses_others_as_vllm(
    port_range: str, tmp_path: Path
) -> None:
    first = int(port_range.split("-")[0]) + 70
    args = ("sim", "--enable-lora", "--lora-modules", "a=/adapters/a",
            '{"name": "b", "path": "/adapters/b"}', "--max-loras", "1")
    with simulator(first, tmp_path / "sim.log", *args) as url:
        listed = requests.get(url + "/v1/models", timeout=10).json()["data"]
        answers = {
            model: requests.post(
                url + "/v1/completions",
                json={"model": model, "prompt": "hello there", "max_tokens": 3},
                timeout=30,
            )
            for model in ("sim", "a", "b", "nope")
        }
    assert [(card["id"], card["root"], card["parent"]) for card in listed] == [
        ("sim", "sim", None), ("a", "/adapters/a", "sim"), ("b", "/adapters/b", "sim")
    ]
    assert [answers[m].status_code for m in ("sim", "a", "b")] == [200, 200, 200]
    assert answers["a"].json()["model"] == "a"
    assert answers["nope"].status_code == 404
    assert answers["nope"].json() == {"error": {
        "message": "The model `nope` does not exist. Valid aliases: sim.",
        "type": "NotFoundError",
        "param": "model", "code": 404,
    }}


def _page_html(db: Path, url: str) -> str:
    async def fetch() -> str:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        response = await datasette.client.get(url)
        assert response.status_code == 200
        text: str = response.text
        return text

    return asyncio.run(fetch())


def _virtual_suite(max_loras: str) -> str:
    text = SHIPPED.read_text()
    return text.replace("max_loras: [1, 3]", f"max_loras: {max_loras}")


def test_the_shipped_mix_on_the_virtual_clock_one_slot_costs_ttft(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_lora=_virtual_suite("[1, 3]"))
    result = run_suites(pytester, ports, "-n", "0", "--profllm-engine", "sim",
                        "--profllm-sim-clock", "virtual", cache=False)
    result.assert_outcomes(passed=2)
    records = {r["config"]["server"]["max_loras"]: r for r in run_records(pytester)}
    tables = {n: {row["model"]: row for row in records[n]["by_adapter"]} for n in (1, 3)}
    # The same seed, the same mix: each model's requests are the same on both servers.
    assert {m: r["requests"] for m, r in tables[1].items()} == {
        m: r["requests"] for m, r in tables[3].items()
    }
    assert sum(r["requests"] for r in tables[1].values()) == 60
    for model in ("sql", "chat", "code"):
        assert tables[1][model]["median_ttft_ms"] > tables[3][model]["median_ttft_ms"]
        assert tables[1][model]["p99_ttft_ms"] > tables[3][model]["p99_ttft_ms"]
    for line in json.dumps({n: {m: (round(r["median_ttft_ms"], 1), round(r["p99_ttft_ms"], 1))
                                for m, r in t.items()} for n, t in tables.items()}).splitlines():
        print("max_loras -> model -> (p50, p99 TTFT ms):", line)
    # Each request row says its model; the run page shows one row per model.
    db = sqlite3.connect(pytester.path / "results" / "results.db")
    db.row_factory = sqlite3.Row
    run_id = records[1]["run_id"]
    page = run_page(db, run_id)
    assert page is not None
    assert sorted(row["model"] for row in page.adapters) == sorted(tables[1])
    assert {row["model"]: row["requests"] for row in page.adapters} == {
        m: str(r["requests"]) for m, r in tables[1].items()
    }
    html = _page_html(pytester.path / "results" / "results.db", f"/results/-/run/{run_id}")
    assert '<h2 id="adapters">LoRA adapters</h2>' in html
    assert "<th>median TTFT (ms)</th>" in html and "<td>sql</td>" in html
