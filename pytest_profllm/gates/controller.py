"""The gate where records arrive (the controller, or the only process): pytest-benchmark's view
of each run as it arrives, the new baseline where asked, and at the end each run's fingerprint,
per-request samples and verdicts into the results database (with the records, never before
them: a locked or full database costs the load, not the session) and the Markdown summary."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.gates import benchmark_bridge, earlier, summary
from pytest_profllm.gates.baseline import is_database
from pytest_profllm.gates.config import GateConfig
from pytest_profllm.results.record import is_valid
from pytest_profllm.results.record_files import write_record, write_requests
from pytest_profllm.results.store import load_records


@dataclass
class GateController:
    config: pytest.Config
    gate: GateConfig
    db_path: Path | None
    engine: str
    records: list[dict[str, Any]] = field(default_factory=list)
    summary_written: list[Path] = field(default_factory=list)
    # What could not be written (a full disk, a locked database): one line each, at the end.
    problems: list[str] = field(default_factory=list)
    # What the results database's earlier sessions say (gates/earlier.py): warnings only.
    history_warnings: list[str] = field(default_factory=list)
    _runs: list[tuple[dict[str, Any], list[dict[str, Any]] | None]] = field(
        default_factory=list
    )
    # Cases the gate was asked to judge, verdicts or none (a metric none of them measures).
    asked: int = 0

    @property
    def gated(self) -> list[dict[str, Any]]:
        """The records of cases the gate judged (the last repeat of a `regression:` case)."""
        return [record for record in self.records if record.get("regression")]

    @property
    def without_baseline(self) -> list[dict[str, Any]]:
        return [
            record
            for record in self.gated
            if all(v["decision"] == "no-baseline" for v in record["regression"])
        ]

    def gated_nothing(self) -> str | None:
        """A --profllm-baseline that matched no run of this session is an error, never green
        (except while --profllm-baseline-update makes it)."""
        gated, missing = self.gated, self.without_baseline
        if self.gate.baseline is None or self.gate.update_baseline:
            return None
        if not gated:
            if not self.asked:
                return None
            return (
                f"--profllm-baseline {self.gate.baseline}: nothing was compared: none of "
                f"this session's {self.asked} gated case(s) measures a metric its "
                "regression: block names (gate the names its record's results show)"
            )
        if len(missing) < len(gated):
            return None
        return (
            f"--profllm-baseline {self.gate.baseline} matches no run of this session's "
            f"{len(gated)} gated case(s): nothing was compared (another engine, version or "
            "configuration? --profllm-baseline-any-version leaves the version out)"
        )

    def receive(
        self,
        record: dict[str, Any],
        requests: list[dict[str, Any]] | None,
        asked: bool = False,
    ) -> None:
        self.records.append(record)
        self.asked += asked or bool(record.get("regression"))
        self._runs.append((record, requests))
        if requests is not None:
            benchmark_bridge.add_case(self.config, record, requests)
        # A baseline is made of valid measurements only (record.py's `validity`).
        if self.gate.update_baseline and is_valid(record):
            try:
                self._write_baseline(record, requests)
            except (sqlite3.Error, OSError) as error:
                self.problems.append(
                    f"baseline {self.gate.baseline}: {record['case_id']} not written: "
                    f"{getattr(error, 'strerror', None) or error}"
                )

    def _write_baseline(
        self, record: dict[str, Any], requests: list[dict[str, Any]] | None
    ) -> None:
        path = self.gate.baseline
        assert path is not None  # GateConfig refuses an update without a path
        if is_database(path):
            if path != self.db_path:
                load_records(path, [record], requests={record["run_id"]: requests})
            return

        write_record(path, record)
        if requests is not None:
            write_requests(path, record["run_id"], requests)

    def finish(self) -> None:
        """The Markdown summary. Called once the records are loaded (the session's load
        writes the gate's tables, in the records' transaction)."""
        if not self.records:
            return
        self.history_warnings = self._history_warnings()
        baseline = str(self.gate.baseline) if self.gate.baseline else None
        text = summary.markdown(self.records, self.engine, baseline)
        text += _warnings_markdown(self.history_warnings)
        try:
            session = self.records[0].get("session_id")
            self.summary_written = summary.write_markdown(text, self.gate.summary, session)
        except OSError as error:
            self.problems.append(f"Markdown summary not written: {error.strerror or error}")

    def _history_warnings(self) -> list[str]:
        if self.gate.update_baseline:
            sources = [path for path in (self.db_path, self.gate.baseline) if path is not None]
            return earlier.slower_than_history(
                [path for path in sources if is_database(path)],
                self._runs,
                self.gate.with_version,
                self.gate.settings,
            )
        if self.gate.baseline is None and self.db_path is not None and self.gated:
            line = earlier.ungated_history(self.db_path, self.gated, self.gate.with_version)
            return [line] if line else []
        return []

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for line in self.history_warnings:
            terminalreporter.write_line(f"profllm: {line}", yellow=True)
        if self.summary_written:
            # One line: the latest session's file, then its own copy and the step summary.
            first, *also = self.summary_written
            names = [path.name if path.parent == first.parent else str(path) for path in also]
            beside = f" (also {', '.join(names)})" if also else ""
            terminalreporter.write_line(f"profllm: Markdown summary in {first}{beside}")
        unjudged = summary.not_judged(self.records)
        if unjudged:
            terminalreporter.write_line(
                f"profllm: not judged ({len(unjudged)}): {'; '.join(unjudged)}", yellow=True
            )
        missing, gated = len(self.without_baseline), len(self.gated)
        if self.gate.baseline is not None and missing and not self.gate.update_baseline:
            terminalreporter.write_line(
                f"profllm: no baseline for {missing} of {gated} gated case(s)", yellow=True
            )
        if (problem := self.gated_nothing()) is not None:
            terminalreporter.write_line(f"profllm: {problem}", red=True, bold=True)
        for problem in self.problems:
            terminalreporter.write_line(f"profllm: {problem}", red=True, bold=True)
        if self.gate.update_baseline and self.records:
            terminalreporter.write_line(
                f"profllm: this run is the new baseline in {self.gate.baseline}"
            )


def _warnings_markdown(lines: list[str]) -> str:
    return "".join(f"\n> **Warning:** {line}\n" for line in lines)


GATE_CONTROLLER_KEY = pytest.StashKey[GateController]()
