"""A run's page, `/{database}/-/run/{run_id}`: its verdicts and why, its configuration (the
arguments that differ from vLLM's defaults first), its workload and headline metrics, the
distributions of its per-request latencies, its telemetry over time, and its files.

`run_page` reads it all from a sqlite3 connection (tested without a browser); `run_files`
finds the run's files in the results folder and nowhere else (browse/run_views.py serves
them).
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
from pytest_profllm.browse.time_breakdown import breakdown, server_table
from pytest_profllm.browse.upload import UPLOADS, stored_name
from pytest_profllm.engine.registry import RegistryError, bundled
from pytest_profllm.limits import MAX_TRACE_FILES
from pytest_profllm.results.gate_tables import RUNS, SAMPLES, SERIES, SERIES_COLUMNS, VERDICTS
from pytest_profllm.results.table import TABLE
from pytest_profllm.server.launch import safe_name

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


def _json(value: Any, default: Any) -> Any:
    if not isinstance(value, str):
        return default
    try:
        return json.loads(value)
    except ValueError:
        return default


def shown(value: Any) -> str:
    """A figure as the page shows it (the template calls it too): four significant
    figures, a whole number from 10,000 up, `-` for none."""
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        # Four significant figures, never in exponent form: from 10,000 up, whole numbers.
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if value is None:
        return "-"
    return str(value)


def _headline(value: Any, unit: str = "") -> str:
    """A headline figure as shown; a rate whose unit is `%` as a percentage (one place); a
    list of rates (JSON text in its column: the acceptance rate by draft position) as its
    percentages, whole, in order."""
    if isinstance(value, str) and value.startswith("["):
        numbers = _json(value, None)
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
    page.verdicts = _json(row.get("verdicts"), [])
    page.validity_reasons = _json(row.get("validity_reasons"), [])
    _gate(connection, page)
    _configuration(page)
    page.workload = [(name.removeprefix("bench_"), shown(value)) for name, value in row.items()
                     if name.startswith("bench_") and value not in (None, "", "[]", "{}")]
    page.headlines = [(_priced(label, row), _headline(row[name], unit), unit)
                      for name, label, unit in HEADLINES if row.get(name) is not None]
    page.system = [(name, shown(value)) for name, value in row.items()
                   if name.startswith(("system_", "runtime_", "cost_"))
                   and value not in (None, "", "[]")]
    _capacity(page)
    _accuracy(page)
    page.prefix_cache = prefix_cache_line(row)
    page.adapters = adapter_rows(row.get("by_adapter"))
    page.until = until_line(_json(row.get("until"), None))
    if (split := breakdown(row)) is not None:
        page.add("time-breakdown", split.spec, split.caption)
    page.server_view, page.server_view_problem = server_table(row)
    _requests(connection, page)
    page.span_counts = span_counts_line(_json(row.get("engine_view"), None))
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
    rows = _json(stored, [])
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
    accuracy = _json(page.row.get("accuracy"), None)
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


def _capacity(page: RunPage) -> None:
    """The search's result and its probes: each load's decision, with every SLO's value and
    interval; a chart of the first SLO's value against the load."""
    search = _json(page.row.get("capacity_search"), None)
    if not isinstance(search, dict):
        return
    unit = "req/s" if search.get("over", "request_rate") == "request_rate" else "concurrent"
    page.headlines = [(label, value, unit if label.startswith("capacity") else shown_unit)
                      for label, value, shown_unit in page.headlines]
    low, high = [*(search.get("bracket") or []), None, None][:2]
    if search.get("capacity") is None:
        page.capacity = f"No load in the search range met every SLO ({search.get('limit')})."
    elif high is None:
        page.capacity = f"Capacity at least {shown(low)} {unit}: the highest load searched met."
    else:
        page.capacity = (f"Capacity {shown(low)} {unit}: bracket {shown(low)} .. "
                         f"{shown(high)}, limited by {search.get('limit')}; stopped on "
                         f"{search.get('stopped')}.")
    points = []
    for number, probe in enumerate(search.get("probes") or [], start=1):
        readings = probe.get("readings") or []
        page.probes.append(_probe_row(number, probe))
        for reading in readings:
            if isinstance(reading.get("value"), int | float):
                points.append({"load": probe.get("load"), "slo": reading.get("slo"),
                               "value": reading["value"], "low": reading.get("ci_low"),
                               "high": reading.get("ci_high"), "target": reading.get("target"),
                               "decision": probe.get("decision"), "probe": number})
    recheck = search.get("recheck")
    if isinstance(recheck, dict):
        # The search's answer run once more after it (load/capacity/search.py `Recheck`).
        page.probes.append(_probe_row("re-check", recheck))
        page.capacity += (
            f" Re-checked after the search at {shown(recheck.get('load'))} {unit}: "
            + _recheck_verdict(recheck)
        )
    for slo in dict.fromkeys(point["slo"] for point in points):
        mine = [point for point in points if point["slo"] == slo]
        page.add(f"capacity-{slo}", charts.spec(mine, title=f"Probes: {slo}",
                                                 layers=_probe_layers(unit)),
                 f"{slo} at each probe with its interval, coloured by the probe's decision; "
                 "dashed: the SLO.")


