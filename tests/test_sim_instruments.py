"""The simulator's `/metrics` and profile routes, in-process on loopback: vLLM 0.33.0's names,
statuses and trace files."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from pytest_profllm.sim.instruments import ProfilerConfigError, ProfilerSettings, add_routes
from pytest_profllm.sim.scheduler import CostModel, Scheduler

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
    return Scheduler(CostModel(), max_num_seqs=4, max_num_batched_tokens=64)


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
    assert {name: s.value for name, s in samples.items()} == {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 1.0,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:num_preemptions_total": 3.0,
        "vllm:prefix_cache_queries_total": 320.0,
        "vllm:prefix_cache_hits_total": 96.0,
        "vllm:prompt_tokens_total": 0.0,
        "vllm:generation_tokens_total": 0.0,
    }
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
