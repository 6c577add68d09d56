"""A capacity search's part of its run's page (browse/run_page.py): the capacity it found and
how, a row per probe and per re-check with every SLO's value and interval, and a chart per
SLO of its value against the load."""

from __future__ import annotations

from typing import Any, Protocol

from pytest_profllm.browse import charts
from pytest_profllm.browse.run_values import shown, stored_json


class CapacityPage(Protocol):
    """What of a run's page the capacity part reads and fills (browse/run_page.py `RunPage`)."""

    row: dict[str, Any]
    headlines: list[tuple[str, Any, str]]
    capacity: str | None
    probes: list[dict[str, Any]]

    def add(self, chart_id: str, spec: dict[str, Any], caption: str) -> None: ...


def capacity_section(page: CapacityPage) -> None:
    """The search's result and its probes: each load's decision, with every SLO's value and
    interval; a chart of the first SLO's value against the load."""
    search = stored_json(page.row.get("capacity_search"), None)
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
        page.probes.append(probe_row(number, probe))
        for reading in readings:
            if isinstance(reading.get("value"), int | float):
                points.append({"load": probe.get("load"), "slo": reading.get("slo"),
                               "value": reading["value"], "low": reading.get("ci_low"),
                               "high": reading.get("ci_high"), "target": reading.get("target"),
                               "decision": probe.get("decision"), "probe": number})
    recheck = search.get("recheck")
    if isinstance(recheck, dict):
        # The search's answer run once more after it (load/capacity/search.py `Recheck`).
        page.probes.append(probe_row("re-check", recheck))
        page.capacity += (
            f" Re-checked after the search at {shown(recheck.get('load'))} {unit}: "
            + recheck_verdict(recheck)
        )
    for slo in dict.fromkeys(point["slo"] for point in points):
        mine = [point for point in points if point["slo"] == slo]
        page.add(f"capacity-{slo}", charts.spec(mine, title=f"Probes: {slo}",
                                                 layers=probe_layers(unit)),
                 f"{slo} at each probe with its interval, coloured by the probe's decision; "
                 "dashed: the SLO.")


def recheck_verdict(recheck: dict[str, Any]) -> str:
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


def probe_row(number: int | str, probe: dict[str, Any]) -> dict[str, Any]:
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


def probe_layers(unit: str) -> list[dict[str, Any]]:
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
