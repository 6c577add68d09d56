"""What an image or a video costs a vision-language model: its prompt tokens and its
encoder's FLOPs.

The rules are the models' own, from their `config.json` (`vision_config`) and preprocessor
facts:
- Qwen2-VL, Qwen2.5-VL and Qwen3-VL resize an image to multiples of patch x merge pixels
  (28 for patch 14, 32 for patch 16) within [min_pixels, max_pixels], keeping its aspect
  (`smart_resize`), and give one token per merge x merge patches, between a vision-start and a
  vision-end token;
- a Qwen-VL video is its frames in pairs (`temporal_patch_size` 2, an odd last frame
  repeated), each frame resized the same way within the video processor's bounds (Hugging
  Face's Qwen2-VL video processor: 128 to 768 x 28 x 28 pixels), one token per merge x merge
  patches of a pair;
- LLaVA-1.5 resizes every image to its encoder's square (336 px, patch 14): 576 tokens, and
  takes no video.

The encoder runs once per image in the prefill of its request: about 2 FLOPs per encoder
parameter per patch it embeds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from typing import Any

from pytest_profllm.limits import InputLimitError, check_pixels, too_many_pixels

QWEN_RULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
LLAVA_RULES = ("llava",)


@dataclass(frozen=True)
class VisionFacts:
    rule: str  # the model_type whose rule applies: qwen2_vl, qwen2_5_vl, qwen3_vl, llava
    patch_size: int
    merge_size: int = 1  # patches merged into one token, per side
    image_size: int = 0  # LLaVA: the encoder's square
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384
    encoder_params: int = 0
    # Tokens around each image's placeholders in the prompt (Qwen: vision start and end).
    marker_tokens: int = 0
    # Video (Qwen-VL): frames per temporal patch and each frame's pixel bounds; 0: no video.
    temporal_patch_size: int = 0
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionFacts | None:
        """The vision facts of a model's config.json, or None for a text-only model (or one
        whose image rule the simulator does not know)."""
        vision = config.get("vision_config")
        rule = str(config.get("model_type") or "")
        if not isinstance(vision, dict) or rule not in (*QWEN_RULES, *LLAVA_RULES):
            return None
        # `preprocessor` is the catalog's copy of preprocessor_config.json (pixel bounds).
        pre = config.get("preprocessor") or {}
        params = _encoder_params(vision)
        if rule in LLAVA_RULES:
            return cls(
                rule=rule, patch_size=int(vision.get("patch_size", 14)),
                image_size=int(vision.get("image_size", 336)), encoder_params=params,
            )  # fmt: skip
        patch = int(vision.get("patch_size", 14))
        merge = int(vision.get("spatial_merge_size", 2))
        unit = patch * merge
        return cls(
            rule=rule, patch_size=patch, merge_size=merge,
            min_pixels=int(pre.get("min_pixels", 4 * unit * unit)),
            max_pixels=int(pre.get("max_pixels", 16384 * unit * unit)),
            encoder_params=params, marker_tokens=2,
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        )  # fmt: skip

    def image_tokens(self, width: int, height: int) -> int:
        """The placeholder tokens of one image of this size (markers excluded)."""
        if self.rule in LLAVA_RULES:
            return (self.image_size // self.patch_size) ** 2
        unit = self.patch_size * self.merge_size
        new_height, new_width = smart_resize(height, width, unit, self.min_pixels, self.max_pixels)
        return (new_height // unit) * (new_width // unit)

    def encoder_flops(self, width: int, height: int) -> float:
        """The encoder's FLOPs for one image: 2 per parameter per patch embedded."""
        patches = self.image_tokens(width, height) * self.merge_size**2
        return 2.0 * self.encoder_params * patches

    @property
    def takes_video(self) -> bool:
        return self.temporal_patch_size > 0

    def video_tokens(self, width: int, height: int, frames: int) -> int:
        """The placeholder tokens of one video (markers excluded): per pair of frames, one
        frame's resized patches over merge x merge."""
        unit = self.patch_size * self.merge_size
        new_height, new_width = smart_resize(
            height, width, unit, self.video_min_pixels, self.video_max_pixels
        )
        pairs = math.ceil(frames / self.temporal_patch_size)
        return pairs * (new_height // unit) * (new_width // unit)

    def video_encoder_flops(self, width: int, height: int, frames: int) -> float:
        patches = self.video_tokens(width, height, frames) * self.merge_size**2
        return 2.0 * self.encoder_params * patches


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size Qwen-VL's image processor resizes to: each side a multiple of `factor`, the
    area within [min_pixels, max_pixels], the aspect kept as near as those allow."""
    new_height = max(factor, round(height / factor) * factor)
    new_width = max(factor, round(width / factor) * factor)
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def _encoder_params(vision: dict[str, Any]) -> int:
    """A ViT's weights: per block attention (4 h^2) and MLP (gated for Qwen2.5/3-VL: 3 h i,
    else 2 h i), plus the patch merger into the language model's width."""
    hidden = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
    depth = int(vision.get("depth") or vision.get("num_hidden_layers") or 0)
    inner = int(vision.get("intermediate_size") or 4 * hidden)
    gated = 3 if vision.get("hidden_act") == "silu" else 2
    merge = int(vision.get("spatial_merge_size", 1))
    out = int(vision.get("out_hidden_size") or hidden)
    merger = (hidden * merge * merge) ** 2 + hidden * merge * merge * out
    return depth * (4 * hidden * hidden + gated * hidden * inner) + merger


