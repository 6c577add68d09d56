"""Every case measures a cold server: the prefix cache emptied before each case, repeat and
capacity probe; prompts of its own per case and repeat; the cache's share over the case's
window, and the rule that makes a case invalid when it measured an earlier load's cache."""

from __future__ import annotations

import argparse
import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_invalid, run_records, run_suites, simulator

from pytest_profllm.limits import MAX_REMEASURE
from pytest_profllm.load.attempts import Attempts
from pytest_profllm.load.capacity import ServerProbes
from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.load.remeasure_budget import MIN_AGAIN_S, RemeasureBudget
from pytest_profllm.load.server_state import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    SIM_LATE_BOUNDS_MS,
    SIM_LATENESS_SUM,
    SIM_STEPS,
    cache_problem,
    empty_caches,
    own_prefix_hits,
    shared_on_purpose,
    sim_fell_behind,
    sim_late_name,
    sim_lateness,
)
from pytest_profllm.load.validity import Invalid, InvalidKind, Rules
from pytest_profllm.options import parse_remeasure
from pytest_profllm.plan.suite import BenchmarkConfig, CapacityConfig
from pytest_profllm.sim.model_files import MODEL_DIR


def window(queries: float, hits: float) -> tuple[dict[str, float], dict[str, float]]:
    before = {PREFIX_QUERIES: 1000.0, PREFIX_HITS: 900.0}
    return before, {PREFIX_QUERIES: 1000.0 + queries, PREFIX_HITS: 900.0 + hits}


def test_a_workload_that_shares_nothing_may_find_five_percent_in_the_cache() -> None:
    config = BenchmarkConfig()
    # The counters before the window (an earlier case's hits) do not count against it.
    assert cache_problem(*window(1000, 50), config) is None
    problem = cache_problem(*window(1000, 60), config)
    assert problem is not None
    assert problem.startswith("prefix cache: 6.0% of the prompt tokens were found")
    assert "60 of 1000" in problem
    # Nothing to judge: no scrape, no query.
    assert cache_problem(None, None, config) is None
    assert cache_problem(*window(0, 0), config) is None


@pytest.mark.parametrize(
    "config",
    [
        BenchmarkConfig(dataset_name="prefix_repetition"),
        BenchmarkConfig(random_prefix_len=64),
        BenchmarkConfig(warm_cache=True),
        BenchmarkConfig(dataset_name="conversation", backend="openai-chat"),
        BenchmarkConfig(dataset_name="sharegpt", dataset_path="x.json"),
    ],
)
def test_workloads_that_share_prefixes_on_purpose_are_not_judged(
    config: BenchmarkConfig,
) -> None:
    assert shared_on_purpose(config) is not None
    assert cache_problem(*window(1000, 990), config) is None