def _recheck_verdict(recheck: dict[str, Any]) -> str:
    """What the re-check decided, then what that makes of the capacity: only a miss voids it
    (load/capacity/search.py `Recheck`), so an unsure re-check is said as unsure, not as met."""
    if recheck.get("agrees") is not False:
        decision = recheck.get("decision")
        if decision == "meets":
            return "it met every SLO, so it agrees."
        reason = recheck.get("reason")
        said = f"{decision} ({reason})" if decision and reason else decision or "not recorded"
        return (f"it decided {said}: not a miss, so the capacity stands, unconfirmed by it.")
    if recheck.get("steady_engine"):
        # The virtual clock (load/capacity/search.py `search`'s steady_engine): no server to change.
        return ("it missed: the engine cannot change, so that load counts as missed and the "
                "capacity is the highest load below it that met.")
    return ("it missed: the server changed during the search, so the capacity is no "
            "measurement of it (the run is invalid).")


def _probe_row(number: int | str, probe: dict[str, Any]) -> dict[str, Any]:
    """One row of the probe table: a probe of the search, or its re-check."""
    readings = probe.get("readings") or []
    return {
        "number": number, "load": shown(probe.get("load")),
        "requests": probe.get("requests"), "achieved": shown(probe.get("achieved_rate")),
        "decision": probe.get("decision"), "reason": probe.get("reason") or "",
        "readings": "; ".join(
            f"{r.get('slo')} {shown(r.get('value'))} [{shown(r.get('ci_low'))}, "
            f"{shown(r.get('ci_high'))}] / {shown(r.get('target'))}"
            for r in readings if isinstance(r, dict)),
    }


def _probe_layers(unit: str) -> list[dict[str, Any]]:
    x = charts.field("load", "quantitative", f"load ({unit})", scale={"type": "log"})
    return [
        {"mark": {"type": "rule"},
         "encoding": {"x": x, "y": {"field": "low", "type": "quantitative"},
                      "y2": {"field": "high"}}},
        {"mark": {"type": "point", "filled": True, "size": 70, "tooltip": True},
         "encoding": {"x": x,
                      "y": charts.field("value", "quantitative", "value (ms, or a ratio)"),
                      "color": charts.field("decision", "nominal", "decision",
                                            scale={"domain": ["meets", "unsure", "misses"],
                                                   "range": ["#2a7", "#d90", "#c33"]}),
                      "tooltip": charts.tooltips("probe", "load", "slo", "value", "low",
                                                 "high", "target", "decision")}},
        {"mark": {"type": "rule", "strokeDash": [4, 3], "color": "#555"},
         "encoding": {"y": {"field": "target", "type": "quantitative"}}},
    ]


