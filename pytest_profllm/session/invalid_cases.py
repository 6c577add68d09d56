"""Invalid cases apart from failed ones, in what pytest reports: a case that is not a measurement
of the server (docs/how-a-case-is-measured.md) is no missed threshold and no regression, and a
CI job must be able to tell the two apart.

Its call report carries `profllm_invalid` (kept through xdist's report transport); pytest's
last line counts such reports as `invalid`, and each gets one `INVALID` line with its reason.
`--profllm-invalid` says whether the case fails or is skipped, and with `exit-code:N` the
session's status where invalid cases were its only failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pytest_profllm.options.parsers import InvalidPolicy

CATEGORY = "invalid"  # pytest's last line: `2 invalid`
ATTRIBUTE = "profllm_invalid"  # on the call report of an invalid case
PREFIX = "invalid measurement: "
_INVALID = pytest.StashKey[bool]()


def end_invalid(item: pytest.Item, policy: InvalidPolicy, reason: str) -> None:
    """Ends the test of an invalid case as the policy says; marks it for its report."""
    item.stash[_INVALID] = True
    if policy.skip:
        pytest.skip(PREFIX + reason)
    pytest.fail(PREFIX + reason, pytrace=False)


def mark_report(item: pytest.Item, report: pytest.TestReport) -> None:
    """Marks the call report of a case `end_invalid` ended."""
    if report.when == "call" and item.stash.get(_INVALID, False):
        setattr(report, ATTRIBUTE, True)


def is_invalid(report: Any) -> bool:
    return bool(getattr(report, ATTRIBUTE, False)) and (report.failed or report.skipped)


def teststatus(report: Any) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    """pytest's category, letter and word for an invalid case's call report."""
    if report.when == "call" and is_invalid(report):
        return CATEGORY, "I", ("INVALID", {"yellow": True})
    return None


def reason_of(report: Any) -> str:
    """The `invalid measurement: ...` text of an invalid case's report."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        text = str(longrepr[2]).removeprefix("Skipped: ")
    else:
        text = str(longrepr)
    return " ".join(text.split())


@dataclass
class FailureCount:
    """The session's failed reports, invalid cases apart; counted where the reports arrive (the
    xdist controller, or the one process)."""

    invalid: int = 0
    other: int = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if is_invalid(report) and report.failed:
            self.invalid += 1
        elif report.failed:
            self.other += 1

    def exit_status(self, policy: InvalidPolicy, status: int) -> int:
        """The session's status: `exit-code:N`'s N where it failed for invalid cases only."""
        only_invalid = self.invalid > 0 and self.other == 0
        if policy.exit_status is not None and status == pytest.ExitCode.TESTS_FAILED \
                and only_invalid:
            return policy.exit_status
        return status
