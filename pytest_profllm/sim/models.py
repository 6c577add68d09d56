"""What the simulator knows of a model: the shape facts of its `config.json`.

A hub name resolves through the catalog shipped with the package (`sim/data/models.json`,
facts only, no weights); a local folder uses its own `config.json`. An unknown hub name is
an error that lists the known ones. From the facts follow the parameter count (total, and
active per token for mixture-of-experts models), the bytes per parameter (dtype and FP8
quantisation) and the KV-cache bytes per token.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytest_profllm.limits import MAX_RECORD_BYTES, InputLimitError, load_json
from pytest_profllm.sim.audio import AudioFacts
from pytest_profllm.sim.vision import VisionFacts

CATALOG_PATH = Path(__file__).with_name("data") / "models.json"
_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "fp8": 1.0, "float8": 1.0}
_FP8_METHODS = ("fp8", "compressed-tensors", "modelopt", "fbgemm_fp8")


class UnknownModel(ValueError):
    """A model name the catalog does not hold and no folder of that name exists."""


@dataclass(frozen=True)
class ModelFacts:
    name: str
    source: str  # "catalog", or the config.json path it was read from
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    quantization: str | None
    max_position_embeddings: int
    num_experts: int = 0  # routed experts; 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    kv_lora_rank: int = 0  # multi-head latent attention (DeepSeek): the KV cache holds the latent
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # A vision-language model's image rule and encoder (sim/vision.py); None: text only.
    vision: VisionFacts | None = None
    # An audio-language model's clip rule and encoder (sim/audio.py); None: no audio.
    audio: AudioFacts | None = None

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any], source: str) -> ModelFacts:
        vision = VisionFacts.from_config(config)
        audio = AudioFacts.from_config(config)
        text = config.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers keep the language model's shape here
            config = {**config, **text}
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            layers = int(config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError) as error:
            missing = f"{source}: config.json lacks {error} (a transformer's shape)"
            raise UnknownModel(missing) from None
        quant = config.get("quantization_config") or {}
        method = str(quant.get("quant_method", "")) if isinstance(quant, dict) else ""
        fp8 = method in _FP8_METHODS or "fp8" in name.lower()
        return cls(
            name=name,
            source=source,
            num_hidden_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config.get("intermediate_size") or 4 * hidden),
            vocab_size=int(config.get("vocab_size") or 32000),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            quantization="fp8" if fp8 else (method or None),
            max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
            num_experts=int(
                config.get("num_experts")
                or config.get("n_routed_experts")
                or config.get("num_local_experts")
                or 0
            ),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(
                config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
            ),
            num_shared_experts=int(config.get("n_shared_experts") or 0),
            first_dense_layers=int(config.get("first_k_dense_replace") or 0),
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            vision=vision,
            audio=audio,
        )

    @property
    def bytes_per_param(self) -> float:
        if self.quantization == "fp8":
            return 1.0
        if self.quantization in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
            return 0.5
        return _DTYPE_BYTES.get(self.dtype, 2.0)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers (bf16 cache, as vLLM's `auto`)."""
        if self.kv_lora_rank:  # MLA keeps one latent and the rope part per layer
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        return per_layer * 2 * self.num_hidden_layers

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.kv_lora_rank:
            heads, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (
                h * self.q_lora_rank + self.q_lora_rank * heads * qk
                if self.q_lora_rank
                else h * heads * qk
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        q = h * self.num_attention_heads * self.head_dim
        kv = 2 * h * self.num_key_value_heads * self.head_dim
        return q + kv + self.num_attention_heads * self.head_dim * h

    def _mlp_params(self, experts: int) -> int:
        """Gated MLP weights of one layer with `experts` routed experts in use (dense: 0)."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.intermediate_size
        return 3 * h * self.moe_intermediate_size * (experts + self.num_shared_experts)

    def _params(self, experts: int) -> int:
        embeddings = self.vocab_size * self.hidden_size
        embeddings *= 1 if self.tie_word_embeddings else 2
        dense_layers = self.first_dense_layers if self.num_experts else self.num_hidden_layers
        moe_layers = self.num_hidden_layers - dense_layers
        per_dense = self._attention_params() + 3 * self.hidden_size * self.intermediate_size
        per_moe = self._attention_params() + self._mlp_params(experts)
        return embeddings + dense_layers * per_dense + moe_layers * per_moe

    @property
    def params(self) -> int:
        """All parameters (every expert)."""
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (its experts only)."""
        return self._params(self.num_experts_per_tok) if self.num_experts else self.params

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def describe(self) -> dict[str, Any]:
        """What the record says of the model facts that produced the figures."""
        facts = {k: v for k, v in asdict(self).items() if v not in (0, None) or k == "quantization"}
        return {
            **facts,
            "params": self.params,
            "active_params": self.active_params,
            "bytes_per_param": self.bytes_per_param,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


@functools.cache
def catalog() -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads(CATALOG_PATH.read_text())["models"]
    return data


def known_names() -> list[str]:
    return sorted(catalog())


def _read_config(path: Path) -> Any:
    """A model folder's config.json: one line naming it where it is not JSON or over a limit
    (a deep one was a RecursionError)."""
    try:
        return load_json(path.read_bytes(), what=str(path), max_bytes=MAX_RECORD_BYTES)
    except InputLimitError:
        raise
    except ValueError as error:
        raise ValueError(f"{path}: not JSON: {error}") from None


def resolve_model(model: str, folder: Path | None = None) -> ModelFacts:
    """The facts of `model`: a folder's config.json (`folder`, or `model` itself when it is
    one), else the catalog entry of that hub name (case-insensitive)."""
    for candidate in (folder, Path(model).expanduser()):
        if candidate is not None and (candidate / "config.json").is_file():
            config_path = candidate / "config.json"
            config = _read_config(config_path)
            return ModelFacts.from_config(model, config, str(config_path))
    entries = catalog()
    by_lower = {name.lower(): name for name in entries}
    found = by_lower.get(model.lower().rstrip("/"))
    if found is None:
        raise UnknownModel(
            f"model {model!r} is not in the simulator's catalog and is not a folder with a "
            f"config.json; known models: {', '.join(known_names())}"
        )
    return ModelFacts.from_config(found, entries[found], "catalog")
