"""The offline kinds (`kind: throughput`, `kind: latency`): `vllm bench throughput` and
`vllm bench latency`, which start no server."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from pytest_profllm.plan.metric_names import LATENCY_RESULTS, THROUGHPUT_RESULTS


class ThroughputConfig(BaseModel):
    """An offline throughput run: `vllm bench throughput`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["throughput"]
    backend: Literal["vllm", "vllm-chat"] = "vllm"
    dataset_name: Literal["random", "sharegpt", "prefix_repetition"] = "random"
    dataset_path: str | None = None  # sharegpt: a local ShareGPT JSON file
    # vLLM's own default of --input-len is unset, which means 1024 for the random dataset.
    input_len: int = Field(1024, gt=0)
    output_len: int | None = Field(None, gt=0)  # None: the dataset's (random: 128)
    num_prompts: int = Field(1000, gt=0)
    n: int = Field(1, gt=0)
    prefix_len: int = Field(0, ge=0)
    random_range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    prefix_repetition_prefix_len: int | None = Field(None, gt=0)
    prefix_repetition_suffix_len: int | None = Field(None, gt=0)
    prefix_repetition_num_prefixes: int | None = Field(None, gt=0)
    prefix_repetition_output_len: int | None = Field(None, gt=0)
    async_engine: bool = False
    disable_detokenize: bool = False
    # Ours, not vLLM's: the whole command (engine start included) must end within this.
    timeout_s: FiniteFloat = Field(1800.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> ThroughputConfig:
        if self.dataset_name == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_name 'sharegpt' needs dataset_path (a local file)")
        if self.dataset_name == "prefix_repetition":
            needed = [
                f"prefix_repetition_{name}"
                for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len")
                if getattr(self, f"prefix_repetition_{name}") is None
            ]
            if needed:
                raise ValueError(f"dataset_name 'prefix_repetition' needs {', '.join(needed)}")
        return self

    def result_names(self) -> list[str]:
        return list(THROUGHPUT_RESULTS)


class LatencyConfig(BaseModel):
    """An offline latency run: `vllm bench latency`'s flags in snake_case (no server)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["latency"]
    batch_size: int = Field(8, gt=0)
    input_len: int = Field(32, gt=0)
    output_len: int = Field(128, gt=0)
    n: int = Field(1, gt=0)
    num_iters_warmup: int = Field(10, ge=0)
    num_iters: int = Field(30, gt=0)
    use_beam_search: bool = False
    disable_detokenize: bool = False
    timeout_s: FiniteFloat = Field(1800.0, gt=0)  # ours: the whole command's limit

    def result_names(self) -> list[str]:
        return list(LATENCY_RESULTS)
