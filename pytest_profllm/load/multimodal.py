"""Requests with media, sent inline in a chat message as vLLM's client sends them.

`random-mm`, as vLLM's RandomMultiModalDataset draws it: random text prompts (the random
dataset's), each with a number of items drawn on [floor(n(1-r)), ceil(n(1+r))] (n the base
items per request, r the range ratio, the top clamped to the sum of the per-modality limits),
every item of a (height, width, frames) bucket drawn with the bucket's probability; a modality
that reaches its limit drops out of the draw. Items are random RGB pixels (the worst case for
JPEG, as vLLM's) made here with Pillow: an image as a base64 JPEG data URL, a video (frames
over 1) as `data:video/jpeg;base64,` with its frames as base64 JPEGs joined by commas, a form
vLLM's server reads (vLLM's own client writes MP4 with OpenCV, which profllm does not need).

`custom_image` and `custom_audio` read JSON lines of local files: images are checked with
Pillow and sent as they are, as data URLs (vLLM's `--custom-ensure-client-side-data`); audio
is a WAV file sent as an `input_audio` part (vLLM's `--enable-multimodal-chat`).
"""

from __future__ import annotations

import base64
import io
import math
import warnings
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_profllm.limits import InputLimitError, check_pixels, too_many_pixels
from pytest_profllm.load.dataset_files import custom_output_len, fill, sampled_lines
from pytest_profllm.load.prompt import Codec, DatasetError, PromptRequest
from pytest_profllm.plan.suite import bucket_shape

if TYPE_CHECKING:
    from pytest_profllm.plan.suite import BenchmarkConfig


def random_mm_prompts(
    config: BenchmarkConfig, texts: list[PromptRequest]
) -> list[PromptRequest]:
    """The random dataset's `texts`, each given its images."""
    rng = np.random.default_rng(config.seed + 1)  # its own stream: the text stays random's
    buckets = {
        bucket_shape(key): p for key, p in config.random_mm_bucket_config.items() if p > 0
    }
    limits = {
        modality: limit
        for modality, limit in config.random_mm_limit_mm_per_prompt.items()
        if modality in {_modality(shape) for shape in buckets}
    }
    base, ratio = config.random_mm_base_items_per_request, config.random_mm_num_mm_items_range_ratio
    most = min(sum(limits.values()), math.ceil(base * (1 + ratio)))
    least = max(0, math.floor(base * (1 - ratio)))
    if least > most:
        raise ValueError(
            f"random_mm_base_items_per_request {base} needs at least {least} images, more than "
            f"random_mm_limit_mm_per_prompt allows ({most})"
        )
    requests = []
    for text in texts:
        shapes = _draw_items(rng, int(rng.integers(least, most + 1)), buckets, limits)
        content, sizes = [], 0
        for height, width, frames in shapes:
            part, size = (
                _image(rng, height, width) if frames == 1 else _video(rng, height, width, frames)
            )
            content.append(part)
            sizes += size
        requests.append(
            PromptRequest(
                text.prompt,
                text.prompt_len,
                text.output_len,
                mm_content=tuple(content),
                mm_items=tuple(shapes),
                mm_bytes=sizes,
            )
        )
    return requests


def _modality(shape: tuple[int, int, int]) -> str:
    return "image" if shape[2] == 1 else "video"


def _draw_items(
    rng: np.random.Generator,
    count: int,
    buckets: dict[tuple[int, int, int], float],
    limits: dict[str, int],
) -> list[tuple[int, int, int]]:
    """`count` bucket shapes, each drawn by probability; a modality at its limit drops out."""
    drawn: list[tuple[int, int, int]] = []
    used = dict.fromkeys(limits, 0)
    open_buckets = dict(buckets)
    while len(drawn) < count and open_buckets:
        shapes = list(open_buckets)
        weights = np.array(list(open_buckets.values()))
        shape = shapes[int(rng.choice(len(shapes), p=weights / weights.sum()))]
        modality = _modality(shape)
        if used[modality] < limits[modality]:
            used[modality] += 1
            drawn.append(shape)
        else:
            open_buckets = {s: p for s, p in open_buckets.items() if _modality(s) != modality}
    return drawn


# Every image is new, as vLLM's are: a server caches images by their content (vLLM hashes
# them for its encoder and prefix caches), so a repeated image would measure the cache.
def _image(rng: np.random.Generator, height: int, width: int) -> tuple[dict[str, Any], int]:
    """A chat content part with a random-pixel JPEG of this size, and its size in bytes."""
    # Deferred: Pillow (about 0.1 s) only for a multimodal workload.
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with io.BytesIO() as buffer:
        Image.fromarray(pixels).save(buffer, format="JPEG")
        data = buffer.getvalue()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}, len(data)


def _video(
    rng: np.random.Generator, height: int, width: int, frames: int
) -> tuple[dict[str, Any], int]:
    """A chat content part with a video of random-pixel JPEG frames, and its size in bytes."""
    # Deferred: Pillow (about 0.1 s) only for a multimodal workload.
    from PIL import Image

    encoded, size = [], 0
    for _ in range(frames):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        with io.BytesIO() as buffer:
            Image.fromarray(pixels).save(buffer, format="JPEG")
            size += buffer.tell()
            encoded.append(base64.b64encode(buffer.getvalue()).decode())
    url = "data:video/jpeg;base64," + ",".join(encoded)
    return {"type": "video_url", "video_url": {"url": url}}, size


