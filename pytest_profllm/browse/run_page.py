"""A run's page, `/{database}/-/run/{run_id}`: its verdicts and why, its configuration (the
arguments that differ from vLLM's defaults first), its workload and headline metrics, the
distributions of its per-request latencies, its telemetry over time, and its files.

`run_page` reads it all from a sqlite3 connection (tested without a browser). A capacity
search's part is browse/run_capacity.py; the run's files, found in the results folder and
nowhere else, browse/run_files.py.
"""

from __future__ import annotations

import json
import math
import shlex
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_profllm.browse import charts, request_timeline
from pytest_profllm.browse.run_capacity import capacity_section
from pytest_profllm.browse.run_values import shown, stored_json
from pytest_profllm.browse.time_breakdown import breakdown, server_table
from pytest_profllm.engine.registry import RegistryError, bundled
from pytest_profllm.results.gate_tables import RUNS, SAMPLES, SERIES, SERIES_COLUMNS, VERDICTS
from pytest_profllm.results.table import TABLE

# The headline figures, with their units, in the order a reader wants them.
HEADLINES = (
    ("capacity", "capacity (the highest load that met every SLO)", ""),
    ("request_throughput", "request throughput", "req/s"),
    ("output_throughput", "output throughput", "tok/s"),
    ("total_token_throughput", "total token throughput", "tok/s"),
    ("median_ttft_ms", "median TTFT", "ms"),
    ("p99_ttft_ms", "p99 TTFT", "ms"),
    ("median_tpot_ms", "median TPOT", "ms"),
    ("p99_tpot_ms", "p99 TPOT", "ms"),
    # Speculative decoding beside the TPOT it explains (load/spec_decode.py): null, and so not
    # shown, where the server did not speculate.
    ("system_server_spec_decode_mean_acceptance_length", "mean acceptance length", "tok/draft"),
    ("system_server_spec_decode_acceptance_rate", "draft acceptance rate", "%"),
    ("system_server_spec_decode_acceptance_rate_per_position",
     "acceptance rate by draft position (1st · 2nd · ...)", "%"),
    ("median_itl_ms", "median ITL", "ms"),
    ("p99_itl_ms", "p99 ITL", "ms"),
    ("median_e2el_ms", "median E2EL", "ms"),
    ("p99_e2el_ms", "p99 E2EL", "ms"),
    ("completed", "requests completed", ""),
    ("failed", "requests failed", ""),
    ("duration", "benchmark duration", "s"),
    ("tokens_per_second", "offline throughput", "tok/s"),
    ("avg_latency_ms", "offline batch latency", "ms"),
    # What the output cost: NVML's energy counters (null without a GPU), and the price of the
    # GPU-seconds (with --profllm-gpu-hour-price; its price is in the label, `_priced`).
    ("system_gpu_energy_j_per_output_token", "GPU energy per output token", "J/tok"),
    ("system_gpu_energy_j", "GPU energy over the load", "J"),
    ("system_mean_gpu_power_from_energy_w", "mean GPU power (energy counter)", "W"),
    ("cost_usd_per_million_output_tokens", "cost per million output tokens", "USD"),
)
DISTRIBUTIONS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                 ("e2el_ms", "E2EL"))
PERCENTILES = (50, 90, 99)
BINS = 40
# Values of these arguments say nothing about the configuration (and some are secrets,
# already redacted in the record): never listed as a difference from the defaults.
_NOT_CONFIGURATION = {"api_key", "port", "host"}


