"""What a clip of audio costs an audio-language model: its prompt tokens and its encoder's
FLOPs.

Qwen2-Audio's rule, from its config.json (`audio_config`, a Whisper encoder) and processor:
the clip is resampled to 16 kHz and cut at 30 s, turned into mel frames of 10 ms, halved by
the encoder's strided convolution and halved again by its pooling, one token per 40 ms (750
for a full 30 s), between an audio-start and an audio-end token. The encoder runs once per
clip in its request's prefill: about 2 FLOPs per encoder parameter per frame it embeds.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from dataclasses import dataclass
from typing import Any

AUDIO_RULES = ("qwen2_audio",)
_MEL_FRAMES_PER_S = 100  # Whisper's feature extractor: 16 kHz, hop length 160
_MAX_SECONDS = 30.0  # its chunk: longer clips are cut


@dataclass(frozen=True)
class AudioFacts:
    rule: str
    encoder_params: int
    marker_tokens: int = 2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AudioFacts | None:
        """The audio facts of a model's config.json, or None for a model without audio."""
        audio = config.get("audio_config")
        rule = str(config.get("model_type") or "")
        if not isinstance(audio, dict) or rule not in AUDIO_RULES:
            return None
        width = int(audio.get("d_model", 1280))
        ffn = int(audio.get("encoder_ffn_dim", 4 * width))
        layers = int(audio.get("encoder_layers", 32))
        return cls(rule=rule, encoder_params=layers * (4 * width * width + 2 * width * ffn))

    def audio_tokens(self, seconds: float) -> int:
        """The placeholder tokens of one clip (markers excluded)."""
        mel = int(min(seconds, _MAX_SECONDS) * _MEL_FRAMES_PER_S)
        after_conv = (mel - 1) // 2 + 1
        return max(1, (after_conv - 2) // 2 + 1)

    def encoder_flops(self, seconds: float) -> float:
        frames = (int(min(seconds, _MAX_SECONDS) * _MEL_FRAMES_PER_S) - 1) // 2 + 1
        return 2.0 * self.encoder_params * frames


class AudioError(ValueError):
    """An audio part the simulator cannot read; the message says why."""


def wav_seconds(data_b64: str) -> tuple[float, bytes]:
    """The length in seconds of an inline WAV clip (base64, as `input_audio.data`), and its
    bytes."""
    try:
        data = base64.b64decode(data_b64, validate=True)
        with wave.open(io.BytesIO(data)) as clip:
            rate = clip.getframerate()
            return clip.getnframes() / rate if rate else 0.0, data
    except (binascii.Error, wave.Error, EOFError, ValueError) as error:
        raise AudioError(f"cannot read the audio as WAV: {error}") from None
