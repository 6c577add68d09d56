"""docs/ci-recipe.md's workflow, run: its `run:` steps (all but the install), in order, as one
bash script in a folder of a tiny suite, as a main branch run (no baseline yet: it writes one)
and then as a pull request's (gated against it). The `uses:` steps are GitHub's; the cache
they stand for is the folder, kept between the two runs. The suite runs on the simulated
engine's virtual clock, so nothing here depends on how busy the host is."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

RECIPE = Path(__file__).parent.parent / "docs" / "ci-recipe.md"
SUITE = """
server:
  model: sim-8b
  enable_prefix_caching: false
  max_num_batched_tokens: 1024
benchmark:
  num_prompts: 20
  random_input_len: 512
  random_output_len: 16
regression:
  p99_e2el_ms: 10%
"""


def workflow() -> dict[str, Any]:
    (block,) = re.findall(r"```yaml\n(.*?)```", RECIPE.read_text(), re.S)
    loaded: dict[str, Any] = yaml.safe_load(block)
    return loaded


def script() -> str:
    steps = workflow()["jobs"]["benchmarks"]["steps"]
    runs = [step["run"] for step in steps if "run" in step and step.get("name") != "Install"]
    return "set -e\n" + "\n".join(f"(\n{run}\n)" for run in runs)


def run_workflow(folder: Path, ref: str, ports: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        **{key: str(value) for key, value in workflow()["env"].items()},
        "SUITES": "bench_tiny.yaml",
        "GITHUB_REF": ref,
        # The recipe's `pytest`, here on the virtual clock and this test's ports.
        "PYTEST_ADDOPTS": f"--profllm-sim-clock=virtual --profllm-ports={ports} "
                          "-p no:cacheprovider",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return subprocess.run(["bash", "-c", script()], cwd=folder, env=env, text=True,
                          capture_output=True, timeout=300, check=False)


def test_the_recipe_runs_ungated_then_gated_against_what_main_saved(
    tmp_path: Path, ports: str
) -> None:
    (tmp_path / "bench_tiny.yaml").write_text(SUITE)
    first = run_workflow(tmp_path, "refs/heads/main", ports)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (tmp_path / "baseline" / "results.db").is_file()  # what the cache would save
    assert "baseline/results.db (0 run(s))" in first.stdout  # nothing to gate against yet
    # A pull request's job: a fresh checkout, the baseline restored from the cache.
    shutil.rmtree(tmp_path / "results")
    second = run_workflow(tmp_path, "refs/pull/1/merge", ports)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(r"profllm: regression gate against baseline \S*baseline/results.db "
                     r"\(1 run\(s\)\)", second.stdout), second.stdout[-3000:]
    with sqlite3.connect(tmp_path / "results" / "results.db") as db:
        verdicts = db.execute("SELECT metric, verdict FROM regression_verdicts").fetchall()
    assert verdicts == [("p99_e2el_ms", "unchanged")]  # the same engine, the same figures