@dataclass
class RunPage:
    run_id: str
    row: dict[str, Any]
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    gate: list[dict[str, Any]] = field(default_factory=list)
    baseline_runs: list[str] = field(default_factory=list)
    validity_reasons: list[str] = field(default_factory=list)
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)  # name, value, default
    configuration: list[tuple[str, Any]] = field(default_factory=list)
    workload: list[tuple[str, Any]] = field(default_factory=list)
    headlines: list[tuple[str, str, str]] = field(default_factory=list)  # label, value, unit
    system: list[tuple[str, Any]] = field(default_factory=list)
    charts: dict[str, dict[str, Any]] = field(default_factory=dict)
    captions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # A capacity case's search (record `capacity`): its summary line and one row per probe.
    capacity: str | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)
    # An accuracy case's evaluation (record `accuracy`): what lm-eval scored, and how.
    accuracy: str | None = None
    plumbing_check: bool = False
    # A timed trace's prefix-cache hit rate, the ideal it implies beside the server's.
    prefix_cache: str | None = None
    # A load sent in rounds (record `until`): what ended it, the interval and what it took.
    until: str | None = None
    # The server's own histograms over the load (browse/time_breakdown.py), and why some or
    # all are missing.
    server_view: list[dict[str, str]] = field(default_factory=list)
    server_view_problem: str | None = None
    # Each request's time, from its server span (browse/request_timeline.py): the timeline is
    # the chart `requests-timeline`; the note says why there is none.
    timeline_note: str | None = None
    # What the session's trace receiver counted during the load (record
    # `server_view.span_receiver`), in one sentence; None where requests were not traced.
    span_counts: str | None = None
    slowest: list[request_timeline.Slowest] = field(default_factory=list)
    # A LoRA adapter mix (record `by_adapter`): one row per model, its figures shown.
    adapters: list[dict[str, str]] = field(default_factory=list)

    def add(self, chart_id: str, spec: dict[str, Any], caption: str) -> None:
        self.charts[chart_id] = spec
        self.captions[chart_id] = caption

    def section(self, prefix: str) -> list[tuple[str, str]]:
        """The charts (id, caption) of one section of the page."""
        return [(key, caption) for key, caption in self.captions.items()
                if key.startswith(prefix)]


def rerun_command(run_id: str, database: Path | None) -> str:
    """The `profllm rerun` command that reproduces a run (cli/rerun.py), as the page shows it,
    to be run where pytest ran: its database as Datasette was given it where that was a
    relative path (`datasette results/results.db` from there), else by its output folder's
    name and its file name (`results/results.db`: a page may be public, so never the server's
    folders above it); the records are beside it."""
    if database is None:
        named = "results/results.db"  # --profllm-out results/, as the README runs it
    elif not database.is_absolute() and ".." not in database.parts:
        named = database.as_posix()
    else:
        named = (Path(database.parent.name) / database.name).as_posix()
    return f"profllm rerun {shlex.quote(run_id)} --db {shlex.quote(named)}"


def _exists(connection: sqlite3.Connection, table: str) -> bool:
    return connection.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                              (table,)).fetchone() is not None


def _headline(value: Any, unit: str = "") -> str:
    """A headline figure as shown; a rate whose unit is `%` as a percentage (one place); a
    list of rates (JSON text in its column: the acceptance rate by draft position) as its
    percentages, whole, in order."""
    if isinstance(value, str) and value.startswith("["):
        numbers = stored_json(value, None)
        if isinstance(numbers, list) and all(isinstance(n, int | float) for n in numbers):
            if unit == "%":
                return " · ".join(f"{100 * n:.0f}" for n in numbers)
            return " · ".join(f"{n:.2f}" for n in numbers)
    if unit == "%" and isinstance(value, int | float) and math.isfinite(value):
        return f"{100 * value:.1f}"
    return shown(value)


def run_page(connection: sqlite3.Connection, run_id: str) -> RunPage | None:
    """Everything the page shows, or None where there is no such run."""
    cursor = connection.execute(f"SELECT * FROM [{TABLE}] WHERE run_id = ?", (run_id,))
    found = cursor.fetchone()
    if found is None:
        return None
    row = dict(zip((d[0] for d in cursor.description), found, strict=True))
    page = RunPage(run_id, row)
    page.verdicts = stored_json(row.get("verdicts"), [])
    page.validity_reasons = stored_json(row.get("validity_reasons"), [])
    _gate(connection, page)
    _configuration(page)
    page.workload = [(name.removeprefix("bench_"), shown(value)) for name, value in row.items()
                     if name.startswith("bench_") and value not in (None, "", "[]", "{}")]
    page.headlines = [(_priced(label, row), _headline(row[name], unit), unit)
                      for name, label, unit in HEADLINES if row.get(name) is not None]
    page.system = [(name, shown(value)) for name, value in row.items()
                   if name.startswith(("system_", "runtime_", "cost_"))
                   and value not in (None, "", "[]")]
    capacity_section(page)
    _accuracy(page)
    page.prefix_cache = prefix_cache_line(row)
    page.adapters = adapter_rows(row.get("by_adapter"))
    page.until = until_line(stored_json(row.get("until"), None))
    if (split := breakdown(row)) is not None:
        page.add("time-breakdown", split.spec, split.caption)
    page.server_view, page.server_view_problem = server_table(row)
    _requests(connection, page)
    page.span_counts = span_counts_line(stored_json(row.get("engine_view"), None))
    _distributions(connection, page)
    _series(connection, page)
    return page


