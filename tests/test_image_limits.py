"""Image pixels are limited (limits.MAX_IMAGE_PIXELS), read from the header before
any decoding, where a dataset's images are read (load/multimodal.py) and where the simulator
prices them (sim/vision.py): a decompression bomb is one line naming the file, never Pillow's
DecompressionBombError traceback."""

from __future__ import annotations

import base64
import io
import json
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pytest_profllm.limits import MAX_IMAGE_PIXELS
from pytest_profllm.load.dataset import DatasetError, TokenizerCodec, make_prompts
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.model_files import MODEL_DIR
from pytest_profllm.sim.vision import ImageError, image_size

CODEC = TokenizerCodec.load(str(MODEL_DIR))


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height and holds no pixels: what a bomb's header says."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def image_dataset(folder: Path, data: bytes) -> Path:
    (folder / "x.png").write_bytes(data)
    path = folder / "d.jsonl"
    path.write_text(json.dumps({"prompt": "p", "image_files": ["x.png"]}) + "\n")
    return path


def read_dataset(path: Path) -> None:
    make_prompts(BenchmarkConfig(dataset_name="custom_image", dataset_path=str(path),
                                 backend="openai-chat", num_prompts=1), CODEC)


@pytest.mark.parametrize(("width", "height", "said"), [
    # Before: DecompressionBombError, a traceback (Pillow refuses over 179 M pixels itself).
    (20_000, 20_000, "'x.png' has more than the 64,000,000 pixels an image may have"),
    # Before: read, and its pixels decoded, as Pillow only warns up to 179 M.
    (9_000, 9_000, "'x.png' is 9000x9000 pixels, more than the 64,000,000 an image may have"),
])  # fmt: skip
def test_a_dataset_image_over_the_limit_is_one_line_naming_it(
    tmp_path: Path, width: int, height: int, said: str
) -> None:
    path = image_dataset(tmp_path, png_header(width, height))
    with pytest.raises(DatasetError) as caught:
        read_dataset(path)
    assert str(caught.value) == f"{path}:1: image_files[0]: {said}"


@pytest.mark.parametrize(("width", "height", "said"), [
    (20_000, 20_000, "the image has more than the 64,000,000 pixels an image may have"),
    (9_000, 9_000, "the image is 9000x9000 pixels, more than the 64,000,000 an image may have"),
])  # fmt: skip
def test_the_simulator_refuses_an_image_over_the_limit_in_one_line(
    width: int, height: int, said: str
) -> None:
    url = "data:image/png;base64," + base64.b64encode(png_header(width, height)).decode()
    with pytest.raises(ImageError) as caught:
        image_size(url)
    assert str(caught.value) == said


def small_image(width: int, height: int, kind: str, seed: int) -> bytes:
    pixels = bytes((seed + at) % 256 for at in range(width * height * 3))
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buffer, format=kind)
    return buffer.getvalue()


images = st.one_of(
    st.builds(png_header, st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1)),
    st.builds(small_image, st.integers(1, 48), st.integers(1, 48),
              st.sampled_from(["PNG", "JPEG"]), st.integers(0, 255)),
)


@settings(max_examples=60, deadline=None)
@given(data=images, cut=st.one_of(st.none(), st.integers(0, 400)),
       garbage=st.binary(max_size=16))
def test_any_image_header_gives_a_size_or_one_line(
    data: bytes, cut: int | None, garbage: bytes
) -> None:
    data = (data if cut is None else data[:cut]) + garbage
    with tempfile.TemporaryDirectory() as folder:
        path = image_dataset(Path(folder), data)
        try:
            read_dataset(path)
        except DatasetError as error:
            assert str(error).startswith(f"{path}:1: image_files[0]: ")
            assert "\n" not in str(error)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    try:
        (width, height), _ = image_size(url)
    except ImageError as error:
        assert "\n" not in str(error)
    else:
        assert width * height <= MAX_IMAGE_PIXELS
