"""`metrics.compute` against the definitions of vLLM's `vllm bench serve`.

Expected numbers are worked out by hand (population std, numpy's linear-interpolation
percentiles) from small hand-built outcomes, so a change of definition shows up as a failure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from pytest_profllm.load import metrics
from pytest_profllm.load.metrics import RequestOutcome, compute
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.metric_names import LATENCY_METRICS, percentile_key, result_names

DURATION = 2.0


def _outcomes() -> list[RequestOutcome]:
    """Three successes and one failure with round numbers (seconds).

    a: 3 tokens, TTFT 0.1, E2EL 0.3 -> TPOT 0.1
    b: 5 tokens, TTFT 0.2, E2EL 1.0 -> TPOT 0.2
    c: 1 token,  TTFT 0.4, E2EL 0.4 -> no TPOT (single token)
    d: failed, with large numbers that would show if it leaked into any statistic.
    """
    return [
        RequestOutcome(
            prompt_len=10, success=True, output_tokens=3, ttft=0.1, itl=[0.05, 0.15], latency=0.3
        ),
        RequestOutcome(
            prompt_len=20, success=True, output_tokens=5, ttft=0.2, itl=[0.2] * 4, latency=1.0
        ),
        RequestOutcome(prompt_len=30, success=True, output_tokens=1, ttft=0.4, latency=0.4),
        RequestOutcome(
            prompt_len=1000,
            success=False,
            output_tokens=50,
            ttft=9.0,
            itl=[9.0],
            latency=9.0,
            error="HTTP 500",
        ),
    ]


def test_counts_and_throughputs_leave_out_failures_but_use_the_whole_duration() -> None:
    results = compute(_outcomes(), DURATION)
    assert results["completed"] == 3
    assert results["failed"] == 1
    assert results["total_input_tokens"] == 10 + 20 + 30
    assert results["total_output_tokens"] == 3 + 5 + 1
    assert results["duration"] == DURATION
    assert results["request_throughput"] == pytest.approx(3 / 2.0)
    assert results["output_throughput"] == pytest.approx(9 / 2.0)
    assert results["total_token_throughput"] == pytest.approx(69 / 2.0)
    # No goodput SLOs: vLLM reports None, not 0.
    assert results["request_goodput"] is None


def test_profllm_aliases_mirror_vllm_names() -> None:
    results = compute(_outcomes(), DURATION)
    assert results["completed_requests"] == results["completed"] == 3
    assert results["failed_requests"] == results["failed"] == 1


def test_ttft_statistics() -> None:
    # TTFTs 0.1, 0.2, 0.4: mean 0.7/3, population variance 7/450.
    results = compute(_outcomes(), DURATION, percentiles=(50, 90, 99))
    assert results["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert results["median_ttft_ms"] == pytest.approx(200)
    assert results["std_ttft_ms"] == pytest.approx(math.sqrt(7 / 450) * 1000)
    # Linear interpolation over sorted [0.1, 0.2, 0.4]: rank p/100 * 2.
    assert results["p50_ttft_ms"] == pytest.approx(200)
    assert results["p90_ttft_ms"] == pytest.approx(360)
    assert results["p95_ttft_ms"] == pytest.approx(380)
    assert results["p99_ttft_ms"] == pytest.approx(396)


def test_tpot_skips_single_token_requests() -> None:
    # Only a (0.1) and b (0.2) have TPOT; c's single token must not add a 0 sample.
    results = compute(_outcomes(), DURATION, percentiles=(99,))
    assert results["mean_tpot_ms"] == pytest.approx(150)
    assert results["median_tpot_ms"] == pytest.approx(150)
    assert results["std_tpot_ms"] == pytest.approx(50)
    assert results["p99_tpot_ms"] == pytest.approx(199)
    assert results["p95_tpot_ms"] == pytest.approx(195)


def test_itl_pools_gaps_over_requests() -> None:
    # Pooled, sorted: [0.05, 0.15, 0.2, 0.2, 0.2, 0.2]; the failure's 9.0 is left out.
    results = compute(_outcomes(), DURATION, percentiles=(10, 50, 99))
    assert results["mean_itl_ms"] == pytest.approx(1000 / 6)
    assert results["median_itl_ms"] == pytest.approx(200)
    assert results["p10_itl_ms"] == pytest.approx(100)  # rank 0.5 between 0.05 and 0.15
    assert results["p99_itl_ms"] == pytest.approx(200)
    mean = 1.0 / 6
    variance = sum((x - mean) ** 2 for x in [0.05, 0.15, 0.2, 0.2, 0.2, 0.2]) / 6
    assert results["std_itl_ms"] == pytest.approx(math.sqrt(variance) * 1000)


def test_e2el_statistics() -> None:
    # E2ELs sorted [0.3, 0.4, 1.0].
    results = compute(_outcomes(), DURATION, percentiles=(10, 99))
    assert results["mean_e2el_ms"] == pytest.approx(1700 / 3)
    assert results["median_e2el_ms"] == pytest.approx(400)
    assert results["p10_e2el_ms"] == pytest.approx(320)
    assert results["p99_e2el_ms"] == pytest.approx(988)


def test_tpot_excluded_for_zero_and_one_output_tokens() -> None:
    outcomes = [
        RequestOutcome(prompt_len=1, success=True, output_tokens=0, ttft=0.1, latency=0.5),
        RequestOutcome(prompt_len=1, success=True, output_tokens=1, ttft=0.1, latency=0.5),
        RequestOutcome(prompt_len=1, success=True, output_tokens=2, ttft=0.1, latency=0.5),
    ]
    results = compute(outcomes, 1.0, percentiles=(50,))
    # Only the 2-token request: (0.5 - 0.1) / 1.
    assert results["mean_tpot_ms"] == pytest.approx(400)
    assert results["std_tpot_ms"] == pytest.approx(0)
    assert results["completed"] == 3


def test_count_tokens_used_when_stream_had_no_usage() -> None:
    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return len(text.split())

    outcomes = [
        # No usage chunk: counted from the text, 4 tokens -> TPOT (0.7 - 0.1) / 3.
        RequestOutcome(prompt_len=5, success=True, ttft=0.1, latency=0.7, generated_text="w x y z"),
        # vLLM's `if not output_len`: a 0 from the server is recounted too.
        RequestOutcome(
            prompt_len=5, success=True, output_tokens=0, ttft=0.1, latency=0.2, generated_text="w"
        ),
        # A usage count wins over the text.
        RequestOutcome(
            prompt_len=5, success=True, output_tokens=7, ttft=0.1, latency=0.7, generated_text="w"
        ),
        # Failures are never counted.
        RequestOutcome(prompt_len=5, success=False, generated_text="never counted"),
    ]
    results = compute(outcomes, 1.0, count_tokens=count)
    assert calls == ["w x y z", "w"]
    assert results["total_output_tokens"] == 4 + 1 + 7
    # TPOTs 0.2 and 0.1 (the single-token one has none).
    assert results["mean_tpot_ms"] == pytest.approx(150)


def test_missing_output_tokens_without_counter_count_as_zero() -> None:
    outcomes = [
        RequestOutcome(prompt_len=5, success=True, ttft=0.1, latency=0.7, generated_text="a b")
    ]
    results = compute(outcomes, 1.0)
    assert results["total_output_tokens"] == 0
    assert results["completed"] == 1
    assert results["mean_tpot_ms"] == 0.0  # no TPOT sample -> vLLM's zero
    assert results["mean_ttft_ms"] == pytest.approx(100)


@pytest.mark.parametrize(
    ("outcomes", "duration", "failed"),
    [
        pytest.param([], 0.0, 0, id="empty-zero-duration"),
        pytest.param([], 1.5, 0, id="empty"),
        pytest.param(
            [RequestOutcome(prompt_len=9, error="x"), RequestOutcome(prompt_len=9, error="y")],
            1.0,
            2,
            id="all-failed",
        ),
    ],
)
def test_nothing_completed_reports_zeros(
    outcomes: list[RequestOutcome], duration: float, failed: int
) -> None:
    results = compute(outcomes, duration, goodput_ms={"ttft": 100})
    assert results["completed"] == 0
    assert results["failed"] == failed
    assert results["total_input_tokens"] == 0
    assert results["total_output_tokens"] == 0
    for name in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert results[name] == 0.0
    for metric in LATENCY_METRICS:
        stats = [key for key in results if key.endswith(f"_{metric}_ms")]
        assert len(stats) >= 7  # mean, median, std, p50, p90, p95, p99
        assert all(results[key] == 0.0 for key in stats), stats


def test_empty_goodput_with_duration_is_zero() -> None:
    failed = [RequestOutcome(prompt_len=1, error="x")]
    assert compute(failed, 1.0, goodput_ms={"ttft": 100})["request_goodput"] == 0.0


@pytest.mark.parametrize(
    ("percentile", "key"),
    [(99, "p99"), (99.0, "p99"), (99.9, "p99.9"), (50, "p50"), (0.5, "p0.5"), (95.25, "p95.25")],
)
def test_percentile_key(percentile: float, key: str) -> None:
    assert percentile_key(percentile) == key


def test_p95_ttft_and_tpot_always_present() -> None:
    results = compute(_outcomes(), DURATION, percentiles=(99,))
    assert "p95_ttft_ms" in results
    assert "p95_tpot_ms" in results
    # Only for those two: other metrics get exactly the asked-for percentiles.
    assert "p95_itl_ms" not in results
    assert "p95_e2el_ms" not in results
    assert "p99_itl_ms" in results
    assert "p50_ttft_ms" not in results


def test_99_9_percentile_key_in_results() -> None:
    results = compute(_outcomes(), DURATION, percentiles=(99.9,))
    # Rank 0.999 * 2 over sorted TTFTs [0.1, 0.2, 0.4].
    assert results["p99.9_ttft_ms"] == pytest.approx(399.6)


@pytest.mark.parametrize(
    ("goodput_ms", "good"),
    [
        pytest.param({"ttft": 250}, 2, id="ttft"),  # a, b
        pytest.param({"tpot": 150}, 2, id="tpot"),  # a (0.1), c (single token counts as 0)
        pytest.param({"tpot": 1}, 1, id="tpot-single-token-is-zero"),  # only c
        pytest.param({"e2el": 400}, 2, id="e2el-inclusive"),  # a, c at exactly 0.4
        pytest.param({"ttft": 250, "tpot": 150}, 1, id="ttft-and-tpot"),  # only a
        pytest.param({"ttft": 50}, 0, id="none-good"),
        pytest.param({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3, id="all-good"),
    ],
)
def test_goodput(goodput_ms: dict[str, float], good: int) -> None:
    results = compute(_outcomes(), DURATION, goodput_ms=goodput_ms)
    assert results["request_goodput"] == pytest.approx(good / DURATION)


@pytest.mark.parametrize(
    ("latency_metrics", "percentiles"),
    [
        (LATENCY_METRICS, (50.0, 90.0, 95.0, 99.0)),
        (("ttft", "tpot"), (99,)),
        (("itl",), (99.9, 10)),
        (("e2el", "ttft"), (95,)),
    ],
)
def test_result_names_are_exactly_compute_keys(
    latency_metrics: Sequence[str], percentiles: Sequence[float]
) -> None:
    results = compute(
        _outcomes(),
        DURATION,
        latency_metrics=latency_metrics,
        percentiles=percentiles,
        goodput_ms={"ttft": 100},
    )
    names = result_names(latency_metrics, percentiles)
    assert names == list(results)
    assert len(set(names)) == len(names)


def test_latency_metrics_subset_limits_keys() -> None:
    results = compute(_outcomes(), DURATION, latency_metrics=("itl",), percentiles=(99,))
    latency_keys = {key for key in results if key.endswith("_ms")}
    assert latency_keys == {"mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms"}


# The client's own health: schedule lag, rates, CPU; and when a case is invalid.


def _scheduled(lags: Sequence[float], gap: float = 0.1) -> list[RequestOutcome]:
    """Requests due every `gap` seconds from a clock start of 100.0, each `lag` late."""
    return [
        RequestOutcome(
            prompt_len=1,
            intended_start=100.0 + gap * (i + 1),
            dispatch_time=100.0 + gap * (i + 1) + lag,
        )
        for i, lag in enumerate(lags)
    ]


def test_client_health_lag_statistics_and_rates() -> None:
    lags = [0.0, 0.001, 0.002, 0.003, 0.014]
    outcomes = _scheduled(lags)
    offsets = [0.1 * (i + 1) for i in range(5)]
    health = metrics.client_health(outcomes, offsets, 100.0, duration=1.0, cpu_seconds=0.25)
    assert health["mean_schedule_lag_ms"] == pytest.approx(4.0)
    assert health["median_schedule_lag_ms"] == pytest.approx(2.0)
    # The lower of the two lags around the 99th percentile (3 and 14 ms): one late request
    # alone is not a client that fell behind.
    assert health["p99_schedule_lag_ms"] == pytest.approx(3.0)
    assert health["max_schedule_lag_ms"] == pytest.approx(14.0)
    assert health["target_request_rate"] == pytest.approx(10.0)  # 5 requests by 0.5 s
    assert health["achieved_request_rate"] == pytest.approx(5 / 0.514)
    assert health["client_cpu_percent"] == pytest.approx(25.0)
    assert (health["client_processes"], health["client_cores"]) == (1, None)
    assert set(health) == set(metric_names.CLIENT_HEALTH_KEYS)
    spread = metrics.client_health(outcomes, offsets, 100.0, 1.0, 0.5, processes=2, cores=3)
    assert (spread["client_processes"], spread["client_cores"]) == (2, 3)
    assert spread["client_cpu_percent"] == pytest.approx(25.0)  # per process


@pytest.mark.parametrize(("late", "fell_behind"), [(0, False), (1, False), (2, True), (10, True)])
def test_one_late_request_alone_does_not_make_a_case_invalid(late: int, fell_behind: bool) -> None:
    # The README's main job on a 2-core host running four workers: 32 turns, one held up
    # 14.16 ms and the next latest 1.85 ms. The interpolated p99 (10.34 ms) was that one
    # request's alone; `late` of them that late is a client that fell behind from two on.
    lags = [0.00185] * (32 - late) + [0.01416] * late
    outcomes = _scheduled(lags)
    offsets = [0.1 * (i + 1) for i in range(32)]
    health = metrics.client_health(outcomes, offsets, 100.0, duration=3.3, cpu_seconds=0.3)
    reason = metrics.client_fell_behind(health)
    assert (reason is not None) == fell_behind
    if fell_behind:
        assert reason == "client fell behind: p99 schedule lag 14.2 ms is over 10 ms"
    assert health["max_schedule_lag_ms"] == pytest.approx(14.16 if late else 1.85)


@pytest.mark.parametrize(
    ("gap", "last_lag", "fell_behind"),
    [(0.001, 0.0008, False), (0.005, 0.0008, False), (0.005, 0.012, True), (1.0, 0.06, True)],
)
def test_a_short_schedule_is_not_judged_by_its_jitter(
    gap: float, last_lag: float, fell_behind: bool
) -> None:
    """A trace of two requests `gap` apart: its achieved rate falls short by the last one's
    lateness over the gap, so 0.8 ms of a timer's jitter was 44 % of a 1 ms schedule ("client
    fell behind"). Lateness within the lag limit is no falling behind; over it, it is."""
    outcomes = [
        RequestOutcome(prompt_len=1, intended_start=100.0, dispatch_time=100.0002),
        RequestOutcome(
            prompt_len=1, intended_start=100.0 + gap, dispatch_time=100.0 + gap + last_lag
        ),
    ]
    health = metrics.client_health(outcomes, [0.0, gap], 100.0, duration=1.0, cpu_seconds=0.01)
    assert health["achieved_request_rate"] is not None and health["target_request_rate"]
    assert health["achieved_request_rate"] < 0.95 * health["target_request_rate"]
    reason = metrics.client_fell_behind(health)
    assert (reason is not None) == fell_behind, reason
    if fell_behind:
        assert reason is not None and reason.startswith("client fell behind: achieved request rate")


