"""vllm bench serve's remaining local datasets: `burstgpt`, `spec_bench`, `speed_bench`,
`custom_image`, `custom_audio`, and videos in `random-mm`. What each reads and makes, the one
line a bad file gets, the `vllm bench serve` form, and a run of them on the simulator."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BENCH_SERVE_PARSE,
    needs_vllm_python,
    run_records,
    run_suites,
    suite_error,
    vllm_parse,
    write_suite,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pytest_profllm.load.client import request_payload
from pytest_profllm.load.dataset import DatasetError, TokenizerCodec, make_prompts
from pytest_profllm.load.schedule import LoadSettings
from pytest_profllm.load.vllm_command import vllm_bench_serve_argv
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.model_files import MODEL_DIR

CODEC = TokenizerCodec.load(str(MODEL_DIR))
CHAT = LoadSettings("http://127.0.0.1:1", "m", "openai-chat")


def config(dataset: str, path: Path, **values: Any) -> BenchmarkConfig:
    chat = dataset in ("custom_image", "custom_audio")
    return BenchmarkConfig.model_validate(
        {"backend": "openai-chat" if chat else "openai", "dataset_name": dataset,
         "dataset_path": str(path), "num_prompts": 4, **values}
    )  # fmt: skip


def jsonl(path: Path, *items: Any) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def wav(path: Path, seconds: float, rate: int = 16000) -> Path:
    with wave.open(str(path), "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(b"\0\0" * int(rate * seconds))
    return path


BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,100,10,110,Conversation log\n"
    "6,GPT-4,40,7,47,Conversation log\n"
    "8,GPT-4,30,0,30,Conversation log\n"
    "9,GPT-4,25,12,37,API log\n"
)


def test_burstgpt_takes_the_gpt4_rows_with_a_response_as_vllm_does(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(BURSTGPT)
    two = make_prompts(config("burstgpt", path, num_prompts=2), CODEC)
    assert sorted((r.prompt_len, r.output_len) for r in two) == [(25, 12), (40, 7)]
    # More prompts than rows: drawn again, as vLLM's sample with replacement.
    six = make_prompts(config("burstgpt", path, num_prompts=6), CODEC)
    assert {(r.prompt_len, r.output_len) for r in six} <= {(25, 12), (40, 7)}
    assert len(six) == 6
    # The i-th prompt is the ids (i + j) mod the vocabulary, decoded.
    assert two[0].prompt == CODEC.decode(list(range(two[0].prompt_len)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Timestamp,Model,Response tokens\n1,GPT-4,3\n", "missing Request tokens"),
        ("Model,Request tokens,Response tokens\nGPT-4,x,3\n", "burst.csv:2: 'Request tokens'"),
        ("Model,Request tokens,Response tokens\nChatGPT,4,3\n", "no GPT-4 rows"),
    ],
)
def test_a_bad_burstgpt_csv_is_one_line_naming_file_and_column(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "burst.csv"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        make_prompts(config("burstgpt", path), CODEC)


def test_spec_bench_sends_each_questions_first_turn_of_its_category(tmp_path: Path) -> None:
    path = jsonl(
        tmp_path / "question.jsonl",
        {"question_id": 1, "category": "math_reasoning", "turns": ["What is 2+2?", "And 3+3?"]},
        {"question_id": 2, "category": "translation", "turns": ["Translate: bonjour"]},
    )
    requests = make_prompts(
        config("spec_bench", path, spec_bench_category="translation", spec_bench_output_len=9),
        CODEC,
    )
    assert {r.prompt for r in requests} == {"Translate: bonjour"}
    assert {r.output_len for r in requests} == {9} and len(requests) == 4
    every = make_prompts(config("spec_bench", path), CODEC)
    assert {r.prompt for r in every} == {"What is 2+2?", "Translate: bonjour"}
    assert {r.output_len for r in every} == {256}  # vLLM's default
    with pytest.raises(DatasetError, match="no questions in category 'coding'"):
        make_prompts(config("spec_bench", path, spec_bench_category="coding"), CODEC)
    broken = jsonl(tmp_path / "broken.jsonl", {"category": "qa", "turns": []})
    with pytest.raises(DatasetError, match=r"broken.jsonl:1: each line needs a non-empty 'turns'"):
        make_prompts(config("spec_bench", broken), CODEC)


def test_speed_bench_reads_its_subsets_file_in_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "speed"
    folder.mkdir()
    jsonl(
        folder / "throughput_1k.jsonl",
        {"category": "coding", "messages": [{"role": "user", "content": "Write a sort."}]},
        {"category": "writing", "messages": [{"role": "user", "content": "A poem."}]},
    )
    requests = make_prompts(
        config("speed_bench", folder, speed_bench_dataset_subset="throughput_1k",
               speed_bench_category="coding"),
        CODEC,
    )  # fmt: skip
    assert {r.prompt for r in requests} == {"Write a sort."}
    assert {r.output_len for r in requests} == {4096}  # vLLM's default
    with pytest.raises(DatasetError, match=r"qualitative.jsonl: cannot read"):
        make_prompts(config("speed_bench", folder), CODEC)
    with pytest.raises(DatasetError, match="reads a folder"):
        make_prompts(config("speed_bench", folder / "throughput_1k.jsonl"), CODEC)


def test_custom_image_sends_local_images_inline_after_the_text(tmp_path: Path) -> None:
    Image.new("RGB", (64, 32), "red").save(tmp_path / "a.png")
    Image.new("RGB", (20, 10), "blue").save(tmp_path / "b.jpg")
    path = jsonl(
        tmp_path / "images.jsonl",
        {"prompt": "How many blocks?", "image_files": ["a.png", str(tmp_path / "b.jpg")]},
    )
    (request,) = make_prompts(config("custom_image", path, num_prompts=1), CODEC)
    assert request.mm_items == ((32, 64, 1), (10, 20, 1))
    sizes = (tmp_path / "a.png").stat().st_size + (tmp_path / "b.jpg").stat().st_size
    assert request.mm_bytes == sizes
    content = request_payload(CHAT, request)["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "How many blocks?"}
    urls = [part["image_url"]["url"] for part in content[1:]]
    assert urls[0].startswith("data:image/png;base64,")
    assert urls[1].startswith("data:image/jpeg;base64,")
    assert base64.b64decode(urls[0].split(",", 1)[1]) == (tmp_path / "a.png").read_bytes()


def test_custom_image_keeps_interleaved_content_in_its_order(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    content = [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": "a.png"},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "a.png"}},
    ]
    path = jsonl(tmp_path / "images.jsonl", {"content": content})
    request = make_prompts(config("custom_image", path, num_prompts=1), CODEC)[0]
    sent = request_payload(CHAT, request)["messages"][0]["content"]
    assert [part["type"] for part in sent] == ["text", "image_url", "text", "image_url"]
    assert sent[0]["text"] == "Compare " and sent[2]["text"] == " and "
    assert request.prompt == "Compare  and " and len(request.mm_items) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "x", "image_files": ["a.png", "bad.png"]},
         r"images.jsonl:1: image_files\[1\]: 'bad.png' is not an image Pillow can read"),
        ({"prompt": "x", "image_files": ["gone.png"]},
         r"images.jsonl:1: image_files\[0\]: cannot read 'gone.png'"),
        ({"content": [{"type": "image", "image": "https://example.com/a.png"}]},
         r"images.jsonl:1: content\[0\]: 'https://example.com/a.png' is on the network"),
        ({"content": [{"type": "audio", "audio": "a.wav"}]},
         r"images.jsonl:1: content\[0\] is a text part"),
        ({"prompt": "x"}, r"images.jsonl:1: each line needs a string 'prompt' and a non-empty"),
    ],
)  # fmt: skip
def test_a_bad_custom_image_line_is_one_line_naming_file_line_and_key(
    tmp_path: Path, line: dict[str, Any], message: str
) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "bad.png").write_text("not an image at all")
    path = jsonl(tmp_path / "images.jsonl", line)
    with pytest.raises(DatasetError, match=message) as error:
        make_prompts(config("custom_image", path), CODEC)
    assert "\n" not in str(error.value) and "0x" not in str(error.value)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=200))
def test_any_bytes_that_are_not_an_image_get_the_line_never_a_traceback(data: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "x.png").write_bytes(data)
        path = jsonl(root / "d.jsonl", {"prompt": "p", "image_files": ["x.png"]})
        try:
            make_prompts(config("custom_image", path, num_prompts=1), CODEC)
        except DatasetError as error:
            assert str(error).startswith(f"{path}:1: image_files[0]: ")


def test_custom_audio_sends_a_wav_clip_as_an_input_audio_part(tmp_path: Path) -> None:
    wav(tmp_path / "clip.wav", 2.5)
    path = jsonl(tmp_path / "audio.jsonl", {"prompt": "Transcribe.", "audio": "clip.wav"})
    request = make_prompts(config("custom_audio", path, num_prompts=1), CODEC)[0]
    assert request.mm_audio_s == (2.5,) and request.mm_items == ()
    content = request_payload(CHAT, request)["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "Transcribe."}
    assert content[1]["type"] == "input_audio" and content[1]["input_audio"]["format"] == "wav"
    (tmp_path / "song.mp3").write_bytes(b"ID3 not a wav")
    bad = jsonl(tmp_path / "bad.jsonl", {"prompt": "x", "audio": "song.mp3"})
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: audio: 'song.mp3' is not a WAV file"):
        make_prompts(config("custom_audio", bad), CODEC)


def test_random_mm_video_buckets_send_their_frames_as_jpegs() -> None:
    mm = BenchmarkConfig(
        backend="openai-chat", dataset_name="random-mm", num_prompts=3, random_input_len=8,
        random_output_len=2, random_mm_bucket_config={"(32, 48, 5)": 1.0},
    )  # fmt: skip
    requests = make_prompts(mm, CODEC)
    assert {r.mm_items for r in requests} == {((32, 48, 5),)}
    url = requests[0].mm_content[0]["video_url"]["url"]
    assert url.startswith("data:video/jpeg;base64,")
    frames = url.split(",", 1)[1].split(",")
    assert len(frames) == 5
    with Image.open(io.BytesIO(base64.b64decode(frames[0]))) as frame:
        assert frame.size == (48, 32) and frame.format == "JPEG"
    assert len({r.mm_content[0]["video_url"]["url"] for r in requests}) == 3  # all new


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("dataset_name: custom_image\n  dataset_path: x.jsonl",
         "'custom_image' sends images, video or audio in chat messages: it needs backend: "
         "openai-chat"),
        ("dataset_name: burstgpt", "dataset_name 'burstgpt' needs dataset_path (a local file)"),
        ("dataset_name: speed_bench", "needs dataset_path (a local folder)"),
        ("dataset_name: random\n  spec_bench_category: qa",
         "spec_bench_category only apply to dataset_name 'spec_bench'"),
        ("dataset_name: hf", "'hf' downloads from the Hugging Face hub"),
    ],
)  # fmt: skip
def test_dataset_mistakes_are_one_line_naming_the_key(
    tmp_path: Path, block: str, message: str
) -> None:
    path = write_suite(tmp_path, f"server: {{model: m}}\nbenchmark:\n  {block}\n")
    error = suite_error(path)
    assert message in error and "bench_x.yaml" in error


@pytest.mark.vllm_python
@needs_vllm_python
def test_vllm_bench_serve_parses_every_new_datasets_rendered_options(tmp_path: Path) -> None:
    configs = [
        config("burstgpt", tmp_path / "b.csv"),
        config("spec_bench", tmp_path / "q.jsonl", spec_bench_category="qa",
               spec_bench_output_len=64),
        config("speed_bench", tmp_path, speed_bench_dataset_subset="throughput_8k",
               speed_bench_output_len=512, speed_bench_category="coding"),
        config("custom_image", tmp_path / "i.jsonl", custom_output_len=32),
        config("custom_audio", tmp_path / "a.jsonl"),
        BenchmarkConfig(backend="openai-chat", dataset_name="random-mm",
                        random_mm_bucket_config={"(256, 256, 1)": 0.5, "(64, 64, 8)": 0.5},
                        random_mm_limit_mm_per_prompt={"image": 2, "video": 1}),
    ]  # fmt: skip
    argvs = [vllm_bench_serve_argv(c, base_url="http://127.0.0.1:1", model="m") for c in configs]
    burst, spec, speed, image, audio, video = vllm_parse(BENCH_SERVE_PARSE, argvs)
    assert (burst["dataset_name"], burst["dataset_path"]) == ("burstgpt", str(tmp_path / "b.csv"))
    assert (spec["spec_bench_category"], spec["spec_bench_output_len"]) == ("qa", 64)
    assert (speed["speed_bench_dataset_subset"], speed["speed_bench_output_len"]) == (
        "throughput_8k", 512
    )
    assert image["custom_ensure_client_side_data"] and image["custom_output_len"] == 32
    assert audio["enable_multimodal_chat"] and not burst["enable_multimodal_chat"]
    assert video["random_mm_bucket_config"] == {"(256, 256, 1)": 0.5, "(64, 64, 8)": 0.5}
    # Another dataset's options stay off the command line.
    assert "--spec-bench-output-len" not in argvs[0] and "--random-mm-bucket-config" not in argvs[1]


def test_text_image_and_audio_datasets_run_on_the_simulator(
    pytester: pytest.Pytester, ports: str
) -> None:
    """Each local dataset on a simulated model that takes it: one record per case, with the
    media's counts, and an image that is not one failing its case in one line."""
    root = pytester.path
    (root / "burst.csv").write_text(BURSTGPT)
    jsonl(root / "question.jsonl", {"category": "qa", "turns": ["Why is the sky blue?"]})
    Image.new("RGB", (448, 448), "green").save(root / "a.png")
    (root / "broken.png").write_text("not an image")
    jsonl(root / "images.jsonl", {"prompt": "Describe it.", "image_files": ["a.png"]})
    jsonl(root / "broken.jsonl", {"prompt": "Describe it.", "image_files": ["broken.png"]})
    wav(root / "clip.wav", 3.0)
    jsonl(root / "audio.jsonl", {"prompt": "Transcribe.", "audio": "clip.wav"})
    vision = "server: {model: Qwen/Qwen2.5-VL-7B-Instruct, max_model_len: 4096}\n"
    common = "num_prompts: 4, custom_output_len: 4, max_concurrency: 2"
    suites = {
        "image": vision + "benchmark: {backend: openai-chat, dataset_name: custom_image, "
        f"{common}, dataset_path: [images.jsonl, broken.jsonl]}}\n",
        "burst": vision + f"benchmark: {{dataset_name: burstgpt, {common}, "
        "dataset_path: burst.csv}\n",
        "spec": vision + f"benchmark: {{dataset_name: spec_bench, {common}, "
        "dataset_path: question.jsonl, spec_bench_output_len: 4}\n",
        "audio": "server: {model: Qwen/Qwen2-Audio-7B-Instruct}\n"
        "benchmark: {backend: openai-chat, dataset_name: custom_audio, "
        f"{common}, dataset_path: audio.jsonl}}\n",
    }
    for name, text in suites.items():
        write_suite(root, text, f"bench_{name}.yaml")
    result = run_suites(pytester, ports, "-n", "2")
    # The suite, the key, then the loader's file, line and key: one line, no traceback.
    result.stdout.fnmatch_lines(
        [
            "bench_image.yaml: benchmark.dataset_path: *broken.jsonl:1: image_files[[]0[]]: "
            "'broken.png' is not an image Pillow can read"
        ]
    )
    assert "Traceback" not in result.stdout.str() and "DatasetError" not in result.stdout.str()
    result.assert_outcomes(passed=4, failed=1)
    written = {r["case_id"]: r for r in run_records(pytester) if r["status"] == "passed"}
    by_dataset = {r["config"]["benchmark"]["dataset_name"]: r["results"] for r in written.values()}
    assert set(by_dataset) == {"custom_image", "burstgpt", "spec_bench", "custom_audio"}
    assert all(r["completed"] == 4 for r in by_dataset.values())
    image, audio = by_dataset["custom_image"], by_dataset["custom_audio"]
    # 448x448: 16 x 16 Qwen tokens, two markers, the role line's two tokens.
    assert image["mean_mm_tokens_per_request"] == 256 + 4
    assert image["mean_mm_pixels_per_item"] == 448 * 448
    # 3 s: Qwen2-Audio's 75 tokens, two markers, the role line.
    assert audio["mean_mm_tokens_per_request"] == 75 + 4
    assert audio["mean_mm_audio_s_per_request"] == 3.0
    assert audio["mean_mm_pixels_per_item"] is None
    assert "total_mm_items" not in by_dataset["burstgpt"]
    # BurstGPT's rows give their own lengths: 7 and 12 tokens out.
    assert by_dataset["burstgpt"]["total_output_tokens"] in range(4 * 7, 4 * 12 + 1)