def _priced(label: str, row: Mapping[str, Any]) -> str:
    """A cost's label names the GPU-hour price it was computed at (the record's own)."""
    price = row.get("cost_gpu_hour_price_usd")
    if not label.startswith("cost") or not isinstance(price, int | float):
        return label
    gpus = row.get("cost_gpus")
    counted = " simulated" if row.get("cost_gpus_counted") == "simulated" else ""
    return f"{label} (at ${price:g} per GPU-hour, {gpus}{counted} GPU{'s' if gpus != 1 else ''})"


def prefix_cache_line(row: Mapping[str, Any]) -> str | None:
    """What a trace case's prefix cache found against what its trace implies (record
    `system.implied_prefix_cache_hit_rate`), in one sentence; None for other cases."""
    ideal = row.get("system_implied_prefix_cache_hit_rate")
    if not isinstance(ideal, int | float):
        return None
    block = row.get("system_server_kv_block_size")
    said = (f"The trace implies that a prefix cache of {shown(block)}-token blocks that never "
            f"evicts finds {ideal:.1%} of its prompt tokens.")
    found = row.get("system_server_prefix_cache_hit_rate")
    ratio = row.get("system_prefix_cache_hit_rate_vs_implied")
    if not isinstance(found, int | float):
        return f"{said} The server reported no prefix-cache hit rate."
    of = f", {ratio:.0%} of the ideal" if isinstance(ratio, int | float) else ""
    return f"{said} The server found {found:.1%}{of}."


# The per-adapter table's columns: the record's key and the header shown.
ADAPTER_COLUMNS = (
    ("model", "model"), ("requests", "requests"), ("completed", "completed"),
    ("failed", "failed"), ("request_throughput", "req/s"), ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "median TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)"),
)


def adapter_rows(stored: Any) -> list[dict[str, str]]:
    """A LoRA mix's figures per model (the `by_adapter` column's JSON), each value shown."""
    rows = stored_json(stored, [])
    if not isinstance(rows, list):
        return []
    return [{key: shown(row.get(key)) for key, _ in ADAPTER_COLUMNS}
            for row in rows if isinstance(row, dict)]


def span_counts_line(view: Any) -> str | None:
    """What the trace receiver counted during a traced load (the server view's
    `span_receiver`), in one sentence: what it kept, and what it set aside and why."""
    counts = view.get("span_receiver") if isinstance(view, dict) else None
    if not isinstance(counts, dict):
        return None

    def count(key: str) -> int:
        value = counts.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    aside = [f"{count(key):,} {what}" for key, what in (
        ("spans_unexpected", "of trace ids the load did not send (warm-ups, start-up)"),
        ("spans_duplicate", "repeated for a trace id (the last to end kept)"),
        ("spans_over_limit", "past the bound on one load's spans"),
    ) if count(key)]
    refused = count("refused_malformed") + count("refused_too_large")
    said = (f"The trace receiver accepted {count('exports'):,} export(s) holding "
            f"{count('spans_received'):,} request span(s) during the load: "
            f"{count('spans_kept'):,} kept as this load's own")
    said += f"; set aside: {', '.join(aside)}." if aside else "."
    if refused:
        said += (f" It refused {refused:,} export(s) ({count('refused_malformed'):,} "
                 f"malformed, {count('refused_too_large'):,} too large).")
    return said


