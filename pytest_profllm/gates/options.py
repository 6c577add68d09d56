"""The regression gate's options (in the `profllm` group) and the settings built from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_profllm.gates.spec import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from pytest_profllm.gates.verdict import GateSettings


def parse_confidence(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a confidence like 0.99, got {text!r}") from None
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"a confidence lies in [0.5, 1), got {text!r}")
    return value


def parse_resamples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of resamples, got {text!r}") from None
    if value < 100:
        raise argparse.ArgumentTypeError(f"at least 100 resamples, got {text!r}")
    return value


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("profllm")
    group.addoption(
        "--profllm-baseline",
        metavar="PATH",
        default=None,
        help="compare each case with a `regression:` block against the runs of the same "
        "fingerprint in PATH: a results.db or a folder of records (ini: profllm_baseline)",
    )
    group.addoption(
        "--profllm-baseline-any-version",
        action="store_true",
        default=None,
        help="leave the engine's version out of the fingerprint "
        "(ini: profllm_baseline_any_version; default: off)",
    )
    group.addoption(
        "--profllm-baseline-update",
        action="store_true",
        default=False,
        help="write this run's measured cases into the --profllm-baseline PATH, so they become "
        "the baseline of the next run",
    )
    group.addoption(
        "--profllm-summary",
        metavar="PATH",
        default=None,
        help="write a Markdown summary of the run to PATH (ini: profllm_summary; default: "
        "DIR/summary.md with --profllm-out); also appended to $GITHUB_STEP_SUMMARY when set",
    )
    group.addoption(
        "--profllm-gate-confidence",
        metavar="LEVEL",
        type=parse_confidence,
        default=None,
        help="confidence level of the gate's bootstrap intervals "
        f"(ini: profllm_gate_confidence; default: {DEFAULT_CONFIDENCE})",
    )
    group.addoption(
        "--profllm-gate-resamples",
        metavar="N",
        type=parse_resamples,
        default=None,
        help="bootstrap resamples per verdict "
        f"(ini: profllm_gate_resamples; default: {DEFAULT_RESAMPLES})",
    )
    parser.addini("profllm_baseline", "results.db or folder of records to gate against")
    parser.addini(
        "profllm_baseline_any_version", "leave the engine version out", type="bool", default=False
    )
    parser.addini("profllm_summary", "Markdown summary file", default=None)
    parser.addini("profllm_gate_confidence", "bootstrap confidence level", default=None)
    parser.addini("profllm_gate_resamples", "bootstrap resamples", default=None)


@dataclass(frozen=True)
class GateConfig:
    baseline: Path | None
    with_version: bool
    update_baseline: bool
    summary: Path | None
    settings: GateSettings

    @classmethod
    def from_config(cls, config: pytest.Config, out_dir: Path | None) -> GateConfig:
        here = config.invocation_params.dir

        def path(option: str, ini: str) -> Path | None:
            value = config.getoption(option) or config.getini(ini)
            return here / str(value) if value else None

        def number(option: str, ini: str, parse: object, default: float) -> float:
            value = config.getoption(option)
            if value is not None:
                return float(value)
            text = config.getini(ini)
            if not text:
                return default
            try:
                return float(parse(str(text)))  # type: ignore[operator]
            except argparse.ArgumentTypeError as error:
                raise pytest.UsageError(f"ini option {ini}: {error}") from None

        baseline = path("profllm_baseline", "profllm_baseline")
        update = bool(config.getoption("profllm_baseline_update"))
        if update and baseline is None:
            raise pytest.UsageError(
                "--profllm-baseline-update needs --profllm-baseline PATH (where to write it)"
            )
        if baseline is not None and not update and not baseline.exists():
            raise pytest.UsageError(
                f"--profllm-baseline {baseline}: no such file or folder "
                "(write one with --profllm-baseline-update)"
            )
        any_version = config.getoption("profllm_baseline_any_version")
        if any_version is None:
            any_version = config.getini("profllm_baseline_any_version")
        summary = path("profllm_summary", "profllm_summary")
        if summary is None and out_dir is not None:
            summary = out_dir / "summary.md"
        return cls(
            baseline=baseline,
            with_version=not any_version,
            update_baseline=update,
            summary=summary,
            settings=GateSettings(
                confidence=number(
                    "profllm_gate_confidence",
                    "profllm_gate_confidence",
                    parse_confidence,
                    DEFAULT_CONFIDENCE,
                ),
                resamples=int(
                    number(
                        "profllm_gate_resamples",
                        "profllm_gate_resamples",
                        parse_resamples,
                        DEFAULT_RESAMPLES,
                    )
                ),
            ),
        )


GATE_CONFIG_KEY = pytest.StashKey[GateConfig]()
