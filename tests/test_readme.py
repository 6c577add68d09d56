"""README's commands and option table are the documentation: they must match what ships."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def shell_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, flags=re.S)


def test_readme_has_the_two_setup_commands() -> None:
    commands = [line for block in shell_blocks() for line in block.splitlines()]
    assert any(
        "pip install -e ." in line and "pytest benchmarks/ -n 4 --profllm-out results/" in line
        for line in commands
    )
    assert any('pip install -e ".[test]"' in line for line in commands)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = next(
        line
        for block in shell_blocks()
        for line in block.splitlines()
        if 'pip install -e ".[test]"' in line
    )
    assert test_command in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_option_and_ini_key_is_documented() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "pytest", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    flags = set(re.findall(r"--profllm-[a-z-]+", help_text))
    inis = set(re.findall(r"^  (profllm_[a-z_]+)", help_text, flags=re.M))
    assert len(flags) >= 7 and len(inis) >= 8, help_text
    for flag in sorted(flags):
        assert f"`{flag}" in README, f"{flag} is not in README's option table"
    for ini in sorted(inis):
        assert f"`{ini}`" in README, f"ini option {ini} is not documented"


def test_the_suites_readme_runs_ship_as_it_shows_them() -> None:
    # README's regression-gate example ran `pytest bench_gate.yaml`, a file the clone lacked.
    named = {
        token
        for block in shell_blocks()
        for line in block.splitlines()
        if "pytest " in line
        for token in line.split()
        if token.endswith((".yaml", ".yml"))
    }
    assert named, "README runs no suite file by name"
    for path in sorted(named):
        assert (REPO / path).is_file(), f"README runs {path}, which is not in the repository"
    gate = yaml.safe_load((REPO / "benchmarks" / "gate" / "bench_gate.yaml").read_text())
    shown = []
    for block in re.findall(r"```yaml\n(.*?)```", README, re.S):
        with contextlib.suppress(yaml.YAMLError):  # an excerpt need not be a whole document
            shown.append(yaml.safe_load(block))
    assert {key: value for key, value in gate.items() if key not in ("name", "description")} in (
        shown
    ), "README's bench_gate.yaml differs from benchmarks/gate/bench_gate.yaml"