def _gate(connection: sqlite3.Connection, page: RunPage) -> None:
    if _exists(connection, VERDICTS):
        cursor = connection.execute(f"SELECT * FROM [{VERDICTS}] WHERE run_id = ? "
                                    "ORDER BY metric", (page.run_id,))
        names = [d[0] for d in cursor.description]
        page.gate = [dict(zip(names, r, strict=True)) for r in cursor]
    else:
        page.gate = _json(page.row.get("regression"), [])
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
        return bool(_json(value, object()) == default)
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
        values["itl_ms"] += [float(v) for v in _json(itl, []) if isinstance(v, int | float)
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


@dataclass(frozen=True)
class RunFile:
    """A file of a run, found in the results folder: what it is and where."""

    kind: str  # record, requests, log, trace
    name: str  # as the download URL names it
    path: Path
    size: int


# Where the plugin writes a run's profiler traces: the results folder's `profiles/`
# (session/worker.py), or `logs/profiles/` without one (server/workers.py).
TRACE_FOLDERS = ("profiles", "logs/profiles")
_SQLITE_HEADER = b"SQLite format 3\x00"


def run_files(results_dir: Path, row: Mapping[str, Any]) -> list[RunFile]:
    """The run's files that lie in `results_dir` (the folder of its database): its record,
    its request file, its server's log and its profiler traces, each only where the plugin
    writes that kind of file. A path that leads elsewhere (`..`, an absolute path, a symbolic
    link out, another folder of the results) is not one of them, and neither is a database
    or its journal: a record names its trace files itself, and may name `results.db`."""
    root = results_dir.resolve()
    run_id = str(row["run_id"])
    candidates: list[tuple[str, Path, Path]] = [
        ("record", root, results_dir / f"{run_id}.json"),
        ("record", root / UPLOADS, results_dir / UPLOADS / stored_name(run_id)),
        ("requests", root, results_dir / f"{run_id}.requests.jsonl.gz"),
    ]
    candidates += [(kind, root / "logs", path) for kind, path in _server_logs(results_dir, row)]
    traces = (_json(row.get("profiling"), {}) or {}).get("traces") or []
    for trace in traces[:MAX_TRACE_FILES] if isinstance(traces, list) else []:
        if isinstance(trace, dict) and isinstance(trace.get("path"), str):
            path = Path(trace["path"])
            path = path if path.is_absolute() else results_dir / path
            candidates += [("trace", root / folder, path) for folder in TRACE_FOLDERS]
    files: list[RunFile] = []
    for kind, folder, path in candidates:
        inside = within(folder, path)
        if inside is None or not inside.is_file() or _is_database(inside):
            continue
        name = inside.relative_to(root).as_posix()
        if all(f.name != name for f in files):
            files.append(RunFile(kind, name, inside, inside.stat().st_size))
    return files


def _server_logs(results_dir: Path, row: Mapping[str, Any]) -> list[tuple[str, Path]]:
    """The run's server log: the file its record names (one per server and session), else,
    for a record from before logs were named by session, the log of its suite's server with
    its key, which also holds the output of that server's other sessions (said in its kind).
    Never a log of another suite's server with the same key."""
    logs = results_dir / "logs"
    named = row.get("runtime_server_log")
    if isinstance(named, str) and named:
        return [("log", logs / named)] if "/" not in named and "\\" not in named else []
    server_key, suite = row.get("runtime_server_key"), row.get("suite")
    if not (isinstance(server_key, str) and server_key.isalnum() and isinstance(suite, str)):
        return []
    prefix = f"{safe_name(suite)}-"
    return [("log (every session of this server)", path) for path in sorted(
        logs.glob(f"*-{server_key}.log")) if path.name.startswith(prefix)]


def _is_database(path: Path) -> bool:
    """A SQLite database or one of its journals: never a file of a run."""
    if path.name.endswith(("-wal", "-shm", "-journal")):
        return True
    try:
        with path.open("rb") as file:
            return file.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return True


def within(root: Path, path: Path) -> Path | None:
    """`path` resolved (links followed), where it lies inside `root`; else None."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL in a record's path
        return None
    return resolved if resolved.is_relative_to(root) and resolved != root else None
