"""Multimodal (`random-mm`) and pooling (`openai-embeddings`, `vllm-rerank`) workloads: the
suite keys and their errors, the images and batches made, what the client sends and how it
times a pooling response, the metrics and the `vllm bench serve` form."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import (
    BENCH_SERVE_PARSE,
    needs_vllm_python,
    run_records,
    run_suites,
    serve_handler,
    suite_error,
    vllm_parse,
    write_suite,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pytest_profllm.load import metrics
from pytest_profllm.load.bench import measure, run_load
from pytest_profllm.load.client import request_payload
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.vllm_command import vllm_bench_serve_argv
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.results.fingerprint import digest, fingerprint
from pytest_profllm.sim.model_files import MODEL_DIR

CODEC = TokenizerCodec.load(str(MODEL_DIR))


def mm_config(**values: Any) -> BenchmarkConfig:
    base = {
        "backend": "openai-chat", "dataset_name": "random-mm", "num_prompts": 6,
        "random_input_len": 24, "random_output_len": 4,
    }  # fmt: skip
    return BenchmarkConfig.model_validate({**base, **values})


def image_size(part: dict[str, Any]) -> tuple[int, int]:
    url = part["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as image:
        assert image.format == "JPEG"
        return image.size


def test_random_mm_draws_images_of_the_buckets_sizes_after_the_text() -> None:
    config = mm_config(
        random_mm_bucket_config={"(64, 96, 1)": 0.5, "(32, 32, 1)": 0.5},
        random_mm_base_items_per_request=2,
    )
    requests = make_prompts(config, CODEC)
    assert len(requests) == 6
    for request in requests:
        assert request.prompt_len == 24 and request.output_len == 4
        assert len(request.mm_items) == len(request.mm_content) == 2
        sizes = [image_size(part) for part in request.mm_content]
        # (height, width) buckets; Pillow says (width, height).
        assert sizes == [(w, h) for h, w, _ in request.mm_items]
        assert request.mm_bytes > 0
        message = request_payload(LoadSettings("http://x", "m", "openai-chat"), request)
        content = message["messages"][0]["content"]
        assert content[0] == {"type": "text", "text": request.prompt}
        assert [part["type"] for part in content[1:]] == ["image_url", "image_url"]
    shapes = {shape for request in requests for shape in request.mm_items}
    assert shapes == {(64, 96, 1), (32, 32, 1)}
    # Every image is its own: a repeated one would measure the server's cache.
    urls = [part["image_url"]["url"] for r in requests for part in r.mm_content]
    assert len(set(urls)) == len(urls)
    # The text is the random dataset's, unchanged by the images.
    text = make_prompts(config.model_copy(update={"dataset_name": "random"}), CODEC)
    assert [r.prompt for r in requests] == [r.prompt for r in text]


@settings(max_examples=40, deadline=None)
@given(
    base=st.integers(0, 6),
    ratio=st.sampled_from([0.0, 0.5, 1.0]),
    limit=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_item_counts_stay_in_vllms_range_and_under_the_limit(
    base: int, ratio: float, limit: int, seed: int
) -> None:
    config = mm_config(
        random_mm_bucket_config={"(8, 8, 1)": 1.0}, random_mm_base_items_per_request=base,
        random_mm_num_mm_items_range_ratio=ratio, random_mm_limit_mm_per_prompt={"image": limit},
        seed=seed, num_prompts=5, random_input_len=4,
    )  # fmt: skip
    least = max(0, math.floor(base * (1 - ratio)))
    most = min(limit, math.ceil(base * (1 + ratio)))
    if least > most:
        from pytest_profllm.load.dataset import DatasetError

        with pytest.raises(DatasetError, match="random_mm_base_items_per_request"):
            make_prompts(config, CODEC)
        return
    for request in make_prompts(config, CODEC):
        assert least <= len(request.mm_items) <= most


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        ("{dataset_name: hf, dataset_path: x}", "downloads from the Hugging Face hub"),
        ("{dataset_name: burstgpt}", "needs dataset_path (a local file)"),
        (
            "{backend: openai-chat, dataset_name: random-mm, random_mm_bucket_config: "
            "{'(256, 256, 1)': 0.5, '(512, 512, 1)': 0.3}}",
            "the bucket probabilities sum to 0.8, not 1",
        ),
        (
            "{backend: openai-chat, dataset_name: random-mm, random_mm_bucket_config: "
            "{'(256, 256, 1)': 0.5, '(720, 1280, 16)': 0.5}, "
            "random_mm_limit_mm_per_prompt: {image: 2}}",
            "(720, 1280, 16)'s modality has no limit in random_mm_limit_mm_per_prompt",
        ),
        (
            "{backend: openai-chat, dataset_name: random-mm, random_mm_bucket_config: "
            "{'256 by 256': 1.0}}",
            "is not \"(height, width, frames)\"",
        ),
        ("{dataset_name: random-mm}", "it needs backend: openai-chat"),
        ("{random_mm_base_items_per_request: 2}", "only apply to dataset_name 'random-mm'"),
        ("{backend: openai-embeddings, percentile_metrics: ttft}", "percentile_metrics is e2el"),
        (
            "{backend: openai-embeddings, dataset_name: sharegpt, dataset_path: x}",
            "takes dataset_name",
        ),
        ("{dataset_name: random-rerank}", "needs backend: vllm-rerank"),
        ("{random_batch_size: 4}", "random_batch_size batches prompts for a pooling backend"),
    ],
)
def test_a_bad_multimodal_or_pooling_workload_is_one_line(
    tmp_path: Path, workload: str, expected: str
) -> None:
    path = write_suite(tmp_path, f"server: {{model: m}}\nbenchmark: {workload}\n")
    message = suite_error(path)
    assert str(path) in message and "benchmark" in message
    assert expected in message


def test_embeddings_batch_prompts_and_rerank_pairs_a_query_with_documents() -> None:
    embeddings = BenchmarkConfig(
        backend="openai-embeddings", num_prompts=5, random_input_len=16, random_batch_size=2
    )
    assert embeddings.percentile_metrics == "e2el"
    requests = make_prompts(embeddings, CODEC)
    assert [len(r.inputs or ()) for r in requests] == [2, 2, 1]
    assert [r.prompt_len for r in requests] == [32, 32, 16]
    body = request_payload(LoadSettings("http://x", "m", "openai-embeddings"), requests[0])
    assert body == {
        "model": "m", "input": list(requests[0].inputs or ()), "truncate_prompt_tokens": -1
    }  # fmt: skip
    rerank = BenchmarkConfig(
        backend="vllm-rerank", dataset_name="random-rerank", num_prompts=4,
        random_input_len=40, random_batch_size=3,
    )  # fmt: skip
    pairs = make_prompts(rerank, CODEC)
    assert [len(r.inputs or ()) - 1 for r in pairs] == [3, 1]
    queries = {(r.inputs or ("",))[0] for r in pairs}
    assert len(queries) == 1  # one query for the whole workload, as vLLM's
    body = request_payload(LoadSettings("http://x", "m", "vllm-rerank"), pairs[0])
    assert body["query"] == pairs[0].prompt and len(body["documents"]) == 3


def _embeddings_handler(vector: list[Any], status: int = 200) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        await asyncio.sleep(0.02)
        if status != 200:
            return web.json_response({"error": {"message": "no", "code": status}}, status=status)
        data = [
            {"index": i, "object": "embedding", "embedding": vector} for i in range(len(inputs))
        ]
        tokens = 7 * len(inputs)
        return web.Response(
            text=json.dumps({"object": "list", "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
            content_type="application/json",
        )  # fmt: skip

    return handler


def test_a_pooling_request_is_timed_whole_and_counts_the_servers_tokens() -> None:
    config = BenchmarkConfig(
        backend="openai-embeddings", num_prompts=6, random_input_len=16, random_batch_size=2
    )
    requests = make_prompts(config, CODEC)

    async def run() -> Any:
        async with serve_handler(_embeddings_handler([0.1, 0.2]), "/v1/embeddings") as url:
            return await run_load(LoadSettings(url, "m", "openai-embeddings"), requests)

    load = asyncio.run(run())
    assert [o.success for o in load.outcomes] == [True] * 3
    assert all(o.prompt_len == 14 for o in load.outcomes)  # the server's count
    assert all(o.ttft == o.latency >= 0.02 for o in load.outcomes)
    summary, health = measure(load, config, CODEC)
    assert summary["completed"] == 3 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 42
    assert summary["output_throughput"] is None and summary["total_output_tokens"] is None
    assert summary["median_e2el_ms"] >= 20
    assert not any(key.endswith(("_ttft_ms", "_tpot_ms", "_itl_ms")) for key in summary)
    assert set(config.result_names()) - set(summary) - set(health) == set()
    assert metrics.served_problem(load.outcomes, summary) is None


@pytest.mark.parametrize(
    ("vector", "status", "error"),
    [
        ([], 200, "an embedding is not a list of numbers"),
        (["x"], 200, "not a finite number"),
        ([0.1], 400, "HTTP 400"),
    ],
)
def test_a_pooling_response_without_its_vectors_fails_the_request(
    vector: list[Any], status: int, error: str
) -> None:
    config = BenchmarkConfig(backend="openai-embeddings", num_prompts=1, random_input_len=8)
    requests = make_prompts(config, CODEC)

    async def run() -> Any:
        handler = _embeddings_handler(vector, status)
        async with serve_handler(handler, "/v1/embeddings") as url:
            return await run_load(LoadSettings(url, "m", "openai-embeddings"), requests)

    (outcome,) = asyncio.run(run()).outcomes
    assert not outcome.success and error in outcome.error


def test_the_multimodal_figures_come_from_the_requests() -> None:
    done = metrics.RequestOutcome(
        prompt_len=124, success=True, text_prompt_len=24, mm_items=2, mm_bytes=1000,
        mm_pixels=2 * 256 * 256,
    )  # fmt: skip
    failed = metrics.RequestOutcome(prompt_len=24, text_prompt_len=24, mm_items=1, mm_bytes=9)
    text = metrics.RequestOutcome(prompt_len=5, success=True)
    assert done.mm_tokens == 100 and failed.mm_tokens is None
    assert text.mm_tokens is None
    assert metrics.multimodal_summary([text]) == {}
    assert metrics.multimodal_summary([done, failed]) == {
        "total_mm_items": 2, "mean_mm_items_per_request": 2.0,
        "mean_mm_bytes_per_request": 1000.0, "mean_mm_pixels_per_item": 256.0 * 256,
        "mean_mm_tokens_per_request": 100.0, "mean_mm_audio_s_per_request": None,
    }  # fmt: skip


def test_the_new_keys_leave_other_workloads_fingerprints_as_they_were() -> None:
    now = BenchmarkConfig().model_dump(mode="json")
    before = {
        k: v
        for k, v in now.items()
        if not k.startswith(("random_mm_", "random_batch_size", "spec_bench_", "speed_bench_"))
    }
    assert len(before) < len(now)

    def of(benchmark: dict[str, Any]) -> str:
        return digest(fingerprint({"config": {"server": {"model": "m"}, "benchmark": benchmark}}))

    assert of(now) == of(before)
    mm = mm_config().model_dump(mode="json")
    assert of(mm) != of({**mm, "random_mm_base_items_per_request": 3})
    pooled = BenchmarkConfig(backend="openai-embeddings").model_dump(mode="json")
    assert of(pooled) != of({**pooled, "random_batch_size": 8})
    spec = BenchmarkConfig(dataset_name="spec_bench", dataset_path="q.jsonl")
    spec_json = spec.model_dump(mode="json")
    assert of(spec_json) != of({**spec_json, "spec_bench_category": "qa"})


@pytest.mark.vllm_python
@needs_vllm_python
def test_vllm_bench_serve_parses_the_rendered_multimodal_and_pooling_options() -> None:
    configs = [
        mm_config(
            random_mm_bucket_config={"(256, 256, 1)": 0.25, "(720, 1280, 1)": 0.75},
            random_mm_limit_mm_per_prompt={"image": 3}, random_mm_base_items_per_request=2,
        ),
        BenchmarkConfig(backend="openai-embeddings", random_batch_size=4),
        BenchmarkConfig(backend="vllm-rerank", dataset_name="random-rerank", random_batch_size=3),
    ]  # fmt: skip
    argvs = [vllm_bench_serve_argv(c, base_url="http://127.0.0.1:1", model="m") for c in configs]
    mm, embeddings, rerank = vllm_parse(BENCH_SERVE_PARSE, argvs)
    assert mm["dataset_name"] == "random-mm" and mm["backend"] == "openai-chat"
    assert mm["random_mm_bucket_config"] == {"(256, 256, 1)": 0.25, "(720, 1280, 1)": 0.75}
    assert mm["random_mm_limit_mm_per_prompt"] == {"image": 3}
    assert mm["random_mm_base_items_per_request"] == 2
    assert embeddings["backend"] == "openai-embeddings"
    assert embeddings["random_batch_size"] == 4 and embeddings["percentile_metrics"] == "e2el"
    assert (rerank["dataset_name"], rerank["backend"], rerank["random_batch_size"]) == (
        "random-rerank", "vllm-rerank", 3
    )


REPO = Path(__file__).parent.parent


def test_text_images_and_a_pooling_model_in_one_session(
    pytester: pytest.Pytester, ports: str
) -> None:
    """Under -n 2: one record per case, each with its kind's figures, and a text case that
    shares the vision model's server with the image cases (the same arguments)."""
    for name in ("bench_multimodal.yaml", "bench_pooling.yaml"):
        (pytester.path / name).write_text((REPO / "benchmarks" / name).read_text())
    (pytester.path / "bench_text.yaml").write_text(
        "server: {model: Qwen/Qwen2.5-VL-7B-Instruct, max_num_seqs: 16, max_model_len: 8192}\n"
        "benchmark: {backend: openai-chat, num_prompts: 16, random_input_len: 128,\n"
        "            random_output_len: 16, max_concurrency: 4}\n"
    )
    result = run_suites(pytester, ports, "-n", "2")
    result.assert_outcomes(passed=4)
    written = {r["case_id"].split("::", 1)[0] + "::" + r["case_id"].rsplit("::", 1)[1]: r
               for r in run_records(pytester)}  # fmt: skip
    assert len(written) == 4
    text = written["bench_text.yaml::random"]["results"]
    small = written["bench_multimodal.yaml::random-mm-image-256x256"]["results"]
    large = written["bench_multimodal.yaml::random-mm-image-720x1280"]["results"]
    pooled = written["bench_pooling.yaml::random"]["results"]
    for results in (text, small, large):
        assert results["completed"] == 16 and results["median_tpot_ms"] > 0
    assert "total_mm_items" not in text
    assert small["total_mm_items"] == large["total_mm_items"] == 16
    # Qwen2.5-VL: 81 and 1196 placeholders, two markers, the role line's two tokens.
    assert small["mean_mm_tokens_per_request"] == 85
    assert large["mean_mm_tokens_per_request"] == 1200
    assert small["mean_mm_pixels_per_item"] == 256 * 256
    # A larger prompt, a later first token. The text case's prompt is the small image's less
    # its 85 image tokens: a few ms less prefill (tests/test_sim_multimodal.py checks the cost
    # model's order), less than a host running four workers adds (73.6 against 72.6 ms once).
    # The large image's 1200 tokens are 160 ms more.
    assert text["total_input_tokens"] < small["total_input_tokens"]
    assert small["median_ttft_ms"] < large["median_ttft_ms"]
    # A pooling case: E2EL and throughputs, no token stream figures.
    assert pooled["completed"] == 16 and pooled["total_input_tokens"] == 64 * 256
    assert pooled["median_e2el_ms"] > 0 and pooled["output_throughput"] is None
    assert not any(key.endswith(("_ttft_ms", "_tpot_ms", "_itl_ms")) for key in pooled)
    starts = {r["runtime"]["server_key"] for r in written.values()}
    assert len(starts) == 2  # the text case ran on the vision model's server
    assert all(r["validity"] == "valid" for r in written.values())


def test_a_text_only_model_sent_images_fails_in_one_line(
    pytester: pytest.Pytester, ports: str
) -> None:
    (pytester.path / "bench_mm.yaml").write_text(
        "server: {model: Qwen/Qwen3-8B}\n"
        "benchmark: {backend: openai-chat, dataset_name: random-mm, num_prompts: 2,\n"
        "            random_input_len: 16, random_output_len: 2,\n"
        "            random_mm_bucket_config: {'(32, 32, 1)': 1.0}}\n"
    )
    result = run_suites(pytester, ports)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*bench_mm.yaml: benchmark.dataset_name 'random-mm' sends images and Qwen/Qwen3-8B "
         "refused every request: *Qwen/Qwen3-8B is not a multimodal model*"]
    )  # fmt: skip
