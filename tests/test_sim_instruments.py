"""The simulator's `/metrics` and profile routes, in-process on loopback: vLLM 0.33.0's names,
statuses and trace files."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pytest_profllm.sim.batching import ConstantStepCost, Scheduler
from pytest_profllm.sim.instruments import add_routes
from pytest_profllm.sim.profiler_config import ProfilerConfigError, ProfilerSettings

T = TypeVar("T")


def serve(
    scheduler: Scheduler,
    profiler: ProfilerSettings,
    body: Callable[[TestClient[web.Request, web.Application]], Awaitable[T]],
) -> T:
    async def main() -> T:
        app = web.Application()
        add_routes(app, scheduler, "Qwen/Qwen3-8B", profiler)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await body(client)

    return asyncio.run(main())


def scheduler() -> Scheduler:
    return Scheduler(ConstantStepCost(), max_num_seqs=4, max_num_batched_tokens=64)


def test_metrics_carry_vllms_names_labels_and_the_schedulers_counts() -> None:
    sim = scheduler()
    sim.num_preemptions, sim.prefix_cache_queries, sim.prefix_cache_hits = 3, 320, 96
    sim.used_blocks, sim.num_gpu_blocks = 30, 120
    sim.submit(5, 5)

    async def body(client: TestClient[web.Request, web.Application]) -> tuple[str, str]:
        response = await client.get("/metrics")
        assert response.status == 200
        return response.headers["Content-Type"], await response.text()

    content_type, text = serve(sim, ProfilerSettings(), body)
    assert content_type.startswith("text/plain; version=")
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    counts = {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 1.0,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:num_preemptions_total": 3.0,
        "vllm:prefix_cache_queries_total": 320.0,
        "vllm:prefix_cache_hits_total": 96.0,
        "vllm:prompt_tokens_total": 0.0,
        "vllm:generation_tokens_total": 0.0,
    }
    assert {name: samples[name].value for name in counts} == counts
    assert samples["vllm:num_preemptions_total"].labels == {
        "model_name": "Qwen/Qwen3-8B",
        "engine": "0",
    }


def test_profile_routes_exist_only_with_a_profiler() -> None:
    async def body(client: TestClient[web.Request, web.Application]) -> list[int]:
        return [(await client.post(path)).status for path in ("/start_profile", "/stop_profile")]

    assert serve(scheduler(), ProfilerSettings(), body) == [404, 404]


def test_profile_session_statuses_and_trace_file(tmp_path: Path) -> None:
    sim = scheduler()
    settings = ProfilerSettings.from_json(
        json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces")})
    )

    async def body(client: TestClient[web.Request, web.Application]) -> list[int]:
        statuses = [(await client.post("/stop_profile")).status]  # nothing to stop: ignored
        bad = await client.post("/start_profile", json={"profile_prefix": "../escape"})
        statuses.append(bad.status)
        statuses.append((await client.post("/start_profile", json={"profile_prefix": "c1"})).status)
        again = await client.post("/start_profile")
        statuses.append(again.status)
        assert (await again.json())["error"]["message"].startswith(
            "A profiling session is already active."
        )
        assert sim.trace_events is not None
        sim.trace_events.append({"name": "execute_model", "ph": "X", "ts": 1.0, "dur": 2.0})
        statuses.append((await client.post("/stop_profile")).status)
        assert sim.trace_events is None
        return statuses

    assert serve(sim, settings, body) == [200, 400, 200, 409, 200]
    (trace,) = (tmp_path / "traces").iterdir()
    assert trace.name.startswith("c1_dp0_pp0_tp0_dcp0_ep0_rank0.")
    assert trace.name.endswith(".pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert [e["name"] for e in events] == ["process_name", "execute_model"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"profiler": "torch"}, "torch_profiler_dir must be set when profiler is 'torch'"),
        ({"torch_profiler_dir": "/x"}, "torch_profiler_dir is only applicable when profiler"),
        ({"profiler": "nsight"}, "profiler: input should be 'torch', 'cuda' or 'proton'"),
    ],
)
def test_profiler_config_vllm_rejects_is_rejected(config: dict[str, str], message: str) -> None:
    with pytest.raises(ProfilerConfigError, match=message):
        ProfilerSettings.from_json(json.dumps(config))


def test_relative_trace_dir_becomes_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    settings = ProfilerSettings.from_json('{"profiler": "torch", "torch_profiler_dir": "t"}')
    assert settings.torch_profiler_dir == str(tmp_path / "t")
    assert settings.torch_profiler_use_gzip


# vLLM 0.33.0's families the simulator has the quantity of (vllm/v1/metrics/loggers.py), with
# their types and the label names beyond model_name and engine.
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_num_preemptions": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
}


def _families(sim: Scheduler) -> dict[str, Any]:
    async def body(client: TestClient[web.Request, web.Application]) -> str:
        return await (await client.get("/metrics")).text()

    return {f.name: f for f in text_string_to_metric_families(serve(sim, ProfilerSettings(), body))}


def test_metric_families_have_vllms_types_and_label_names() -> None:
    families = _families(scheduler())
    for name, (kind, extra) in VLLM_FAMILIES.items():
        # prometheus_client's parser drops the _total of counters from family names.
        family = families[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind, name
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            assert labels == {"model_name", "engine", *extra}, (name, labels)
    assert families["vllm:cache_config_info"].type == "gauge"


def test_request_histograms_count_what_the_scheduler_did() -> None:
    sim = Scheduler(ConstantStepCost(0.001), max_num_seqs=2, max_num_batched_tokens=64)

    async def drive() -> None:
        loop = asyncio.create_task(sim.run())
        sequences = [sim.submit(10, 4) for _ in range(3)]  # the third waits for a slot
        for sequence in sequences:
            while await sequence.tokens.get() is not None:
                pass
        loop.cancel()

    asyncio.run(drive())
    families = _families(sim)

    def sample(family: str, suffix: str) -> float:
        return float(next(s.value for s in families[family].samples if s.name == family + suffix))

    assert sample("vllm:time_to_first_token_seconds", "_count") == 3
    assert sample("vllm:e2e_request_latency_seconds", "_count") == 3
    assert sample("vllm:inter_token_latency_seconds", "_count") == 3 * 3
    assert sample("vllm:request_generation_tokens", "_sum") == 12
    assert sample("vllm:request_prompt_tokens", "_sum") == 30
    # The third request queued for one full request's time (4 steps of 1 ms or more).
    assert sample("vllm:request_queue_time_seconds", "_sum") >= 0.004
    assert sample("vllm:request_prefill_time_seconds", "_count") == 3
    success = {
        s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
    }
    assert success["length"] == 3 and success["abort"] == 0