class ImageError(ValueError):
    """An image part the simulator cannot read; the message says why."""


def image_size(url: str) -> tuple[tuple[int, int], bytes]:
    """(width, height) of an inline image (`data:image/...;base64,`), read from its header,
    and its bytes."""
    # Deferred: Pillow (about 0.1 s) only when an image comes.
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:image/") or ";base64," not in url:
        raise ImageError(
            "the simulator takes images inline as data:image/...;base64 URLs, not by address"
        )
    try:
        data = base64.b64decode(url.split(",", 1)[1], validate=True)
        # Only the header is read; Pillow's warning of a large image is the limit's to give.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
        with image:
            check_pixels(*image.size, what="the image")
            return image.size, data
    except InputLimitError as error:
        raise ImageError(str(error)) from None
    except Image.DecompressionBombError:
        raise ImageError(str(too_many_pixels("the image"))) from None
    except (binascii.Error, UnidentifiedImageError, OSError) as error:
        raise ImageError(f"cannot read the image: {error}") from None


def video_frames(url: str) -> tuple[tuple[int, int], int, bytes]:
    """(width, height) of an inline video's first frame, its frame count and its bytes. The
    simulator takes what vLLM's own clients send without OpenCV: `data:video/jpeg;base64,`
    and the frames as base64 JPEGs joined by commas."""
    prefix = "data:video/jpeg;base64,"
    if not url.startswith(prefix):
        raise ImageError(
            "the simulator takes videos inline as data:video/jpeg;base64 URLs (JPEG frames "
            "joined by commas)"
        )
    frames = url[len(prefix) :].split(",")
    size, _ = image_size("data:image/jpeg;base64," + frames[0])
    return size, len(frames), url.encode()


def image_ids(data: bytes, count: int, vocab_size: int) -> list[int]:
    """Placeholder token ids for an image, drawn from a hash of its bytes: the prefix cache
    finds the same image again, and never takes two different ones for the same."""
    ids: list[int] = []
    block = b""
    counter = 0
    seed = hashlib.sha256(data).digest()
    while len(ids) < count:
        if not block:
            block = hashlib.sha256(seed + counter.to_bytes(8, "little")).digest()
            counter += 1
        ids.append(int.from_bytes(block[:4], "little") % vocab_size)
        block = block[4:]
    return ids
