"""A failed case in pytest's short summary (`-rA`, `-rf`): the first line of its failure is
what the summary keeps, so it names the metric, its value and the bound."""

from __future__ import annotations

import pytest

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
