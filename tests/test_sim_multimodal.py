"""The simulated engine's images and pooling models: the image rules of the models it knows,
images priced as prompt tokens and encoder work, images refused by a text-only model as vLLM
refuses them, and a pooling runner's embeddings and rerank routes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import wave
from pathlib import Path
from statistics import median
from typing import Any

import helpers
import numpy as np
import pytest
import requests
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.cost import EngineModel, StepWork
from pytest_profllm.sim.hardware import profiles
from pytest_profllm.sim.model_files import MODEL_DIR
from pytest_profllm.sim.models import catalog, resolve_model
from pytest_profllm.sim.vision import smart_resize

VL = "Qwen/Qwen2.5-VL-7B-Instruct"


def simulator(
    port_range: str, tmp_path: Path, model: str, *args: str
) -> contextlib.AbstractContextManager[str]:
    """A simulated engine serving `model` on 127.0.0.1; stopped and reaped whatever happens."""
    key = abs(hash((model, args)))
    # Inside the test's own range, above `sim_url`'s ports (+50 and the four after).
    first = int(port_range.split("-")[0]) + 60 + key % 35
    return helpers.simulator(first, tmp_path / f"sim-{key % 10_000}.log", model, *args)


def jpeg_part(width: int, height: int, seed: int = 0) -> dict[str, Any]:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    with io.BytesIO() as buffer:
        Image.fromarray(pixels).save(buffer, format="JPEG")
        data = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}


def chat(url: str, model: str, content: Any) -> requests.Response:
    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
    }  # fmt: skip
    return requests.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_the_vision_models_load_with_their_rules_and_cite_the_catalog() -> None:
    qwen = resolve_model(VL)
    assert qwen.source == "catalog" and qwen.vision is not None
    assert (qwen.vision.rule, qwen.vision.patch_size, qwen.vision.merge_size) == (
        "qwen2_5_vl", 14, 2
    )
    # Qwen2.5-VL's vision tower is about 0.67 B parameters; its language model 7.6 B.
    assert 0.6e9 < qwen.vision.encoder_params < 0.7e9
    assert 7.5e9 < qwen.params < 7.7e9
    # 256x256 rounds to 252x252 (9 x 9 tokens); 720x1280 to 728x1288 (26 x 46).
    assert qwen.vision.image_tokens(256, 256) == 81
    assert qwen.vision.image_tokens(1280, 720) == 26 * 46
    llava = resolve_model("llava-hf/llava-1.5-7b-hf")
    assert llava.vision is not None and llava.vision.image_tokens(1280, 720) == 576
    assert llava.num_hidden_layers == 32  # from its text_config
    assert resolve_model("Qwen/Qwen3-8B").vision is None
    assert "preprocessor" in catalog()[VL]


@given(height=st.integers(1, 5000), width=st.integers(1, 5000))
def test_qwens_resize_keeps_multiples_of_28_within_the_pixel_bounds(
    height: int, width: int
) -> None:
    # Aspect ratios beyond 200 are refused by Qwen's processor; the rule holds below that.
    if max(height, width) / min(height, width) > 200:
        return
    low, high = 3136, 12845056
    new_height, new_width = smart_resize(height, width, 28, low, high)
    assert new_height % 28 == 0 and new_width % 28 == 0
    assert new_height * new_width <= high
    assert new_height * new_width >= min(low, 28 * 28)


def test_a_larger_image_costs_more_in_its_prefill_step() -> None:
    engine = EngineModel(resolve_model(VL), profiles()["H100-SXM"])
    vision = engine.model.vision
    assert vision is not None
    text = StepWork(prefill_tokens=128 + 85, prefill_attended=213 * 106, prefill_seqs=1)
    small = StepWork(
        prefill_tokens=128 + 85, prefill_attended=213 * 106, prefill_seqs=1,
        encoder_flops=vision.encoder_flops(256, 256),
    )  # fmt: skip
    large = StepWork(
        prefill_tokens=128 + 85, prefill_attended=213 * 106, prefill_seqs=1,
        encoder_flops=vision.encoder_flops(1280, 720),
    )  # fmt: skip
    assert engine.step_seconds(text) < engine.step_seconds(small) < engine.step_seconds(large)


def test_images_are_prompt_tokens_and_a_larger_one_a_later_first_token(
    port_range: str, tmp_path: Path
) -> None:
    with simulator(port_range, tmp_path, VL) as url:
        plain = chat(url, VL, "describe this")
        small = chat(url, VL, [{"type": "text", "text": "describe this"}, jpeg_part(256, 256)])
        large = chat(url, VL, [{"type": "text", "text": "describe this"}, jpeg_part(1280, 720)])
        codec = TokenizerCodec.load(str(MODEL_DIR))
        ttft = {}
        for size in ("(256, 256, 1)", "(720, 1280, 1)"):
            config = BenchmarkConfig(
                backend="openai-chat", dataset_name="random-mm", num_prompts=6,
                random_input_len=64, random_output_len=4, max_concurrency=1,
                random_mm_bucket_config={size: 1.0},
            )  # fmt: skip
            settings = LoadSettings(url, VL, "openai-chat", max_concurrency=1)
            load = asyncio.run(run_load(settings, make_prompts(config, codec)))
            assert all(o.success for o in load.outcomes)
            ttft[size] = median(o.ttft for o in load.outcomes)
            # The record's figure: the prompt tokens beyond the text, markers and role line.
            assert {o.mm_tokens for o in load.outcomes} == {
                81 + 4 if size.startswith("(256") else 26 * 46 + 4
            }
    assert plain.status_code == small.status_code == large.status_code == 200
    tokens = [r.json()["usage"]["prompt_tokens"] for r in (plain, small, large)]
    # Each image: its placeholders between a vision-start and a vision-end token.
    assert tokens[1] - tokens[0] == 81 + 2
    assert tokens[2] - tokens[0] == 26 * 46 + 2
    assert ttft["(720, 1280, 1)"] > ttft["(256, 256, 1)"]


def test_a_text_only_model_refuses_an_image_as_vllm_does(
    port_range: str, tmp_path: Path
) -> None:
    with simulator(port_range, tmp_path, "Qwen/Qwen3-8B") as url:
        answer = chat(url, "Qwen/Qwen3-8B", [{"type": "text", "text": "x"}, jpeg_part(8, 8)])
    assert answer.status_code == 400
    error = answer.json()["error"]
    # vLLM 0.33: MultiModalRegistry.create_processor's ValueError, a 400 BadRequestError.
    assert error["message"] == "Qwen/Qwen3-8B is not a multimodal model"
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_an_unreadable_image_or_a_modality_the_model_lacks_is_a_400(
    port_range: str, tmp_path: Path
) -> None:
    broken = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,aGVsbG8="}}
    mp4 = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": wav_b64(1.0), "format": "wav"}}
    with simulator(port_range, tmp_path, VL) as url:
        answers = [chat(url, VL, [part]) for part in (broken, mp4, audio)]
    assert [a.status_code for a in answers] == [400, 400, 400]
    messages = [a.json()["error"]["message"] for a in answers]
    assert "cannot read the image" in messages[0]
    assert "data:video/jpeg;base64" in messages[1]
    assert messages[2] == f"{VL} does not take audio input"


def wav_b64(seconds: float, rate: int = 16000) -> str:
    with io.BytesIO() as buffer:
        with wave.open(buffer, "wb") as clip:
            clip.setnchannels(1)
            clip.setsampwidth(2)
            clip.setframerate(rate)
            clip.writeframes(b"\0\0" * int(rate * seconds))
        return base64.b64encode(buffer.getvalue()).decode()


def video_part(width: int, height: int, frames: int) -> dict[str, Any]:
    parts = [jpeg_part(width, height, seed)["image_url"]["url"] for seed in range(frames)]
    data = ",".join(url.split(",", 1)[1] for url in parts)
    return {"type": "video_url", "video_url": {"url": f"data:video/jpeg;base64,{data}"}}


def test_video_frames_and_audio_seconds_are_prompt_tokens_by_the_models_rules(
    port_range: str, tmp_path: Path
) -> None:
    """Qwen2.5-VL: frames in pairs, each 256x256 frame raised to the video processor's least
    area (336x336: 12 x 12 tokens a pair); Qwen2-Audio: 3 s is 300 mel frames, 150 after the
    convolution, 75 tokens after the pooling. Each between two markers."""
    audio_model = "Qwen/Qwen2-Audio-7B-Instruct"
    with simulator(port_range, tmp_path, VL) as url:
        plain = chat(url, VL, "x")
        video = chat(url, VL, [{"type": "text", "text": "x"}, video_part(256, 256, 4)])
        odd = chat(url, VL, [{"type": "text", "text": "x"}, video_part(256, 256, 3)])
        large = chat(url, VL, [video_part(1280, 720, 2), jpeg_part(1280, 720, 9)])
    with simulator(port_range, tmp_path, audio_model) as url:
        quiet = chat(url, audio_model, "x")
        clip = {"type": "input_audio", "input_audio": {"data": wav_b64(3.0), "format": "wav"}}
        heard = chat(url, audio_model, [{"type": "text", "text": "x"}, clip])
        image = chat(url, audio_model, [jpeg_part(8, 8)])
    # Megabytes of inline media (two random 720p frames and an image) are taken, as by vLLM.
    assert large.status_code == 200, large.text
    tokens = [r.json()["usage"]["prompt_tokens"] for r in (plain, video, odd, quiet, heard)]
    assert tokens[1] - tokens[0] == 2 * 144 + 2
    assert tokens[2] - tokens[0] == 2 * 144 + 2  # an odd last frame makes a pair of its own
    assert tokens[4] - tokens[3] == 75 + 2
    assert image.status_code == 400
    assert image.json()["error"]["message"] == f"{audio_model} does not take image input"


def test_llava_takes_no_video_and_the_audio_model_loads_from_the_catalog() -> None:
    llava = resolve_model("llava-hf/llava-1.5-7b-hf")
    assert llava.vision is not None and not llava.vision.takes_video
    audio = resolve_model("Qwen/Qwen2-Audio-7B-Instruct")
    assert audio.source == "catalog" and audio.audio is not None and audio.vision is None
    # A Whisper-large encoder: 32 layers of width 1280, about 0.63 B parameters.
    assert 0.6e9 < audio.audio.encoder_params < 0.66e9
    assert audio.audio.audio_tokens(30) == audio.audio.audio_tokens(60) == 750  # cut at 30 s
    assert audio.num_hidden_layers == 32 and audio.hidden_size == 4096


def test_a_pooling_runner_serves_embeddings_and_rerank_only(
    port_range: str, tmp_path: Path
) -> None:
    model = "Qwen/Qwen3-Embedding-0.6B"
    with simulator(port_range, tmp_path, model, "--runner", "pooling") as url:
        one = requests.post(url + "/v1/embeddings", json={"model": model, "input": "a b c"})
        many = requests.post(
            url + "/v1/embeddings", json={"model": model, "input": ["a b", "c d e f"]}
        )
        again = requests.post(url + "/v1/embeddings", json={"model": model, "input": "a b c"})
        ranked = requests.post(
            url + "/v1/rerank", json={"model": model, "query": "q", "documents": ["x", "y z"]}
        )
        generate = chat(url, model, "hello")
    assert [r.status_code for r in (one, many, again, ranked)] == [200] * 4
    vectors = [item["embedding"] for item in many.json()["data"]]
    assert len(vectors) == 2 and all(len(v) == 1024 for v in vectors)  # its hidden_size
    assert one.json()["data"][0]["embedding"] == again.json()["data"][0]["embedding"]
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-3
    usage = many.json()["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > one.json()["usage"]["prompt_tokens"]
    results = ranked.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    # As vLLM: a pooling runner registers no generation routes.
    assert generate.status_code == 404


def test_a_generating_runner_has_no_embeddings_route(port_range: str, tmp_path: Path) -> None:
    with simulator(port_range, tmp_path, "Qwen/Qwen3-0.6B") as url:
        answer = requests.post(url + "/v1/embeddings", json={"input": "a"}, timeout=30)
    assert answer.status_code == 404


@pytest.mark.parametrize("size", [(8, 8), (1280, 720)])
def test_an_image_costs_the_same_tokens_through_the_whole_chain(size: tuple[int, int]) -> None:
    """The rule the simulator charges equals the facts' rule for the size sent."""
    vision = resolve_model(VL).vision
    assert vision is not None
    width, height = size
    new_height, new_width = smart_resize(height, width, 28, 3136, 12845056)
    assert vision.image_tokens(width, height) == (new_height // 28) * (new_width // 28)
