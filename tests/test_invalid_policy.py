"""An invalid case (not a measurement of the server) apart from a failed one in what pytest
reports: counted as `invalid` in its last line, one `INVALID` line with the reason, and
`--profllm-invalid` for the status a CI job reads. The sessions run on the virtual clock, with
the judge made to call one case invalid, so nothing here depends on how busy the host is."""

from __future__ import annotations

import argparse
import sqlite3

import pytest
from helpers import run_suites

from pytest_profllm.options.parsers import InvalidPolicy, parse_invalid
from pytest_profllm.session.invalid_cases import FailureCount

# The judge calls the case of 7 prompts invalid, as a host too busy to keep its schedule would.
INVALID_SEVEN = """
import pytest_profllm.run.virtual as virtual

_judge = virtual.judge


class _Busy:
    def line(self):
        return "client fell behind: the host was busy (made so by the test)"


def _judge_seven(facts, window, rules):
    return _Busy() if facts.config.num_prompts == 7 else _judge(facts, window, rules)


virtual.judge = _judge_seven
"""

SUITE = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: [6, 7]
  random_input_len: 16
  random_output_len: 4
"""


def test_parse_invalid() -> None:
    assert parse_invalid("fail") == InvalidPolicy()
    assert parse_invalid("skip") == InvalidPolicy(skip=True)
    assert parse_invalid("exit-code:7") == InvalidPolicy(exit_status=7)
    assert str(parse_invalid("exit-code:7")) == "exit-code:7"
    for bad in ("exit-code:1", "exit-code:5", "exit-code:126", "7", "exit-code:", "pass"):
        with pytest.raises(argparse.ArgumentTypeError, match="fail, skip or exit-code:N"):
            parse_invalid(bad)


def test_exit_code_only_where_invalid_cases_were_the_only_failures() -> None:
    policy = InvalidPolicy(exit_status=7)
    assert FailureCount(invalid=2).exit_status(policy, 1) == 7
    assert FailureCount(invalid=2, other=1).exit_status(policy, 1) == 1  # a regression leads
    assert FailureCount(invalid=2).exit_status(policy, 2) == 2  # interrupted stays so
    assert FailureCount(invalid=2).exit_status(InvalidPolicy(), 1) == 1  # the default


def _run(pytester: pytest.Pytester, ports: str, suite: str, *args: str) -> pytest.RunResult:
    pytester.makeconftest(INVALID_SEVEN)
    pytester.makefile(".yaml", bench_x=suite)
    return run_suites(pytester, ports, "--profllm-sim-clock=virtual", "-p", "no:cacheprovider",
                      *args)


def test_invalid_is_counted_apart_and_exits_as_asked(
    pytester: pytest.Pytester, ports: str
) -> None:
    result = _run(pytester, ports, SUITE, "--profllm-invalid=exit-code:7")
    assert result.ret == 7
    assert result.parseoutcomes() == {"passed": 1, "invalid": 1}
    result.stdout.fnmatch_lines([
        "INVALID *bench_x.yaml::*7* - invalid measurement: client fell behind: the host was "
        "busy (made so by the test)",
    ])
    result.stdout.no_fnmatch_line("*FAILED*")


def test_a_missed_threshold_beside_an_invalid_case_exits_1(
    pytester: pytest.Pytester, ports: str
) -> None:
    missed = SUITE + "thresholds:\n  completed: {min: 7}\n"  # the 6-prompt case misses it
    result = _run(pytester, ports, missed, "--profllm-invalid=exit-code:7")
    assert result.ret == 1
    assert result.parseoutcomes() == {"failed": 1, "invalid": 1}


def test_skip_reports_an_invalid_case_skipped_and_its_record_invalid(
    pytester: pytest.Pytester, ports: str
) -> None:
    result = _run(pytester, ports, SUITE, "--profllm-invalid=skip")
    assert result.ret == 0
    assert result.parseoutcomes() == {"passed": 1, "invalid": 1}
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        statuses = db.execute(
            "select status from benchmark_runs order by status"
        ).fetchall()
    assert statuses == [("invalid",), ("passed",)]