def custom_image_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """JSON lines with a `prompt` and its `image_files`, or an interleaved `content` list of
    text and image parts (`image` or `image_url`), as vLLM's CustomImageDataset reads them.
    Each image is a local file (relative to the dataset's folder) or a data:image URL."""
    path, lines = sampled_lines(config)
    requests = []
    for where, item in lines:
        output_len = custom_output_len(config, item, where)
        if "content" in item:
            requests.append(_interleaved(item["content"], codec, output_len, path, where))
            continue
        prompt, files = item.get("prompt"), item.get("image_files")
        if not isinstance(prompt, str) or not isinstance(files, list) or not files:
            raise DatasetError(
                f"{where}: each line needs a string 'prompt' and a non-empty 'image_files' "
                "list, or a 'content' list"
            )
        images = [_image_file(f, path, f"{where}: image_files[{i}]") for i, f in enumerate(files)]
        requests.append(
            PromptRequest(
                prompt,
                len(codec.encode(prompt)),
                output_len,
                mm_content=tuple(part for part, _, _ in images),
                mm_items=tuple(shape for _, shape, _ in images),
                mm_bytes=sum(size for _, _, size in images),
            )
        )
    return fill(requests, config, path)


def _interleaved(
    content: Any, codec: Codec, output_len: int, path: Path, where: str
) -> PromptRequest:
    if not isinstance(content, list) or not content:
        raise DatasetError(f"{where}: 'content' is a non-empty list of text and image parts")
    parts: list[dict[str, Any]] = []
    shapes, size, text = [], 0, ""
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            text += part["text"]
            continue
        if kind == "image" or kind == "image_url":
            source = part.get(kind)
            if isinstance(source, dict):
                source = source.get("url")
            image, shape, image_size = _image_file(source, path, f"{where}: content[{index}]")
            parts.append(image)
            shapes.append(shape)
            size += image_size
            continue
        raise DatasetError(
            f"{where}: content[{index}] is a text part with a string 'text' or an image part "
            "('image' or 'image_url')"
        )
    return PromptRequest(
        text,
        len(codec.encode(text)),
        output_len,
        mm_items=tuple(shapes),
        mm_bytes=size,
        chat_content=tuple(parts),
    )


def _image_file(
    source: Any, dataset: Path, where: str
) -> tuple[dict[str, Any], tuple[int, int, int], int]:
    """An image content part for a local file or data:image URL, its (height, width, 1) and
    its size in bytes; DatasetError naming the line and key for what is not an image."""
    # Deferred: Pillow (about 0.1 s) only for a multimodal workload.
    from PIL import Image, UnidentifiedImageError

    if not isinstance(source, str) or not source:
        raise DatasetError(f"{where}: an image is a file path or a data:image URL")
    if source.startswith(("http://", "https://")):
        raise DatasetError(
            f"{where}: {source!r} is on the network; profllm sends images inline and never "
            "downloads: save it beside the dataset"
        )
    try:
        if source.startswith("data:image/"):
            data = base64.b64decode(source.split(",", 1)[-1], validate=True)
            shown = "the data:image URL"
        else:
            file = Path(source.removeprefix("file://"))
            file = file if file.is_absolute() else dataset.parent / file
            data, shown = file.read_bytes(), repr(source)
    except OSError as error:
        raise DatasetError(f"{where}: cannot read {source!r}: {error.strerror}") from None
    except ValueError:
        raise DatasetError(f"{where}: the data:image URL is not base64") from None
    try:
        with _opened(data) as image:
            check_pixels(image.width, image.height, what=f"{where}: {shown}")
            image.verify()  # the whole file, not only its header
            width, height, kind = image.width, image.height, image.format
    except InputLimitError as error:
        raise DatasetError(str(error)) from None
    except Image.DecompressionBombError:
        raise DatasetError(str(too_many_pixels(f"{where}: {shown}"))) from None
    except UnidentifiedImageError:
        raise DatasetError(f"{where}: {shown} is not an image Pillow can read") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise DatasetError(f"{where}: {shown} is not a whole image ({error})") from None
    mime = Image.MIME.get(str(kind), "image/png")
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}, (height, width, 1), len(data)


def _opened(data: bytes) -> Any:
    """An image with only its header read. Pillow's warning of a large image is ours to give:
    the caller checks limits.MAX_IMAGE_PIXELS, below Pillow's own limit, before decoding."""
    # Deferred: Pillow (about 0.1 s) only when an image is read.
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data))


def custom_audio_prompts(config: BenchmarkConfig, codec: Codec) -> list[PromptRequest]:
    """JSON lines with a `prompt` and an `audio` WAV file (relative to the dataset's folder),
    as vLLM's CustomAudioDataset reads them for a chat model: the text, then the clip as an
    `input_audio` part."""
    path, lines = sampled_lines(config)
    requests = []
    for where, item in lines:
        prompt, audio = item.get("prompt", ""), item.get("audio")
        if not isinstance(prompt, str) or not isinstance(audio, str) or not audio:
            raise DatasetError(f"{where}: each line needs an 'audio' file (and a string 'prompt')")
        file = Path(audio)
        file = file if file.is_absolute() else path.parent / file
        try:
            data = file.read_bytes()
            with wave.open(io.BytesIO(data)) as clip:
                seconds = clip.getnframes() / clip.getframerate()
        except OSError as error:
            raise DatasetError(f"{where}: audio: cannot read {audio!r}: {error.strerror}") from None
        except (wave.Error, EOFError, ZeroDivisionError) as error:
            raise DatasetError(
                f"{where}: audio: {audio!r} is not a WAV file profllm can read ({error})"
            ) from None
        part = {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"},
        }
        requests.append(
            PromptRequest(
                prompt,
                len(codec.encode(prompt)),
                custom_output_len(config, item, where),
                mm_content=(part,),
                mm_audio_s=(seconds,),
                mm_bytes=len(data),
            )
        )
    return fill(requests, config, path)
