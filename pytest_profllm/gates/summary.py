"""The run's table as people read it: in the terminal, as Markdown (a file, and GitHub's step
summary), and as per-case properties in JUnit XML. One row per case: its key metrics, the
regression gate's decision and the change of each gated metric against the baseline."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from pytest_profllm.plan.case import printable
from pytest_profllm.results.gate_tables import decision_of, gate_of

KEY_METRICS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.2f}"),
)
STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def change_text(item: dict[str, Any]) -> str:
    """`p99_ttft_ms +18.0% [+15.1, +21.2]`, `p99_ttft_ms no baseline`, or `acc -100.0% not
    judged`."""
    if decision_of(item) == "not-judged":
        change = item.get("change")
        return f"{item['metric']} " + ("" if change is None else f"{change:+.1%} ") + (
            "not judged"
        )
    if item.get("change") is None:
        return f"{item['metric']} " + (
            "no baseline" if decision_of(item) == "no-baseline" else "-"
        )
    text = f"{item['metric']} {item['change']:+.1%}"
    if item.get("ci_low") is not None and item.get("ci_high") is not None:
        text += f" [{item['ci_low'] * 100:+.1f}, {item['ci_high'] * 100:+.1f}]"
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
    return None if kind in ("serve", "capacity", "accuracy") else f"{kind}: -"


def accuracy_figures(record: dict[str, Any]) -> str | None:
    """`acc 0.240 ± 0.043, n=100 (plumbing check)`: an accuracy case's metrics with their
    standard errors and samples (None for other kinds)."""
    accuracy = record.get("accuracy")
    if not accuracy:
        return None
    parts = []
    for metric in accuracy.get("metrics") or []:
        if metric.get("value") is None:
            continue
        spread = f" ± {metric['stderr']:.3f}" if metric.get("stderr") is not None else ""
        parts.append(f"{metric['name']} {metric['value']:.3f}{spread}")
    text = ", ".join(parts) or "-"
    if accuracy.get("samples") is not None:
        text += f", n={accuracy['samples']}"
    return text + (" (plumbing check)" if accuracy.get("plumbing_check") else "")


def capacity_figures(record: dict[str, Any]) -> str | None:
    """`24.3 req/s [24.3, 25.5] p99_ttft_ms`: a capacity case's capacity, its bracket and its
    limit (None for other kinds)."""
    if ((record.get("config") or {}).get("benchmark") or {}).get("kind") != "capacity":
        return None
    search = record.get("capacity") or {}
    unit = "req/s" if search.get("over", "request_rate") == "request_rate" else "concurrent"
    low, high = [*(search.get("bracket") or []), None, None][:2]
    if search.get("capacity") is None:
        return f"none from {high:.4g} {unit}" if high is not None else "-"
    if high is None:
        return f">= {low:.4g} {unit}"
    return f"{low:.4g} {unit} [{low:.4g}, {high:.4g}] {search.get('limit') or ''}".strip()


# Columns of text, not figures: left-aligned.
_TEXT_COLUMNS = (
    "case", "status", "capacity", "offline", "accuracy", "gate", "change vs baseline",
)


def rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and cells; the gate columns only where some case was gated, the capacity column
    (a capacity case's search), the offline column (an offline case's own figures) and the
    accuracy column (an accuracy case's metrics) only where some case has them."""
    gated = any(record.get("regression") for record in records)
    extra = {
        "capacity": [capacity_figures(record) for record in records],
        "offline": [offline_figures(record) for record in records],
        "accuracy": [accuracy_figures(record) for record in records],
    }
    extra = {name: cells for name, cells in extra.items() if any(cells)}
    header = ["case", "status"] + [name for name, _, _ in KEY_METRICS] + list(extra)
    if gated:
        header += ["gate", "change vs baseline"]
    table = []
    for index, record in enumerate(records):
        results = record.get("results") or {}
        cells = [record["case_id"], record["status"]]
        cells += [
            fmt.format(results[key]) if results.get(key) is not None else "-"
            for _, key, fmt in KEY_METRICS
        ]
        cells += [column[index] or "-" for column in extra.values()]
        if gated:
            items = record.get("regression") or []
            cells.append(gate_of(record) or "-")
            cells.append("; ".join(change_text(v) for v in items) or "-")
        table.append(cells)
    return header, table


