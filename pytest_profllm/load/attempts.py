"""Measuring again instead of giving up: a load that the host made invalid (the client fell
behind its schedule, or the simulated engine behind its own clock) runs again, up to
`--profllm-remeasure` more times. Every attempt is kept for the record; the figures and the
verdicts are those of the first valid one, and where none is valid the case is invalid with
every attempt's reasons.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pytest_profllm.load.prometheus_counters import REQUEST_TOTALS
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.validity import Invalid, InvalidKind, texts


@dataclass
class Attempts:
    remeasure: int  # how many more runs the host's faults may cost
    # The session's time for runs again, shared by its cases; a case's own by default.
    budget: RemeasureBudget = field(default_factory=RemeasureBudget)
    kept: list[dict[str, Any]] = field(default_factory=list)
    stopped: Invalid | None = None  # why no more runs were made though the host's faults asked

    def add(
        self,
        started_at: float,
        reasons: list[Invalid],
        results: dict[str, Any],
        telemetry: dict[str, Any],
        prefix_cache: str | None,
    ) -> None:
        duration_s = time.time() - started_at
        self.budget.spent(duration_s, again=bool(self.kept))
        self.kept.append({
            "attempt": len(self.kept) + 1,
            "started_at": started_at,
            "duration_s": duration_s,
            "validity": "invalid" if reasons else "valid",
            "reasons": texts(reasons),
            "reason_kinds": [reason.kind.value for reason in reasons],
            "prefix_cache": prefix_cache,
            # What this attempt sent, kept or not: the client's Prometheus counters
            # (--profllm-metrics-port) count every attempt, and these add up to them.
            **{key: results.get(key) for key in REQUEST_TOTALS},
            "request_throughput": results.get("request_throughput"),
            "output_throughput": results.get("output_throughput"),
            "median_ttft_ms": results.get("median_ttft_ms"),
            "p99_schedule_lag_ms": results.get("p99_schedule_lag_ms"),
            "sim_step_lateness_p99_ms": telemetry.get("sim_step_lateness_p99_ms"),
            "client_overhead_ttft_ms": results.get("client_overhead_ttft_ms"),
        })

    def again(self, reasons: list[Invalid]) -> bool:
        """Whether to run the load once more: the last attempt is invalid for the host's sake
        alone (a server that miscounted tokens would do it again), and runs are left, in the
        case's count and in the session's time for runs again."""
        wanted = (
            bool(reasons)
            and all(reason.host_caused for reason in reasons)
            and len(self.kept) <= self.remeasure
        )
        if wanted and not self.budget.allows():
            self.stopped = Invalid(InvalidKind.BUDGET_SPENT, self.budget.exhausted_reason())
            return False
        return wanted

    def host_reasons(self, reasons: list[Invalid]) -> list[Invalid]:
        """The host's part of the last attempt's reasons, with the spent budget where it
        stopped the runs again."""
        return [reason for reason in reasons if reason.host_caused] + (
            [self.stopped] if self.stopped else [])

    def invalid_reason(self, reasons: list[Invalid]) -> str | None:
        """The case's reason to be invalid: the last attempt's, and where there were several,
        every attempt's, each named."""
        if not reasons:
            return None
        stopped = [self.stopped.text] if self.stopped else []
        if len(self.kept) <= 1:
            return "; ".join([*texts(reasons), *stopped])
        return "; ".join([
            *(f"attempt {kept['attempt']}: {'; '.join(kept['reasons'])}" for kept in self.kept),
            *stopped,
        ])
