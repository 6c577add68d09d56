"""The whole suite before its axes are expanded: its blocks, thresholds, exclusions and
regression gate."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator, model_validator

from pytest_profllm.engine.secrets import RedactedDict
from pytest_profllm.plan.regression import BRACKETED_METRICS, PER_REPEAT_METRICS, parse_regression


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A bound that is not a number can hold nothing to it: refused, with its line.
    min: FiniteFloat | None = None
    max: FiniteFloat | None = None

    @model_validator(mode="after")
    def _one_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs 'min', 'max' or both")
        return self


class Exclusion(BaseModel):
    """Cases whose server and benchmark values match all of these are left out."""

    model_config = ConfigDict(extra="forbid")

    server: dict[str, Any] = Field(default_factory=dict)
    benchmark: dict[str, Any] = Field(default_factory=dict)


class Suite(BaseModel):
    """A whole suite file before expansion; list values in server/benchmark are axes."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    description: str | None = None
    server: dict[str, Any]
    benchmark: dict[str, Any] = Field(default_factory=dict)
    thresholds: dict[str, Threshold] = Field(default_factory=dict)
    repeat: int = Field(1, gt=0)
    exclude: list[Exclusion] = Field(default_factory=list)
    # Each case ends with a short run under vLLM's profiler (`/start_profile`, `/stop_profile`).
    profile: bool = False
    # The regression gate: metric -> tolerance (a fraction), against --profllm-baseline.
    regression: dict[str, float] = Field(default_factory=dict)

    @field_validator("regression", mode="before")
    @classmethod
    def _regression(cls, value: object) -> dict[str, float]:
        return parse_regression(value)

    def __repr_args__(self) -> Any:
        # pytest prints reprs (-l, JUnit XML): `server:` shows a secret (api_key) as ***.
        for name, value in super().__repr_args__():
            server = name == "server" and isinstance(value, dict)
            yield name, RedactedDict(value) if server else value

    @model_validator(mode="after")
    def _repeats_for_throughputs(self) -> Suite:
        per_repeat = [
            name for name in self.regression
            if name in PER_REPEAT_METRICS and name not in BRACKETED_METRICS
        ]
        if per_repeat and self.repeat < 2:
            raise ValueError(
                f"regression: {per_repeat[0]} is compared on one value per repeat: "
                "set 'repeat: 2' or more"
            )
        return self

    @field_validator("server")
    @classmethod
    def _has_model(cls, server: dict[str, Any]) -> dict[str, Any]:
        if "model" not in server:
            raise ValueError("'model' is required (the model name or path vLLM serves)")
        return server
