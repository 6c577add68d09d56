"""The load dashboard's chart of the server's own queue time against load
(browse/queue_chart.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from test_dashboards import ingested, sweep, values, view

from pytest_profllm.browse import sql_functions


def test_queue_time_against_the_load_each_suite_sweeps(tmp_path: Path) -> None:
    records = sweep("s1", "01", 1.0)
    for record in records:
        if record["suite"] == "rates":
            rate = record["config"]["benchmark"]["request_rate"]
            # The queue grows with load, faster with the smaller batch limit.
            load = 32.0 if rate == "inf" else float(rate)
            seqs = record["config"]["server"]["max_num_seqs"]
            record["system"]["server_queue_mean_ms"] = load * 64 / seqs
    with sqlite3.connect(ingested(tmp_path, records)) as connection:
        sql_functions.register(connection)
        shown = view(connection, "load")
    # The suite whose runs kept no server's view (tp) has no queue chart.
    assert [key for key in shown.charts if key.startswith("queue-")] == ["queue-rates"]
    rows = values(shown.charts["queue-rates"])
    by = {(row["series"].split("::")[1], row["load"]): row["queue_ms"] for row in rows}
    assert by[("qwen-seqs8", "8")] == 64.0 and by[("qwen-seqs16", "inf")] == 128.0
    assert sorted({row["load"] for row in rows}, key=lambda x: float(x)) == ["8", "16", "inf"]
    assert "vllm:request_queue_time_seconds" in shown.captions["queue-rates"]
