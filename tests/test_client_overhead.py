"""The client's overhead over the server's own view: in every serve record, and a case whose
client added more than the bound is invalid and measured again, as every host-made fault."""

from __future__ import annotations

import pytest
from helpers import assert_invalid, run_records, run_suites

from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_MS

SUITE = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 4
  request_rate: 50
"""


def test_the_record_has_the_servers_view_and_the_clients_overhead(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_view=SUITE)
    result = run_suites(pytester, ports, "-n", "0")
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    results, server = record["results"], record["system"]
    assert server["server_ttft_count"] == 6
    assert server["server_e2el_count"] == 6
    overhead = results["client_overhead_ttft_ms"]
    assert overhead == pytest.approx(results["mean_ttft_ms"] - server["server_ttft_mean_ms"])
    # The server's figures are system figures: none of them is an engine argument's column.
    assert not any(key.startswith("server_") for key in results)
    assert -1.0 <= overhead <= DEFAULT_MAX_CLIENT_OVERHEAD_MS
    view = record["server_view"]
    assert view["problem"] is None
    p99 = view["histograms"]["e2el"]["p99"]
    assert p99["lower"] <= p99["estimate"] <= (p99["upper"] or float("inf"))
    assert record["attempts"][0]["client_overhead_ttft_ms"] == pytest.approx(overhead)


def test_a_client_over_the_bound_is_invalid_and_measured_again(
    pytester: pytest.Pytester, ports: str
) -> None:
    """A bound no client keeps (0.0001 ms: the client's clock always runs longer than the
    server's): each attempt is invalid for the host's sake, so the load runs 1 + 1 times."""
    pytester.makefile(".yaml", bench_view=SUITE)
    result = run_suites(
        pytester, ports, "-n", "0", "--profllm-max-client-overhead", "0.0001",
        "--profllm-remeasure", "1",
    )
    assert_invalid(result, 1)
    (record,) = run_records(pytester)
    assert record["status"] == "invalid"
    assert [a["attempt"] for a in record["attempts"]] == [1, 2]
    reason = record["validity_reasons"][0]
    assert reason.startswith("attempt 1: the client added")
    assert "to mean TTFT (bound 0.0001 ms): host busy" in reason

