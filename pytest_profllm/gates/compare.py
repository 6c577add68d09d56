"""Two results, each a database or a folder of records, case by case (`profllm compare A B`):
the cases matched by fingerprint, each side's latest session of a case (all its repeats) taken
as the gate takes a baseline, and each metric judged by the regression gate itself
(`judge_regression`, on the same samples: per-request latencies, per-repeat throughputs), A as
the baseline and B as the new run. Only valid measurements are read, as for a baseline."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_profllm.gates.baseline import Baseline
from pytest_profllm.gates.regression import GateSettings, judge_regression, values_of
from pytest_profllm.gates.samples import RunSamples
from pytest_profllm.plan.regression import default_tolerance, gated_metric

# What is compared where no metric is named: the latencies by their requests (judged from one
# run), the throughputs by their repeats (judged from two or more), a capacity by its brackets.
DEFAULT_METRICS = (
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput", "capacity",
)
# A side's case with no valid run on the other side: the row's decision.
ONLY_IN_A = "only-in-A"
ONLY_IN_B = "only-in-B"
# A repeat's case id ends in -rN (plan/case.py): the compared case is all its repeats.
_REPEAT_SUFFIX = re.compile(r"-r\d+$")


@dataclass(frozen=True)
class Row:
    """One metric of one case, B against A; a case on one side only is one row without a
    metric."""

    case_id: str
    fingerprint: str
    metric: str | None
    decision: str  # the gate's (improved, unchanged, regressed, not-judged), or only-in-A/B
    a: float | None = None
    b: float | None = None
    change: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    tolerance: float | None = None
    reason: str | None = None
    a_samples: int = 0
    b_samples: int = 0

    def as_json(self) -> dict[str, Any]:
        return {key: _finite(value) for key, value in self.__dict__.items()}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def compare(
    a: Path,
    b: Path,
    metrics: list[str] | None = None,
    with_version: bool = True,
    settings: GateSettings | None = None,
) -> list[Row]:
    """Every case of A or B, by case id then fingerprint. Raises ValueError for a metric that
    cannot be gated (its message lists those that can), or for a file that cannot be read."""
    names = metrics or list(DEFAULT_METRICS)
    gated = [gated_metric(name, default_tolerance(name)) for name in names]
    settings = settings or GateSettings()
    side_a = _cases(Baseline(a, with_version))
    side_b = _cases(Baseline(b, with_version))
    rows: list[Row] = []
    for key in sorted(side_a.keys() | side_b.keys(),
                      key=lambda k: ((side_b.get(k) or side_a[k])[0], k)):
        if key not in side_b:
            rows.append(Row(side_a[key][0], key, None, ONLY_IN_A))
            continue
        case_id, new = side_b[key]
        if key not in side_a:
            rows.append(Row(case_id, key, None, ONLY_IN_B))
            continue
        compared = _case_rows(case_id, key, side_a[key][1], new, gated, settings)
        # A case none of the metrics applies to (a pooling model has no TTFT) is said so.
        rows += compared or [Row(case_id, key, None, "not-judged",
                                 reason="it measures none of the metrics compared: see --metric")]
    return rows


def _cases(side: Baseline) -> dict[str, tuple[str, list[RunSamples]]]:
    return {
        key: (_REPEAT_SUFFIX.sub("", case_id) if len(runs) > 1 else case_id, runs)
        for key, (case_id, runs) in side.latest().items()
    }


def _case_rows(
    case_id: str, key: str, old: list[RunSamples], new: list[RunSamples], gated: list[Any],
    settings: GateSettings,
) -> list[Row]:
    rows = []
    for metric in gated:
        if not values_of(metric, new).size and not values_of(metric, old).size:
            continue  # a metric this case does not measure (a capacity of a paced case)
        judged = judge_regression(metric, new, old, settings)
        rows.append(Row(
            case_id, key, metric.name, judged.decision, judged.baseline, judged.value,
            judged.change, judged.ci_low, judged.ci_high, metric.tolerance, judged.reason,
            judged.baseline_samples, judged.samples,
        ))
    return rows


def table(rows: list[Row]) -> list[str]:
    """The rows as an aligned text table, and a last line counting the decisions."""
    header = ("case", "metric", "A", "B", "change", "interval", "decision")
    body = [header] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
             .rstrip() for line in body]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.decision] = counts.get(row.decision, 0) + 1
    cases = len({row.fingerprint for row in rows})
    summary = ", ".join(f"{count} {decision}" for decision, count in sorted(counts.items()))
    lines.append(f"{cases} case(s), {len(rows)} row(s): {summary or 'nothing to compare'}")
    return lines


def _cells(row: Row) -> tuple[str, str, str, str, str, str, str]:
    decision = row.decision + (f" ({row.reason})" if row.reason else "")
    interval = ""
    if row.ci_low is not None and row.ci_high is not None:
        interval = f"[{row.ci_low:+.1%}, {row.ci_high:+.1%}]"
    return (
        row.case_id, row.metric or "", _number(row.a), _number(row.b),
        "" if row.change is None else f"{row.change:+.1%}", interval, decision,
    )


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
