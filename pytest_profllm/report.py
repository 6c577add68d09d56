"""The terminal summary: one line per case with the figures people look at first."""

from __future__ import annotations

from pytest_profllm.session import ControllerSession

_COLUMNS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50 ms", "median_ttft_ms", "{:.1f}"),
    ("TPOT p50 ms", "median_tpot_ms", "{:.2f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.2f}"),
)


def summary_lines(controller: ControllerSession) -> list[str]:
    records = controller.records
    width = max(len(record["case_id"]) for record in records)
    header = f"{'case':<{width}}  {'status':<7}" + "".join(f"{name:>13}" for name, _, _ in _COLUMNS)
    lines = [header]
    for record in records:
        results = record.get("results") or {}
        cells = "".join(
            f"{(fmt.format(results[key]) if results.get(key) is not None else '-'):>13}"
            for _, key, fmt in _COLUMNS
        )
        lines.append(f"{record['case_id']:<{width}}  {record['status']:<7}{cells}")
    engine = controller.identity.engine
    lines.append(f"engine: {engine.name} ({engine.reason})")
    settings = controller.settings
    if settings.out_dir is not None:
        lines.append(f"{len(records)} record(s) in {settings.out_dir}")
    if settings.db_path is not None and controller.loaded_rows is not None:
        lines.append(
            f"{controller.loaded_rows} row(s) loaded into {settings.db_path} "
            f"(table benchmark_runs); browse with: datasette {settings.db_path}"
        )
    return lines