def until_line(until: Any) -> str | None:
    """One line of a load sent in rounds (`until:`): the interval reached against the one
    asked, what ended it, and the rounds and requests it took."""
    if not isinstance(until, dict):
        return None
    metric, rounds, requests = until.get("metric"), until.get("rounds"), until.get("requests")
    asked, confidence = until.get("half_width"), until.get("confidence")
    took = f"{shown(rounds)} round(s), {shown(requests)} requests"
    low, high, width = until.get("ci_low"), until.get("ci_high"), until.get("relative_half_width")
    metric = metric_label(metric)
    if not all(isinstance(v, int | float) for v in (low, high, width, asked, confidence)):
        return f"Sent until {metric} was known: no interval by the cap ({took})."
    ended = ("as the interval was narrow enough" if until.get("stopped_by") == "interval"
             else f"by the cap of {shown(until.get('max_prompts'))} requests")
    return (f"Sent until {metric} was known to ±{asked:.1%}: {confidence:.0%} interval "
            f"{shown(low)} .. {shown(high)} ms (±{width:.1%}); stopped {ended}, "
            f"after {took}.")


def metric_label(metric: Any) -> str:
    """A latency statistic's column name as the headlines name it: `p90_ttft_ms` is
    `p90 TTFT`; anything else as it is."""
    parts = str(metric).split("_")
    if len(parts) == 3 and parts[2] == "ms" and parts[1] in ("ttft", "tpot", "itl", "e2el"):
        return f"{parts[0]} {parts[1].upper()}"
    return str(metric)


def _accuracy(page: RunPage) -> None:
    """lm-eval's metrics as headlines (value ± standard error), and one line of what it scored
    and how."""
    accuracy = stored_json(page.row.get("accuracy"), None)
    if not isinstance(accuracy, dict):
        return
    for metric in accuracy.get("metrics") or []:
        if not isinstance(metric, dict) or metric.get("value") is None:
            continue
        stderr = metric.get("stderr")
        spread = f" ± {stderr:.3f}" if isinstance(stderr, int | float) else ""
        page.headlines.insert(0, (str(metric.get("name")), f"{metric['value']:.3f}{spread}", ""))
    samples, available = accuracy.get("samples"), accuracy.get("samples_available")
    page.accuracy = (
        f"lm-eval {accuracy.get('lm_eval_version') or '?'} scored task {accuracy.get('task')} "
        f"(version {accuracy.get('task_version') or '-'}, hash {accuracy.get('task_hash') or '-'})"
        f" on {shown(samples)} of {shown(available)} samples, "
        f"{shown(accuracy.get('num_fewshot'))}-shot, through {accuracy.get('api') or '-'}."
    )
    page.plumbing_check = bool(accuracy.get("plumbing_check"))


def _gate(connection: sqlite3.Connection, page: RunPage) -> None:
    if _exists(connection, VERDICTS):
        cursor = connection.execute(f"SELECT * FROM [{VERDICTS}] WHERE run_id = ? "
                                    "ORDER BY metric", (page.run_id,))
        names = [d[0] for d in cursor.description]
        page.gate = [dict(zip(names, r, strict=True)) for r in cursor]
    else:
        page.gate = stored_json(page.row.get("regression"), [])
    sessions = {str(v["baseline_session"]) for v in page.gate if v.get("baseline_session")}
    if sessions and _exists(connection, RUNS):
        fingerprint = connection.execute(f"SELECT fingerprint FROM [{RUNS}] WHERE run_id = ?",
                                         (page.run_id,)).fetchone()
        if fingerprint is not None:
            marks = ", ".join("?" for _ in sessions)
            page.baseline_runs = [r[0] for r in connection.execute(
                f"SELECT run_id FROM [{RUNS}] WHERE fingerprint = ? AND session_id IN ({marks}) "
                "ORDER BY timestamp", (fingerprint[0], *sorted(sessions)))]


def _configuration(page: RunPage) -> None:
    try:
        defaults = bundled().defaults()
    except RegistryError:
        defaults = {}
    for name, value in page.row.items():
        if not name.startswith("server_"):
            continue
        argument = name.removeprefix("server_")
        page.configuration.append((argument, shown(value)))
        if argument in _NOT_CONFIGURATION or argument not in defaults:
            continue
        default = defaults[argument]
        if not _same(value, default):
            page.changed.append((argument, shown(value), shown(_stored(default))))


