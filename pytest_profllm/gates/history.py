"""Change points in a fingerprint's history: the session after which a metric shifted.

Detection is ruptures' PELT over the per-session means (a session's repeats averaged), with the
least-squares cost (a shift of the mean) and a BIC-style penalty, 3 sigma^2 log(n), where sigma
is the noise estimated from successive differences (robust to the shift itself). A change is
reported when the means on both sides differ by at least `min_change` (relative), so a real but
tiny shift does not read as a regression. Apache Otava's E-divisive means would be the other
choice; its 0.8.0 pins numpy 2.2.0 exactly and brings BigQuery, Postgres and Slack clients,
which a pytest plugin cannot impose on its users.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pytest_profllm.hosts.files import read_only_uri
from pytest_profllm.results import gate_tables as tables

MIN_SEGMENT = 2  # sessions on each side of a change
DEFAULT_MIN_CHANGE = 0.05


@dataclass(frozen=True)
class Point:
    key: str  # what orders the history (a session id starts with its UTC time)
    value: float
    run_id: str = ""
    timestamp: str = ""


@dataclass(frozen=True)
class ChangePoint:
    index: int  # the first point after the change
    point: Point
    before: float
    after: float

    @property
    def change(self) -> float:
        return self.after / self.before - 1 if self.before else math.inf


def session_means(points: Iterable[Point]) -> list[Point]:
    """One point per key (session), its values averaged, in key order; its first run named."""
    grouped: dict[str, list[Point]] = {}
    for point in points:
        if math.isfinite(point.value):
            grouped.setdefault(point.key, []).append(point)
    out = []
    for key in sorted(grouped):
        group = sorted(grouped[key], key=lambda p: p.timestamp)
        mean = float(np.mean([p.value for p in group]))
        out.append(Point(key, mean, group[0].run_id, group[0].timestamp))
    return out


def change_points(points: list[Point], min_change: float = DEFAULT_MIN_CHANGE) -> list[ChangePoint]:
    """Where the mean of `points` (in order) shifts by at least `min_change`."""
    # Deferred: ruptures takes about 2 s to import; only a history needs it.
    import ruptures

    values = np.asarray([p.value for p in points], dtype=float)
    if len(values) < 2 * MIN_SEGMENT:
        return []
    scale = float(np.median(np.abs(values))) or 1.0
    signal = values / scale
    sigma = float(np.median(np.abs(np.diff(signal)))) / (0.6745 * math.sqrt(2))
    sigma = max(sigma, 1e-3)  # identical values: a floor, so a real step still shows
    penalty = 3 * sigma**2 * math.log(len(signal))
    ends = ruptures.Pelt(model="l2", min_size=MIN_SEGMENT, jump=1).fit(signal).predict(pen=penalty)
    found = []
    bounds = [0, *ends]
    for start, cut, end in zip(bounds, bounds[1:], bounds[2:], strict=False):
        before = float(values[start:cut].mean())
        after = float(values[cut:end].mean())
        point = ChangePoint(cut, points[cut], before, after)
        if abs(point.change) >= min_change:
            found.append(point)
    return found


@dataclass(frozen=True)
class Finding:
    fingerprint: str
    case_id: str
    metric: str
    sessions: int
    change: ChangePoint


def analyse(
    db_path: Path,
    metric: str,
    case: str | None = None,
    min_change: float = DEFAULT_MIN_CHANGE,
    any_version: bool = False,
) -> tuple[int, list[Finding]]:
    """Every fingerprint's history of `metric` in a results database (the gate's tables);
    returns how many histories were looked at and the change points found."""
    column = "fingerprint_any_version" if any_version else "fingerprint"
    parameters: list[str] = [metric]
    histories: dict[str, tuple[str, list[Point]]] = {}
    with closing(sqlite3.connect(read_only_uri(db_path), uri=True, timeout=30)) as db:
        try:
            exists = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (tables.RUNS,)
            ).fetchone()
        except sqlite3.DatabaseError as error:
            raise ValueError(f"{db_path}: not a results database ({error})") from None
        if not exists:
            raise ValueError(f"{db_path} has no {tables.RUNS} table (no gated run was loaded)")
        # A history is made of valid measurements only (record.py's `validity`).
        query = (
            f"SELECT {column}, case_id, session_id, run_id, timestamp, "
            f"json_extract(results, '$.' || ?) FROM [{tables.RUNS}] "
            f"WHERE {tables.valid_runs(db)}"
        )
        if case is not None:
            query += " AND case_id LIKE ?"
            parameters.append(case)
        for digest, case_id, session, run_id, timestamp, value in db.execute(query, parameters):
            if value is None:
                continue
            _, points = histories.setdefault(digest, (case_id, []))
            points.append(Point(session or "", float(value), run_id, timestamp or ""))
    findings = []
    for digest, (case_id, points) in histories.items():
        means = session_means(points)
        for change in change_points(means, min_change):
            findings.append(Finding(digest, case_id, metric, len(means), change))
    return len(histories), findings


def save(db_path: Path, findings: list[Finding]) -> None:
    """Into the `change_points` table (replacing what an earlier analysis found there)."""
    now = datetime.now(UTC).isoformat()
    with tables.writing(db_path) as db:
        for metric in {finding.metric for finding in findings}:
            db.execute(f"DELETE FROM [{tables.CHANGE_POINTS}] WHERE metric = ?", (metric,))
        db.executemany(
            f"INSERT OR REPLACE INTO [{tables.CHANGE_POINTS}] VALUES (?,?,?,?,?,?,?,?,?,?)",
            [
                (
                    f.fingerprint,
                    f.case_id,
                    f.metric,
                    f.change.point.run_id,
                    f.change.point.key,
                    f.change.point.timestamp,
                    f.change.before,
                    f.change.after,
                    f.change.change,
                    now,
                )
                for f in findings
            ],
        )
