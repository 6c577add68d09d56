"""A failed case in pytest's short summary (`-rA`, `-rf`): the first line of its failure is
what the summary keeps, so it names the metric, its value and the bound."""

from __future__ import annotations

import re

import pytest
from helpers import run_records, run_suites

from pytest_profllm.gates.summary import terminal_lines
from pytest_profllm.plan.case import printable

WORKLOAD = "{num_prompts: 2, random_input_len: 8, random_output_len: 4}"


def test_short_summary_keeps_the_metric_and_the_bound(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # pytest's width where it cannot ask a terminal
    pytester.makefile(
        ".yaml",
        bench_gate=f"server: {{model: m}}\nbenchmark: {WORKLOAD}\n"
        "thresholds:\n  completed: {min: 100}\n",
    )
    pytester.makepyfile(
        test_gate=f"""
        import pytest

        @pytest.mark.profllm(
            server={{"model": "m"}},
            benchmark={WORKLOAD.replace("{", "dict(").replace("}", ")").replace(":", "=")},
            thresholds={{"completed": {{"min": 100}}}},
        )
        def test_gate(profllm_result):
            pass
        """
    )
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-max-schedule-lag=1000",
        "-rA",
        "-p",
        "no:xdist",
        timeout=300,
    )
    result.assert_outcomes(failed=2)
    # In 80 columns the summary line still holds the metric, its value and the bound.
    result.stdout.fnmatch_lines(
        [
            "*short test summary info*",
            "FAILED bench_gate.yaml::m::random - completed = 2 < min 100*",
            "FAILED test_gate.py::test_gate[[]m/random[]] - Failed: completed = 2 < min 100*",
        ]
    )


# A suite file named with a screen clear, a window title and a newline that starts a line of
# its own: pytest's lines, the failure's heading, the summary table and the short summary
# drew the escapes raw, and the newline forged a FAILED line.
HOSTILE = "bench_a\x1b[2J\x1b]0;pwned\x07\nFAILED forged.yaml"
SHOWN = "bench_a\\x1b[2J\\x1b]0;pwned\\x07\\x0aFAILED forged.yaml"


def test_a_suite_files_control_characters_reach_the_terminal_escaped(
    pytester: pytest.Pytester, ports: str
) -> None:
    (pytester.path / HOSTILE).write_text(
        f"server: {{model: m}}\nbenchmark: {WORKLOAD}\nthresholds:\n  completed: {{min: 100}}\n")
    result = run_suites(pytester, ports, "-rf", "-p", "no:xdist", gpus=None)
    result.assert_outcomes(failed=1)
    output = "\n".join(result.outlines + result.errlines)
    assert "\x1b[2J" not in output and "\x1b]0;" not in output and "\x07" not in output
    assert not [line for line in result.outlines if line.startswith("FAILED forged")]
    case = f"{SHOWN}::m::random"
    table = result.outlines[result.outlines.index(next(
        line for line in result.outlines if "profllm benchmark results" in line)):]
    assert [line for line in table if line.startswith(case)]  # the summary table's row
    assert [line for line in result.outlines if line.startswith(f"FAILED {case} - ")]
    # The records carry the case id as the terminal showed it.
    (record,) = run_records(pytester)
    assert record["case_id"] == case and record["suite"] == SHOWN.removeprefix(
        "bench_").removesuffix(".yaml")


def test_the_summary_table_escapes_what_its_records_say() -> None:
    # A record from elsewhere (resumed, or written before node ids were escaped) whose case
    # id holds a newline: one row per record still, no control character drawn.
    records = [{"case_id": "bench_a\nFAILED forged.yaml::m::random\x1b[2J", "status": "failed",
                "results": {"request_throughput": 1.0}},
               {"case_id": "bench_b.yaml::m::random", "status": "passed", "results": {}}]
    for width in (None, 200, 40):
        lines = terminal_lines(records, width)
        assert not [line for line in lines if re.search(r"[\x00-\x1f\x7f-\x9f]", line)]
        assert not [line for line in lines if line.startswith("FAILED")]
        assert [line for line in lines if "bench_a\\x0aFAILED forged.yaml::m::random\\x1b[2J"
                in line]
    assert printable("a\x1b\x9b\x7f\n\tb", keep="\n") == "a\\x1b\\x9b\\x7f\n\\x09b"