def _stored(value: Any) -> Any:
    """A default as the table stores it: containers as JSON, booleans as 0/1."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True) if value else None
    return value


def _same(value: Any, default: Any) -> bool:
    stored = _stored(default)
    if value == stored:
        return True
    if isinstance(value, str) and value[:1] in ("{", "["):
        return bool(stored_json(value, object()) == default)
    if isinstance(value, int | float) and isinstance(stored, int | float):
        return float(value) == float(stored)
    if value in (None, "") and stored in (None, ""):
        return True
    # A column typed by its values holds a number as text, or text a number.
    return str(value) == str(stored)


def _requests(connection: sqlite3.Connection, page: RunPage) -> None:
    found, page.timeline_note = request_timeline.requests(connection, page.run_id)
    if found:
        page.add("requests-timeline", *request_timeline.timeline(found))
        page.slowest = request_timeline.slowest(found)


def _distributions(connection: sqlite3.Connection, page: RunPage) -> None:
    if not _exists(connection, SAMPLES):
        page.notes.append("No per-request samples in this database (loaded before they were "
                          "kept, or from a record without its request file).")
        return
    rows = connection.execute(
        f"SELECT ttft_ms, tpot_ms, e2el_ms, itl_ms FROM [{SAMPLES}] WHERE run_id = ? AND "
        "success", (page.run_id,)).fetchall()
    if not rows:
        page.notes.append("No per-request samples for this run.")
        return
    values: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "e2el_ms": [],
                                      "itl_ms": []}
    for ttft, tpot, e2el, itl in rows:
        for name, value in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2el_ms", e2el)):
            if isinstance(value, int | float) and math.isfinite(value):
                values[name].append(float(value))
        values["itl_ms"] += [float(v) for v in stored_json(itl, []) if isinstance(v, int | float)
                             and math.isfinite(v)]
    for name, label in DISTRIBUTIONS:
        spec = histogram(values[name], f"{label} (ms)")
        if spec is not None:
            count = len(values[name])
            what = "inter-token gaps" if name == "itl_ms" else "successful requests"
            page.add(f"dist-{name}", spec, f"{label} of {count} {what}: how many fell in each "
                     "bin; the rules mark p50, p90 and p99.")


def histogram(values: Sequence[float], title: str) -> dict[str, Any] | None:
    """A histogram of `values` (binned here: a run may have millions of inter-token gaps)
    with its percentiles as labelled rules."""
    if not values:
        return None
    data = np.asarray(values, dtype=float)
    # Values a rounding apart (the same TPOT computed from different times) are one bin:
    # numpy refuses 40 bins over a range its floats cannot split.
    spread = data.max() - data.min() > 1e-9 * max(1.0, abs(float(data.max())))
    counts, edges = np.histogram(data, bins=BINS if spread else 1)
    bins = [{"from": float(edges[i]), "to": float(edges[i + 1]), "count": int(counts[i])}
            for i in range(len(counts))]
    marks = [{"percentile": f"p{p}", "value": float(np.percentile(data, p))}
             for p in PERCENTILES]
    x = charts.field("from", "quantitative", title, bin={"binned": True})
    return charts.spec(bins, title=title, height=charts.SMALL_HEIGHT, layers=[
        {"mark": {"type": "bar", "tooltip": True, "color": "#4c78a8"},
         "encoding": {"x": x, "x2": {"field": "to"},
                      "y": charts.field("count", "quantitative", "requests")}},
        {"data": {"values": marks},
         "mark": {"type": "rule", "color": "#c62828", "strokeWidth": 2},
         "encoding": {"x": charts.field("value", "quantitative", title),
                      "tooltip": charts.tooltips("percentile", "value")}},
        {"data": {"values": marks},
         "mark": {"type": "text", "align": "left", "dx": 3, "dy": -6, "color": "#c62828"},
         "encoding": {"x": charts.field("value", "quantitative", title),
                      "y": {"value": 8}, "text": {"field": "percentile"}}},
    ])


_SERIES_CHARTS = (
    ("throughput", "Throughput over the run",
     (("request_throughput", "req/s"),), "requests finished per second (vLLM's counter)"),
    ("tokens", "Output tokens per second over the run",
     (("output_throughput", "tok/s"),), "tokens generated per second (vLLM's counter)"),
    ("queues", "Running and waiting requests",
     (("running", "running"), ("waiting", "waiting")), "the scheduler's queues (vLLM's gauges)"),
    ("kv", "KV-cache usage", (("kv_cache_usage", "KV cache used (fraction)"),),
     "the fraction of KV-cache blocks in use"),
    ("gpu_util", "GPU utilisation", (("gpu_utilization", "GPU utilisation (%)"),),
     "mean over the leased GPUs (NVML)"),
    ("gpu_memory", "GPU memory", (("gpu_memory_mib", "GPU memory (MiB)"),),
     "the fullest leased GPU (NVML)"),
    ("gpu_power", "GPU power", (("gpu_power_w", "GPU power (W)"),),
     "total over the leased GPUs (NVML)"),
    ("cpu", "Server and client CPU",
     (("server_cpu_percent", "server CPU (%)"), ("client_cpu_percent", "client CPU (%)")),
     "100 % = one core busy"),
    ("memory", "Server memory", (("server_rss_mib", "server RSS (MiB)"),),
     "resident memory of the server's process tree"),
)


def _cache_size(row: Mapping[str, Any]) -> str:
    """The cache the usage is a fraction of, as the server sized it (none where the record
    does not say, or says a count that is not one)."""
    tokens, blocks, size = (row.get(f"system_server_{name}") for name in
                            ("kv_cache_tokens", "num_gpu_blocks", "kv_block_size"))
    if not _positive(tokens):
        return ""
    of_blocks = f" in {blocks:,.0f} blocks of {size:,.0f}" if _positive(blocks) and _positive(
        size) else ""
    return f", of a cache of {tokens:,.0f} tokens{of_blocks} (as the server sized it)"


def _positive(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and 1 <= value < math.inf)


def _series(connection: sqlite3.Connection, page: RunPage) -> None:
    if not _exists(connection, SERIES):
        page.notes.append("No telemetry over time in this database (loaded before it was "
                          "kept).")
        return
    cursor = connection.execute(
        f"SELECT {', '.join(SERIES_COLUMNS)} FROM [{SERIES}] WHERE run_id = ? ORDER BY point",
        (page.run_id,))
    points = [dict(zip(SERIES_COLUMNS, r, strict=True)) for r in cursor]
    if not points:
        page.notes.append("No telemetry over time for this run (a record written before it "
                          "was kept, or an offline benchmark).")
        return
    has_gpu = any(p["gpu_utilization"] is not None for p in points)
    # A serve run's samples count from its load's start, a capacity search's from its start.
    axis = "seconds since the search started" if page.capacity else (
        "seconds since the load started")
    for chart_id, title, fields, caption in _SERIES_CHARTS:
        if chart_id.startswith("gpu") and not has_gpu:
            continue
        if not any(p[name] is not None for p in points for name, _ in fields):
            continue
        rows = [{"t_s": round(p["t_s"] or 0.0, 3), "series": label, "value": p[name]}
                for p in points for name, label in fields if p[name] is not None]
        if chart_id == "kv":
            caption += _cache_size(page.row)
        page.add(f"series-{chart_id}", charts.spec(
            rows, title=title, height=charts.SMALL_HEIGHT,
            mark={"type": "line", "point": len(points) < 60, "tooltip": True},
            encoding={"x": charts.field("t_s", "quantitative", axis, scale={"zero": True}),
                      "y": charts.field("value", "quantitative", fields[0][1] if len(fields) == 1
                                        else title),
                      "color": charts.field("series", "nominal", "")}),
            caption)
    if not has_gpu:
        page.notes.append("No GPU figures: this run's engine used no GPU NVML could read "
                          "(the simulator, or vLLM's CPU build); its CPU and memory are shown.")