def test_a_request_early_has_no_negative_lag() -> None:
    (outcome,) = _scheduled([-0.5])
    assert outcome.schedule_lag == 0.0


def test_infinite_rate_has_no_target() -> None:
    outcomes = _scheduled([0.0, 0.02], gap=0.0)
    health = metrics.client_health(outcomes, [0.0, 0.0], 100.0, duration=1.0, cpu_seconds=0.1)
    assert health["target_request_rate"] is None
    assert health["achieved_request_rate"] is None
    # A burst that took the client 20 ms to send is reported, but it breaks no schedule.
    assert health["max_schedule_lag_ms"] == pytest.approx(20.0)
    assert metrics.client_fell_behind(health) is None


@pytest.mark.parametrize(
    ("health", "reason"),
    [
        (
            {"target_request_rate": 10.0, "achieved_request_rate": 9.4, "p99_schedule_lag_ms": 1},
            "client fell behind: achieved request rate 9.4/s is under 95% of the target 10/s",
        ),
        (
            {"target_request_rate": 10.0, "achieved_request_rate": 9.6, "p99_schedule_lag_ms": 11},
            "client fell behind: p99 schedule lag 11 ms is over 10 ms",
        ),
        (
            {"target_request_rate": None, "p99_schedule_lag_ms": 50, "client_cpu_percent": 97.0},
            "client fell behind: client CPU saturated (97% of a core)",
        ),
    ],
)
def test_client_fell_behind_says_why(health: dict[str, float | None], reason: str) -> None:
    assert metrics.client_fell_behind(health) == reason


