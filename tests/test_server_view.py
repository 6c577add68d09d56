"""The server's view of a load (load/server_view.py): vLLM's histograms over a window, their
quantiles from the buckets, and the client's overhead over them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_profllm.load.scrape import parse_metrics
from pytest_profllm.load.server_view import (
    OVERHEAD_PREFIX,
    Window,
    bucket_key,
    client_overhead,
    histogram_window,
    load_view,
    overhead_problem,
    quantile,
    result_keys,
    server_view,
)
from pytest_profllm.load.validity import InvalidKind
from pytest_profllm.sim.stats import TIME_TO_FIRST_TOKEN_BUCKETS, Histogram

TTFT = "vllm:time_to_first_token_seconds"


def _scrape(observed: dict[str, list[float]]) -> dict[str, float]:
    """A scrape as scrape_metrics keeps it, of histograms that observed these values."""
    values: dict[str, float] = {}
    for name, seen in observed.items():
        histogram = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        for value in seen:
            histogram.observe(value)
        values[f"{name}_count"] = float(len(seen))
        values[f"{name}_sum"] = histogram.total
        for bound, cumulative in histogram.buckets():
            values[bucket_key(name, float(bound))] = float(cumulative)
    return values


def test_a_window_is_the_change_between_two_scrapes() -> None:
    before = _scrape({TTFT: [0.003, 0.05]})
    after = _scrape({TTFT: [0.003, 0.05, 0.07, 0.07, 0.09]})
    window = histogram_window(before, after, TTFT)
    assert isinstance(window, Window) and not window.reset
    assert window.count == 3
    assert math.isclose(window.total, 0.23)
    figures, view = server_view(before, after)
    assert math.isclose(figures["server_ttft_mean_ms"] or 0, 230 / 3)
    assert view["problem"] is None
    # The three values lie in (0.06, 0.08] twice and (0.08, 0.1] once: the median in the first.
    assert view["histograms"]["ttft"]["median"]["lower"] == 60.0
    assert view["histograms"]["ttft"]["median"]["upper"] == 80.0


def test_a_restarted_server_counts_from_its_restart() -> None:
    before = _scrape({TTFT: [0.003] * 10})
    after = _scrape({TTFT: [0.2, 0.4]})  # fewer than before: its counters began again
    window = histogram_window(before, after, TTFT)
    assert isinstance(window, Window) and window.reset
    assert window.count == 2 and math.isclose(window.total, 0.6)
    figures, view = server_view(before, after)
    assert math.isclose(figures["server_ttft_mean_ms"] or 0, 300.0)
    assert "restart" in view["problem"] and "ttft" in view["problem"]


def test_engines_are_summed() -> None:
    text = "\n".join(
        [
            "# HELP vllm:time_to_first_token_seconds ttft",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *(
                f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="{le}"}} {n}'
                for e, buckets in (("0", ((0.1, 1), (0.5, 2), ("+Inf", 2))),
                                   ("1", ((0.1, 0), (0.5, 3), ("+Inf", 4))))
                for le, n in buckets
            ),
            'vllm:time_to_first_token_seconds_count{engine="0"} 2',
            'vllm:time_to_first_token_seconds_sum{engine="0"} 0.4',
            'vllm:time_to_first_token_seconds_count{engine="1"} 4',
            'vllm:time_to_first_token_seconds_sum{engine="1"} 3.2',
            "",
        ]
    )
    scraped = _parse(text)
    assert scraped[bucket_key(TTFT, 0.1)] == 1
    assert scraped[bucket_key(TTFT, 0.5)] == 5
    assert scraped[bucket_key(TTFT, math.inf)] == 6
    figures, _ = server_view({}, scraped)
    assert figures["server_ttft_count"] == 6
    assert math.isclose(figures["server_ttft_mean_ms"] or 0, 600.0)


def _parse(text: str) -> dict[str, float]:
    scraped = parse_metrics(text)
    assert scraped.unread is None and not scraped.left_out
    return scraped


def test_a_server_without_the_histograms_has_null_figures_and_says_why() -> None:
    figures, view = server_view({"other:thing_total": 1.0}, {"other:thing_total": 3.0})
    assert set(figures) == set(result_keys())
    assert all(value is None for value in figures.values())
    assert "none of vLLM's latency histograms" in view["problem"]
    _, silent = server_view(None, None)
    assert silent["problem"] and "did not answer" in silent["problem"]


_BOUNDS = st.lists(
    st.floats(0.0001, 1e4, allow_nan=False), min_size=1, max_size=25, unique=True
).map(sorted)


@given(_BOUNDS, st.data(), st.sampled_from([0.5, 0.9, 0.99, 0.01, 1.0]))
def test_a_quantile_lies_within_its_bucket(
    bounds: list[float], data: st.DataObject, q: float
) -> None:
    counts = data.draw(st.lists(st.integers(0, 50), min_size=len(bounds) + 1,
                                max_size=len(bounds) + 1))
    cumulative, buckets = 0.0, []
    for bound, count in zip([*bounds, math.inf], counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    estimate = quantile(q, tuple(buckets))
    if cumulative == 0:
        assert estimate is None
        return
    assert estimate is not None
    assert estimate.lower <= estimate.value <= estimate.upper
    # The bucket holds the rank: fewer observations below its lower bound than the rank,
    # at least as many up to its upper bound.
    below = max((c for b, c in buckets if b <= estimate.lower), default=0.0)
    upto = next(c for b, c in buckets if b >= estimate.upper)
    assert below <= q * cumulative <= upto


def test_the_client_overhead_is_the_client_mean_over_the_server_mean() -> None:
    results = {"mean_ttft_ms": 52.0, "server_ttft_mean_ms": 40.0, "mean_e2el_ms": 1000.0,
               "server_e2el_mean_ms": 990.0}
    assert client_overhead(results) == {
        "client_overhead_ttft_ms": 12.0, "client_overhead_e2el_ms": 10.0
    }
    assert client_overhead({"mean_ttft_ms": 52.0}) == {
        "client_overhead_ttft_ms": None, "client_overhead_e2el_ms": None
    }


def test_a_client_over_the_bound_is_the_host_s_fault() -> None:
    over = overhead_problem({"client_overhead_ttft_ms": 31.24}, 25.0)
    assert over is not None
    assert over.startswith(OVERHEAD_PREFIX)
    assert "31.2 ms" in over and "25 ms" in over and "host busy" in over
    assert InvalidKind.CLIENT_OVERHEAD.host_caused  # measured again, as every host-made one
    assert overhead_problem({"client_overhead_ttft_ms": 24.0}, 25.0) is None
    assert overhead_problem({"client_overhead_ttft_ms": None}, 25.0) is None


def test_the_overhead_bound_grows_with_the_servers_own_ttft() -> None:
    # vLLM's CPU build at 256 streams, idle host: 62.5 ms over a server mean of 566 ms.
    heavy = {"client_overhead_ttft_ms": 62.5}
    assert overhead_problem(heavy, 50.0) is not None  # the fixed bound alone: "host busy"
    assert overhead_problem(heavy, 50.0, 565.7) is None  # 15 %: 84.9 ms
    over = overhead_problem({"client_overhead_ttft_ms": 90.0}, 50.0, 565.7)
    assert over is not None and "bound 84.9 ms, 15% of the server's 565.7 ms" in over
    # A light load keeps the fixed bound: 15 % of 60 ms is under it.
    assert overhead_problem({"client_overhead_ttft_ms": 51.0}, 50.0, 60.0) is not None
    assert overhead_problem({"client_overhead_ttft_ms": 49.0}, 50.0, 60.0) is None


def test_a_window_with_other_requests_gives_no_overhead_and_says_so() -> None:
    """Warm-ups or another client in the window: the server's means are not the load's."""
    before = _scrape({TTFT: [], "vllm:e2e_request_latency_seconds": []})
    after = _scrape({TTFT: [0.05] * 8, "vllm:e2e_request_latency_seconds": [0.2] * 8})
    client = {"completed": 6, "mean_ttft_ms": 55.0, "mean_e2el_ms": 210.0}
    figures, view = load_view(before, after, client)
    assert figures["server_ttft_count"] == 8
    assert figures["client_overhead_ttft_ms"] is None
    assert "8 requests" in view["problem"] and "completed 6" in view["problem"]
    same, clean = load_view(before, after, {**client, "completed": 8})
    assert same["client_overhead_ttft_ms"] == pytest.approx(5.0)
    assert clean["problem"] is None


def test_a_client_mean_under_the_servers_beyond_clock_noise_is_said() -> None:
    before = _scrape({TTFT: [], "vllm:e2e_request_latency_seconds": []})
    after = _scrape({TTFT: [0.05] * 4, "vllm:e2e_request_latency_seconds": [0.2] * 4})
    client = {"completed": 4, "mean_ttft_ms": 45.0, "mean_e2el_ms": 199.5}
    figures, view = load_view(before, after, client)
    assert figures["client_overhead_ttft_ms"] == pytest.approx(-5.0)
    assert "TTFT is 5.0 ms under the server's" in view["problem"]
    assert "E2EL" not in view["problem"]  # 0.5 ms under: clock noise


_SECONDS = st.lists(st.floats(0.0, 3000.0, allow_nan=False), max_size=40)


@given(_SECONDS, _SECONDS)
def test_a_window_counts_exactly_what_came_in_it(earlier: list[float], within: list[float]) -> None:
    """Counters that only grew: the window is the histogram of what was observed within it."""
    window = histogram_window(
        _scrape({TTFT: earlier}), _scrape({TTFT: earlier + within}), TTFT
    )
    alone = histogram_window({}, _scrape({TTFT: within}), TTFT)
    assert isinstance(window, Window) and isinstance(alone, Window) and not window.reset
    assert window.count == len(within)
    assert window.buckets == alone.buckets
    assert window.total == pytest.approx(sum(within), rel=1e-9, abs=1e-6)
