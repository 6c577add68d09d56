"""The run's table as people read it: in the terminal, as Markdown (a file, and GitHub's step
summary), and as per-case properties in JUnit XML. One row per case: its key metrics, the
gate's verdict and the change of each gated metric against the baseline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pytest_profllm.results.gate_tables import gate_of

KEY_METRICS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.2f}"),
)
STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def change_text(verdict: dict[str, Any]) -> str:
    """`p99_ttft_ms +18.0% [+15.1, +21.2]`, or `p99_ttft_ms no baseline`."""
    if verdict.get("change") is None:
        return f"{verdict['metric']} " + (
            "no baseline" if verdict["verdict"] == "no-baseline" else "-"
        )
    text = f"{verdict['metric']} {verdict['change']:+.1%}"
    if verdict.get("ci_low") is not None and verdict.get("ci_high") is not None:
        text += f" [{verdict['ci_low'] * 100:+.1f}, {verdict['ci_high'] * 100:+.1f}]"
    return text


def offline_figures(record: dict[str, Any]) -> str | None:
    """An offline case's own figures, in place of the serving metrics it lacks."""
    results = record.get("results") or {}
    kind = ((record.get("config") or {}).get("benchmark") or {}).get("kind", "serve")
    if kind == "throughput" and results.get("tokens_per_second") is not None:
        return (
            f"throughput: {results['tokens_per_second']:.1f} tok/s, "
            f"{results['requests_per_second']:.2f} req/s"
        )
    if kind == "latency" and results.get("avg_latency_ms") is not None:
        return (
            f"latency: avg {results['avg_latency_ms']:.1f} ms, "
            f"p99 {results['p99_latency_ms']:.1f} ms"
        )
    if kind == "capacity":
        return capacity_figures(record)
    return None if kind == "serve" else f"{kind}: -"


def capacity_figures(record: dict[str, Any]) -> str:
    """`capacity 24.3 req/s [24.3, 25.5] p99_ttft_ms`: the capacity, its bracket, its limit."""
    search = record.get("capacity") or {}
    unit = "req/s" if search.get("over", "request_rate") == "request_rate" else "concurrent"
    low, high = [*(search.get("bracket") or []), None, None][:2]
    if search.get("capacity") is None:
        return f"capacity: none from {high:.4g} {unit}" if high is not None else "capacity: -"
    if high is None:
        return f"capacity >= {low:.4g} {unit}"
    return f"capacity {low:.4g} {unit} [{low:.4g}, {high:.4g}] {search.get('limit') or ''}".strip()


def rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells; the gate columns only where some case was gated, the offline column
    (an offline or capacity case's own figures) only where some case has them."""
    gated = any(record.get("regression") for record in records)
    offline = [offline_figures(record) for record in records]
    header = ["case", "status"] + [name for name, _, _ in KEY_METRICS]
    if any(offline):
        header.append("offline")
    if gated:
        header += ["gate", "change vs baseline"]
    table = []
    for record, figures in zip(records, offline, strict=True):
        results = record.get("results") or {}
        cells = [record["case_id"], record["status"]]
        cells += [
            fmt.format(results[key]) if results.get(key) is not None else "-"
            for _, key, fmt in KEY_METRICS
        ]
        if any(offline):
            cells.append(figures or "-")
        if gated:
            verdicts = record.get("regression") or []
            cells.append(gate_of(record) or "-")
            cells.append("; ".join(change_text(v) for v in verdicts) or "-")
        table.append(cells)
    return header, table


def terminal_lines(records: list[dict[str, Any]]) -> list[str]:
    header, table = rows(records)
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    # Text columns left, figures right.
    right = {i for i, name in enumerate(header) if _numeric(name)}

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ).rstrip()

    return [line(header)] + [line(cells) for cells in table]


def markdown(records: list[dict[str, Any]], engine: str, baseline: str | None) -> str:
    header, table = rows(records)
    counts: dict[str, int] = {}
    for record in records:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    gates: dict[str, int] = {}
    for record in records:
        if (gate := gate_of(record)) is not None:
            gates[gate] = gates.get(gate, 0) + 1
    lines = ["## profllm benchmark results", ""]
    status = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    lines.append(f"{len(records)} case(s): {status}; engine {engine}.")
    if gates:
        lines.append(
            "Regression gate: "
            + ", ".join(f"{count} {name}" for name, count in sorted(gates.items()))
            + (f", against {baseline}." if baseline else ".")
            + " Changes are relative to the baseline, with the bootstrap interval in brackets."
        )
    lines += ["", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if _numeric(name) else "---" for name in header) + "|")
    for cells in table:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _numeric(column: str) -> bool:
    return column not in ("case", "status", "gate", "change vs baseline")


def write_markdown(text: str, path: Path | None, session_id: str | None = None) -> list[Path]:
    """To `path` (the latest session's) and beside it to `<stem>-<session_id>.md` (kept when
    another session writes into the same folder), and appended to $GITHUB_STEP_SUMMARY;
    returns where it went."""
    written = []
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
        if session_id:
            own = path.with_name(f"{path.stem}-{session_id}{path.suffix}")
            own.write_text(text)
            written.append(own)
    step_summary = os.environ.get(STEP_SUMMARY_ENV)
    if step_summary:
        with open(step_summary, "a") as handle:
            handle.write(text)
        written.append(Path(step_summary))
    return written


def junit_properties(record: dict[str, Any]) -> list[tuple[str, object]]:
    """Per-case properties for JUnit XML: status, key metrics, and each gated metric."""
    results = record.get("results") or {}
    properties: list[tuple[str, object]] = [
        ("profllm_case_id", record["case_id"]),
        ("profllm_run_id", record["run_id"]),
        ("profllm_status", record["status"]),
    ]
    properties += [
        (f"profllm_{key}", results[key])
        for _, key, _ in KEY_METRICS
        if results.get(key) is not None
    ]
    if (gate := gate_of(record)) is not None:
        properties.append(("profllm_gate", gate))
    for verdict in record.get("regression") or []:
        name = f"profllm_gate_{verdict['metric']}"
        properties.append((name, f"{verdict['verdict']}: {change_text(verdict)}"))
    return properties
