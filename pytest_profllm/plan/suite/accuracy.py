"""An accuracy case (`kind: accuracy`): an lm-eval task scored against the configuration's
server."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, field_validator

from pytest_profllm.plan import metric_names


class AccuracyConfig(BaseModel):
    """An accuracy case: lm-evaluation-harness scores one task against the configuration's
    server (its API models, `local-completions` or `local-chat-completions`), as the serve
    cases of the configuration measure it (run/accuracy.py). A list of tasks is an axis."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["accuracy"]
    # An lm-eval task name, one the package ships (load/accuracy_task.py), or a task YAML file
    # (which reads local data: nothing is downloaded while a case runs).
    task: str = Field(min_length=1)
    # lm-eval's --limit: the first N samples (an integer), or a fraction of them (under 1).
    limit: int | FiniteFloat | None = Field(None, gt=0)
    num_fewshot: int | None = Field(None, ge=0)
    # Requests in flight at once (lm-eval's num_concurrent; each request carries one prompt).
    batch_size: int = Field(1, gt=0)
    # lm-eval's API model: completions scores answers by loglikelihood (multiple choice) and
    # generates; chat-completions only generates.
    api: Literal["completions", "chat-completions"] = "completions"
    # Ours: the whole evaluation must end within this.
    timeout_s: FiniteFloat = Field(1800.0, gt=0)

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float) and not value < 1:
            raise ValueError("a fractional limit lies under 1 (a count is an integer)")
        return value

    def result_names(self) -> list[str]:
        return list(metric_names.ACCURACY_RESULTS)