class _Routes(http.server.BaseHTTPRequestHandler):
    status = 404
    body = b""
    posted: list[str] = []  # noqa: RUF012 (one test server at a time)

    def do_POST(self) -> None:
        type(self).posted.append(self.path)
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def routes() -> Iterator[tuple[str, type[_Routes]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Routes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Routes.posted = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Routes
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_emptying_says_what_it_did(routes: tuple[str, type[_Routes]]) -> None:
    url, handler = routes
    handler.status = 200
    assert empty_caches(url, BenchmarkConfig()).describe() == "emptied before the load"
    assert handler.posted == ["/reset_prefix_cache"]
    # Media workloads empty the multimodal cache too.
    handler.posted = []
    empty_caches(url, BenchmarkConfig(dataset_name="random-mm", backend="openai-chat"))
    assert handler.posted == ["/reset_prefix_cache", "/reset_mm_cache"]
    # warm_cache keeps it: nothing is sent.
    handler.posted = []
    assert empty_caches(url, BenchmarkConfig(warm_cache=True)).describe() == (
        "kept warm (warm_cache: true)"
    )
    assert handler.posted == []
    # vLLM answers 200 with {"success": false} when running requests hold blocks.
    handler.body = b'{"success": false}'
    state = empty_caches(url, BenchmarkConfig())
    assert state.describe() == (
        "not emptied: POST /reset_prefix_cache: the server could not empty it "
        "(requests still running)"
    )
    handler.body = b'{"success": true}'
    assert empty_caches(url, BenchmarkConfig()).state == "emptied"
    # A server without the route (vLLM outside its development mode) says why, in one line.
    handler.status = 404
    state = empty_caches(url, BenchmarkConfig())
    assert state.state == "not emptied"
    assert "VLLM_SERVER_DEV_MODE=1" in state.describe()


SHARED_SERVER_SUITE = """
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: 16
benchmark:
  num_prompts: 24
  random_input_len: [256, 192]
  random_output_len: 4
  request_rate: 40
repeat: 3
"""


def test_cases_on_one_server_measure_a_cold_cache(pytester: pytest.Pytester, ports: str) -> None:
    """Two random workloads x three repeats on one server with prefix caching on (the
    default): the 192-token prompts would be prefixes of the 256-token ones and every repeat
    would re-send its prompts, were the seed and the cache not each case's own."""
    pytester.makefile(".yaml", bench_shared=SHARED_SERVER_SUITE)
    result = run_suites(pytester, ports, "-n", "0")
    result.assert_outcomes(passed=6)
    written = run_records(pytester)
    assert len({r["runtime"]["server_started_at"] for r in written}) == 1  # one server
    seeds = {r["runtime"]["prompt_seed"] for r in written}
    assert len(seeds) == 6
    for record in written:
        system = record["system"]
        assert system["server_prefix_cache_queries"] > 0
        assert system["server_prefix_cache_hit_rate"] <= 0.05, record["case_id"]
        assert record["runtime"]["prefix_cache"] == "emptied before the load"
        assert record["runtime"]["prompt_seed_derived"] is True
        assert record["validity"] == "valid"
        # A busy host may have a load measured again (for its own reasons, all the host's);
        # the cache is never the reason, and every run of it started from an emptied cache.
        for attempt in record["attempts"]:
            assert InvalidKind.CACHE.value not in attempt["reason_kinds"], attempt
            assert all(InvalidKind(kind).host_caused for kind in attempt["reason_kinds"])


def test_warm_cache_keeps_what_earlier_cases_left(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(
        ".yaml",
        bench_warm="""
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 8
  random_input_len: 128
  random_output_len: 4
  seed: 3
  warm_cache: true
repeat: 2
""",
    )
    result = run_suites(pytester, ports, "-n", "0")
    result.assert_outcomes(passed=2)
    by_repeat = sorted(run_records(pytester), key=lambda r: r["repeat_index"])
    assert [r["runtime"]["prefix_cache"] for r in by_repeat] == [
        "kept warm (warm_cache: true)"
    ] * 2
    # The second repeat sends the first's prompts (a set seed) and finds them cached.
    assert by_repeat[1]["system"]["server_prefix_cache_hit_rate"] > 0.5
    assert by_repeat[1]["validity"] == "valid"  # warm on purpose: not judged


PACED_SUITE = """
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 4
  request_rate: 50
"""


def test_a_load_the_host_made_invalid_is_measured_again(
    pytester: pytest.Pytester, ports: str
) -> None:
    """A schedule-lag limit no client can keep: every attempt is invalid for the host's
    sake, so the load runs 1 + 2 times, each attempt is kept, and the case says why."""
    pytester.makefile(
        ".yaml",
        bench_lag=PACED_SUITE,
    )
    result = run_suites(pytester, ports, "-n", "0", "--profllm-max-schedule-lag", "0.0001")
    assert_invalid(result, 1)
    (record,) = run_records(pytester)
    assert record["status"] == "invalid"
    assert [a["attempt"] for a in record["attempts"]] == [1, 2, 3]
    assert all(a["validity"] == "invalid" for a in record["attempts"])
    assert record["runtime"]["attempts"] == 3
    reason = record["validity_reasons"][0]
    assert reason.startswith("attempt 1: client fell behind")
    assert "attempt 3: client fell behind" in reason


def test_remeasure_zero_gives_one_attempt(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(
        ".yaml",
        bench_lag=PACED_SUITE,
    )
    result = run_suites(
        pytester, ports, "-n", "0", "--profllm-max-schedule-lag", "0.0001",
        "--profllm-remeasure", "0",
    )
    assert_invalid(result, 1)
    (record,) = run_records(pytester)
    assert len(record["attempts"]) == 1
    assert record["validity_reasons"][0].startswith("client fell behind")


def test_attempts_measure_again_only_for_the_host_and_keep_each() -> None:
    attempts = Attempts(remeasure=2)
    behind = [Invalid(InvalidKind.CLIENT_FELL_BEHIND,
                      "client fell behind: p99 schedule lag 31 ms is over 10 ms")]
    attempts.add(0.0, behind, {"request_throughput": 5.0}, {}, "emptied before the load")
    assert attempts.again(behind)
    attempts.add(1.0, [], {"request_throughput": 6.0}, {}, "emptied before the load")
    assert not attempts.again([])  # the first valid attempt ends it
    assert attempts.invalid_reason([]) is None
    assert [a["validity"] for a in attempts.kept] == ["invalid", "valid"]
    assert attempts.kept[1]["request_throughput"] == 6.0
    # A server's miscount is not the host's: another run would miscount again.
    miscount = Invalid(InvalidKind.TOKEN_COUNTS, "token counts disagree: ...")
    assert not Attempts(2).again([miscount])
    assert not Attempts(2).again([*behind, miscount])
    # Runs out after 1 + remeasure attempts, and then names every attempt's reasons.
    spent = Attempts(remeasure=1)
    late = [Invalid(InvalidKind.SIMULATOR_LATENESS,
                    "the simulated engine fell behind by 20 ms or more on 3.0% of its 100 steps")]
    spent.add(0.0, behind, {}, {}, None)
    assert spent.again(behind)
    spent.add(1.0, late, {}, {}, None)
    assert not spent.again(late)
    assert spent.invalid_reason(late) == f"attempt 1: {behind[0]}; attempt 2: {late[0]}"
    assert [a["reason_kinds"] for a in spent.kept] == [["client_fell_behind"],
                                                        ["simulator_lateness"]]


def late_counters(steps: float, late_over: dict[int, float]) -> dict[str, float]:
    counters = {SIM_STEPS: steps, SIM_LATENESS_SUM: 0.001 * steps}
    for bound in SIM_LATE_BOUNDS_MS:
        counters[sim_late_name(bound)] = late_over.get(bound, 0.0)
    return counters


def test_the_simulated_engines_lateness_over_a_load() -> None:
    before = late_counters(1000, {1: 500, 2: 100, 5: 50, 10: 40, 20: 30})  # an earlier load's
    after = late_counters(2000, {1: 900, 2: 150, 5: 80, 10: 70, 20: 55, 50: 5})
    figures = sim_lateness(before, after)
    assert figures["sim_steps"] == 1000
    # Over this load's 1,000 steps: 30 over 10 ms, 25 over 20 ms, 5 over 50 ms (0.5 %).
    assert figures["sim_step_lateness_p99_ms"] == 50
    assert sim_fell_behind(before, after, 10) == (
        "the simulated engine fell behind by 20 ms or more on 2.5% of its 1000 steps "
        "(host busy)"
    )
    assert sim_fell_behind(before, after, 50) is None  # 0.5 % of steps over 50 ms: within
    # Two late steps are over 1 % of a short load's 40, but one hiccup makes two: not enough.
    short = late_counters(40, {1: 10, 2: 5, 5: 3, 10: 2, 20: 2})
    assert sim_fell_behind({}, short, 10) is None
    short[sim_late_name(10)] = 3.0
    assert sim_fell_behind({}, short, 10) is not None
    # Not the simulated engine (no step counters), or no answer: nothing to judge.
    assert sim_fell_behind({}, {"vllm:num_requests_running": 0.0}, 10) is None
    assert sim_fell_behind(None, after, 10) is None
    assert sim_lateness(None, None)["sim_steps"] is None


def test_capacity_probe_runs_start_cold_with_prompts_of_their_own(
    port_range: str, tmp_path: Path
) -> None:
    """Two runs of one probe load against one server: different prompts, each from an
    emptied cache, so neither finds the other's prompts."""
    config = CapacityConfig.model_validate({
        "kind": "capacity", "num_prompts": 12, "random_input_len": 128,
        "random_output_len": 4, "slo": {"median_ttft_ms": 10_000}, "seed": 11,
    })
    codec = TokenizerCodec.load(str(MODEL_DIR))
    first_port = int(port_range.split("-")[0]) + 60
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with simulator(first_port, tmp_path / "sim.log", "sim", env=env) as url:
        first = make_prompts(config, codec)
        probes = ServerProbes(config, url, codec, first, "sim", None,
                              Rules(max_schedule_lag_ms=1000.0))
        assert probes.prompts_for(12, config.seed) == first
        assert probes.prompts_for(12, config.seed + 1) != first
        for seed in (config.seed, config.seed + 1, config.seed):
            probes(8.0, 12, seed)
            _, _, _, (before, after), judged = probes.measured[8.0]
            assert InvalidKind.CACHE not in {reason.kind for reason in judged.reasons}
            assert cache_problem(before, after, config) is None
            assert before is not None and after is not None
            assert after[PREFIX_QUERIES] > before[PREFIX_QUERIES]
            # The third run re-sends the first's prompts: only the emptied cache keeps it cold.
            assert after[PREFIX_HITS] - before[PREFIX_HITS] <= 0.05 * (
                after[PREFIX_QUERIES] - before[PREFIX_QUERIES]
            )
    assert probes.cache_states == {"emptied before the load"}


def test_what_a_workloads_prompts_share_with_each_other_is_allowed_for() -> None:
    block = list(range(16))
    prompts = [
        [*block, *block, 99],  # two full blocks, the last token apart: none to find yet
        [*block, *block, 98],  # finds both of the first's blocks
        [*block, 7] + [0] * 15,  # finds the first block only
        [5] * 40,  # shares nothing
    ]
    assert own_prefix_hits(prompts) == 32 + 16
    # 6 % found in all, 5 % of it the prompts' own: 1 % beyond them, within the 5 %.
    assert cache_problem(*window(1000, 60), BenchmarkConfig(), own_hits=50) is None
    problem = cache_problem(*window(1000, 120), BenchmarkConfig(), own_hits=50)
    assert problem is not None and "50 of them its prompts share with each other" in problem


def test_runs_again_stop_once_they_took_as_long_as_the_first_runs() -> None:
    # A host that stays busy: every attempt is invalid for its sake. The session's runs again
    # may take as long as its first runs, then the next case is not measured again, and its
    # reason says why.
    budget = RemeasureBudget()
    behind = [Invalid(InvalidKind.CLIENT_FELL_BEHIND,
                      "client fell behind: p99 schedule lag 31 ms is over 10 ms")]
    first = Attempts(remeasure=10, budget=budget)
    first.add(time.time() - 100.0, behind, {}, {}, None)  # a first run of 100 s
    assert first.again(behind)
    first.add(time.time() - 101.0, behind, {}, {}, None)  # a run again of 101 s: spent
    assert not first.again(behind)
    assert first.invalid_reason(behind) is not None
    assert "re-measuring stopped" in first.invalid_reason(behind)  # type: ignore[operator]
    later = Attempts(remeasure=10, budget=budget)
    later.add(time.time() - 2.0, behind, {}, {}, None)  # its first run adds 2 s to the budget
    assert later.again(behind)


def test_a_short_sessions_runs_again_have_a_floor() -> None:
    # Loads of 2 s (real vLLM's 2 x 2 suite): one run again of 2 s would have used the whole
    # budget. Under MIN_AGAIN_S the runs go on; past it they stop, saying so.
    budget = RemeasureBudget()
    behind = [Invalid(InvalidKind.CLIENT_FELL_BEHIND,
                      "client fell behind: p99 schedule lag 10.3 ms is over 10 ms")]
    attempts = Attempts(remeasure=10, budget=budget)
    attempts.add(time.time() - 2.0, behind, {}, {}, None)
    attempts.add(time.time() - 2.0, behind, {}, {}, None)
    assert attempts.again(behind)
    budget.spent(MIN_AGAIN_S, again=True)
    assert not attempts.again(behind)
    assert f"its floor of {MIN_AGAIN_S:.0f} s" in (attempts.invalid_reason(behind) or "")


@pytest.mark.parametrize("count", ["11", "1000000", "9" * 5000, "-1", "٣"])
def test_remeasure_over_its_bound_is_a_usage_error_naming_it(count: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=str(MAX_REMEASURE)):
        parse_remeasure(count)
    assert parse_remeasure(str(MAX_REMEASURE)) == MAX_REMEASURE
