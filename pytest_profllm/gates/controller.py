"""The gate where records arrive (the controller, or the only process): each run's fingerprint,
per-request samples and verdicts into the results database as it arrives, pytest-benchmark's
view of it, the new baseline where asked, and the Markdown summary at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.gates import benchmark_bridge, summary, tables
from pytest_profllm.gates.baseline import is_database
from pytest_profllm.gates.options import GateConfig


@dataclass
class GateController:
    config: pytest.Config
    gate: GateConfig
    db_path: Path | None
    engine: str
    records: list[dict[str, Any]] = field(default_factory=list)
    summary_written: list[Path] = field(default_factory=list)

    def receive(self, record: dict[str, Any], requests: list[dict[str, Any]] | None) -> None:
        self.records.append(record)
        if self.db_path is not None:
            tables.load_runs(self.db_path, [(record, requests)])
        if requests is not None:
            benchmark_bridge.add_case(self.config, record, requests)
        if self.gate.update_baseline and record.get("status") in ("passed", "failed"):
            self._write_baseline(record, requests)

    def _write_baseline(
        self, record: dict[str, Any], requests: list[dict[str, Any]] | None
    ) -> None:
        path = self.gate.baseline
        assert path is not None  # GateConfig refuses an update without a path
        if is_database(path):
            if path != self.db_path:
                from pytest_profllm.store import load_records

                load_records(path, [record])
                tables.load_runs(path, [(record, requests)])
            return
        from pytest_profllm.record import write_record, write_requests

        write_record(path, record)
        if requests is not None:
            write_requests(path, record["run_id"], requests)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.records:
            return
        baseline = str(self.gate.baseline) if self.gate.baseline else None
        text = summary.markdown(self.records, self.engine, baseline)
        self.summary_written = summary.write_markdown(text, self.gate.summary)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for path in self.summary_written:
            terminalreporter.write_line(f"profllm: Markdown summary in {path}")
        if self.gate.update_baseline and self.records:
            terminalreporter.write_line(
                f"profllm: this run is the new baseline in {self.gate.baseline}"
            )


GATE_CONTROLLER_KEY = pytest.StashKey[GateController]()
