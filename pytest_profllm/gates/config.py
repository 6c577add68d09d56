"""The regression gate's settings for a session, as the `profllm` options set them
(options/), kept in the pytest config's stash for the gate's worker and controller sides."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_profllm.gates.regression import GateSettings


@dataclass(frozen=True)
class GateConfig:
    baseline: Path | None
    with_version: bool
    update_baseline: bool
    summary: Path | None
    settings: GateSettings
    require_baseline: bool = False  # a gated case without a baseline fails


GATE_CONFIG_KEY = pytest.StashKey[GateConfig]()
