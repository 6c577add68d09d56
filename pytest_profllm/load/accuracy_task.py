"""The accuracy task the package ships: questions with one right answer, made here from a fixed
seed (two-digit additions, "which is largest" among four numbers), and lm-eval task configs that
read them from the package's own file (`data/accuracy/`: the data and one YAML per task), as a
multiple-choice task (scored by loglikelihood) and a generate-until task (scored by exact
match). Nothing is downloaded.

`python -m pytest_profllm.load.accuracy_task` writes the file again; a test checks that doing so
gives the shipped bytes.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import yaml

TASK_DIR = Path(__file__).parent / "data" / "accuracy"
DATA_FILE = TASK_DIR / "accuracy_arithmetic.jsonl"
SEED = 41
QUESTIONS_PER_FORM = 100
CHOICES = 4
# The shipped tasks by name: what `tasks:` of a `kind: accuracy` case may name besides lm-eval's
# own task names and task YAML files.
MULTIPLE_CHOICE = "profllm_arithmetic_mc"
GENERATE = "profllm_arithmetic_gen"
SHIPPED_TASKS = (MULTIPLE_CHOICE, GENERATE)
# What guessing scores on the multiple-choice task: one right answer among four.
CHANCE = 1 / CHOICES


def _addition(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    answer = a + b
    wrong: set[int] = set()
    while len(wrong) < CHOICES - 1:  # near misses, as a careless adder would give
        guess = answer + rng.choice([-11, -10, -9, -2, -1, 1, 2, 9, 10, 11])
        if guess != answer:
            wrong.add(guess)
    return _question(rng, f"What is {a} plus {b}?", answer, sorted(wrong))


def _largest(rng: random.Random) -> dict[str, Any]:
    numbers = rng.sample(range(10, 100), CHOICES)
    listed = ", ".join(map(str, numbers))
    answer = max(numbers)
    return _question(
        rng, f"Which is largest: {listed}?", answer, [n for n in numbers if n != answer]
    )


def _question(rng: random.Random, text: str, answer: int, wrong: list[int]) -> dict[str, Any]:
    choices = [*wrong, answer]
    rng.shuffle(choices)
    return {
        "question": text,
        "choices": [str(c) for c in choices],
        "label": choices.index(answer),
        "answer": str(answer),
    }


def questions() -> list[dict[str, Any]]:
    """The shipped questions, the same on every call and every machine."""
    rng = random.Random(SEED)
    made = [_addition(rng) for _ in range(QUESTIONS_PER_FORM)]
    made += [_largest(rng) for _ in range(QUESTIONS_PER_FORM)]
    return made


def render() -> bytes:
    return b"".join(json.dumps(q, sort_keys=True).encode() + b"\n" for q in questions())


def task_config(name: str) -> dict[str, Any]:
    """One shipped task as the inline config lm-eval's TaskManager loads: its YAML, with the
    data file's name made a full path wherever the package is installed."""
    config: dict[str, Any] = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"]["data_files"] = {
        split: str(TASK_DIR / path) for split, path in files.items()
    }
    return config


def main() -> int:
    DATA_FILE.write_bytes(render())
    print(f"wrote {len(questions())} questions to {DATA_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