def test_client_that_kept_up_is_valid() -> None:
    health = {
        "target_request_rate": 10.0,
        "achieved_request_rate": 9.6,
        "p99_schedule_lag_ms": 9.9,
        "client_cpu_percent": 94.0,
    }
    assert metrics.client_fell_behind(health) is None


def test_served_problem_quotes_first_errors() -> None:
    failed = [RequestOutcome(prompt_len=1, error=f"boom {i % 2}\ntraceback") for i in range(4)]
    problem = metrics.served_problem(failed, compute(failed, 1.0))
    assert problem == "all 4 requests failed; first errors: boom 0; boom 1"


def test_served_problem_any_non_200_status() -> None:
    outcomes = _outcomes()
    outcomes[3].status = 400
    outcomes[3].error = "HTTP 400 Bad Request: too long"
    problem = metrics.served_problem(outcomes, compute(outcomes, DURATION))
    assert problem == (
        "1 of 4 requests failed (1 got a non-200 status; none allowed: thresholds: "
        "{failed: {max: N}}); first errors: HTTP 400 Bad Request: too long"
    )
    assert metrics.served_problem(outcomes, compute(outcomes, DURATION), 1) is None


def test_served_problem_zero_output_tokens() -> None:
    outcomes = [RequestOutcome(prompt_len=1, success=True, output_tokens=0, ttft=0.1)]
    problem = metrics.served_problem(outcomes, compute(outcomes, 1.0))
    assert problem == "the server returned no output tokens for any request"


def test_served_problem_none_for_a_good_run() -> None:
    outcomes = _outcomes()[:3]
    assert metrics.served_problem(outcomes, compute(outcomes, DURATION)) is None