# What gives way when the table is wider than the terminal, in order: a text column moves to
# a line of its own under each row (wrapped); a figure is left out (every figure stays in the
# record, the database and the Markdown summary).
_MOVED_BENEATH = ("change vs baseline",)
_LEFT_OUT = ("ITL p99 ms", "TPOT p50 ms", "out tok/s", "TTFT p50 ms")
_MOVED_LAST = ("offline", "accuracy", "capacity")
_INDENT = "    "


def terminal_lines(records: list[dict[str, Any]], width: int | None = None) -> list[str]:
    """The table, within `width` characters where it can be (None: as wide as it is); a
    control character of a cell (a case id's file part, a record's text) shown escaped, so
    that a cell neither acts on the terminal nor starts a line of its own."""
    header, table = rows(records)
    table = [[printable(cell) for cell in cells] for cells in table]
    # A column with no figure in any row says nothing (serve metrics of a run of capacity or
    # offline cases, say).
    shown = [
        name
        for i, name in enumerate(header)
        if name in ("case", "status") or any(cells[i] != "-" for cells in table)
    ]
    beneath: list[str] = []
    left_out: list[str] = []
    steps = [*((name, beneath) for name in _MOVED_BENEATH), *((n, left_out) for n in _LEFT_OUT),
             *((name, beneath) for name in _MOVED_LAST), ("case", beneath)]  # fmt: skip
    for name, where in steps:
        if width is None or _table_width(header, table, shown) <= width:
            break
        if name in shown:
            shown.remove(name)
            where.append(name)
    # Last of all, each case's id goes on a line of its own above its row (an id is never cut).
    stacked = "case" in beneath
    if stacked:
        beneath.remove("case")
    # What moved made room: a figure left out comes back where it fits again.
    indent = _INDENT if stacked else ""
    for name in reversed(list(left_out)):
        candidate = sorted([*shown, name], key=header.index)
        if width is not None and len(indent) + _table_width(header, table, candidate) <= width:
            shown = candidate
            left_out.remove(name)
    beneath.sort(key=header.index)
    columns = [header.index(name) for name in shown]
    widths = {i: max(len(row[i]) for row in [header, *table]) for i in columns}

    def line(cells: list[str]) -> str:
        return indent + "  ".join(
            cells[i].ljust(widths[i]) if header[i] in _TEXT_COLUMNS else cells[i].rjust(widths[i])
            for i in columns
        ).rstrip()

    lines = ["case", line(header)] if stacked else [line(header)]
    for cells in table:
        if stacked:
            lines.append(cells[0])
        lines.append(line(cells))
        for name in beneath:
            cell = cells[header.index(name)]
            if cell != "-":
                lines += _wrapped(indent + f"{name}: ", cell.split("; "), width)
    if left_out:
        note = f"(to fit {width} columns, left out: {', '.join(left_out)})"
        lines += textwrap.wrap(note, width) if width else [note]
    return lines


def _wrapped(label: str, parts: list[str], width: int | None) -> list[str]:
    """`label` and the parts (a gated metric's change each), as many to a line as fit, a part
    never split; lines after the first indented further."""
    lines = [_INDENT + label + parts[0]]
    further = " " * (len(lines[0]) - len(lines[0].lstrip()) + len(_INDENT))
    for part in parts[1:]:
        if width is not None and len(lines[-1]) + 2 + len(part) > width:
            lines[-1] += ";"
            lines.append(further + part)
        else:
            lines[-1] += "; " + part
    return lines


def _table_width(header: list[str], table: list[list[str]], shown: list[str]) -> int:
    columns = [header.index(name) for name in shown]
    cells = sum(max(len(row[i]) for row in [header, *table]) for i in columns)
    return cells + 2 * (len(columns) - 1)


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
    unjudged = not_judged(records)
    if unjudged:
        lines.append(f"Not judged ({len(unjudged)}), so neither passed nor failed by the gate: "
                     + "; ".join(unjudged) + ".")
    lines += ["", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if _numeric(name) else "---" for name in header) + "|")
    for cells in table:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def not_judged(records: list[dict[str, Any]]) -> list[str]:
    """Each gated metric that could not be judged: `case: metric (why)`."""
    return [
        f"{record['case_id']}: {item['metric']} ({item.get('reason') or 'no interval'})"
        for record in records
        for item in record.get("regression") or []
        if decision_of(item) == "not-judged"
    ]


def _numeric(column: str) -> bool:
    return column not in _TEXT_COLUMNS


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
    for item in record.get("regression") or []:
        name = f"profllm_gate_{item['metric']}"
        properties.append((name, f"{decision_of(item)}: {change_text(item)}"))
    return properties
