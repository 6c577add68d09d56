"""Suite files (plan/suite.py) and their expansion into cases (plan/case.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import cases_of, suite_error, write_suite
from pydantic import ValidationError

from pytest_profllm.plan.case import Case, derived_seed, expand, gpus_needed, server_key
from pytest_profllm.plan.suite import BenchmarkConfig, SuiteError, load_suite_file

SMOKE = """\
name: smoke
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: [16, 64]
  max_model_len: 4096
benchmark:
  num_prompts: 32
  request_rate: [8, inf]
thresholds:
  completed: {min: 32}
"""


# --- expansion ----------------------------------------------------------------------------


def test_cross_product_in_server_major_order(tmp_path: Path) -> None:
    cases = cases_of(write_suite(tmp_path, SMOKE))
    assert [case.name for case in cases] == [
        "qwen3-8b-seqs16::random-rate8",
        "qwen3-8b-seqs16::random-rate-inf",
        "qwen3-8b-seqs64::random-rate8",
        "qwen3-8b-seqs64::random-rate-inf",
    ]
    assert [case.server["max_num_seqs"] for case in cases] == [16, 16, 64, 64]
    assert [serve(case).request_rate for case in cases] == [8.0, math.inf, 8.0, math.inf]


def test_cases_of_one_server_are_adjacent(tmp_path: Path) -> None:
    # Three server configs x three workloads: each server's cases must form one run.
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          max_num_seqs: [1, 2, 3]
        benchmark:
          max_concurrency: [1, 2, 3]
        """,
    )
    keys = [case.server_key for case in cases_of(path)]
    assert len(keys) == 9
    runs = [key for index, key in enumerate(keys) if index == 0 or keys[index - 1] != key]
    assert len(runs) == len(set(runs)) == 3


def test_case_fields(tmp_path: Path) -> None:
    path = write_suite(tmp_path, SMOKE)
    case = cases_of(path)[1]
    assert case.suite == "smoke"
    assert case.source == str(path)
    assert case.server_label == "qwen3-8b-seqs16"
    assert case.workload_label == "random-rate-inf"
    assert case.name == f"{case.server_label}::{case.workload_label}"
    assert case.server == {"model": "Qwen/Qwen3-8B", "max_num_seqs": 16, "max_model_len": 4096}
    assert serve(case).num_prompts == 32
    assert case.thresholds["completed"].min == 32
    assert (case.repeat_index, case.repeat_count) == (0, 1)


def test_suite_name_defaults_to_file_stem(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server: {model: m}\n", name="bench_latency.yaml")
    assert [case.suite for case in cases_of(path)] == ["latency"]


def test_no_axes_gives_one_default_labelled_case(tmp_path: Path) -> None:
    cases = cases_of(write_suite(tmp_path, "server: {model: /models/Llama-3/}\n"))
    assert [case.name for case in cases] == ["llama-3::random"]
    # Every default, but the seed: derived from the case id where the suite sets none.
    assert cases[0].benchmark == BenchmarkConfig(seed=derived_seed(cases[0].case_id))
    assert cases[0].seed_derived


def test_derived_seeds_differ_by_case_and_repeat_and_hold_across_sessions(
    tmp_path: Path,
) -> None:
    suite = write_suite(
        tmp_path,
        "server: {model: m}\nbenchmark: {random_input_len: [64, 128]}\nrepeat: 3\n",
    )
    first, again = cases_of(suite), cases_of(suite)
    seeds = [getattr(case.benchmark, "seed", None) for case in first]
    assert len(set(seeds)) == 6  # two workloads x three repeats, each its own prompts
    assert seeds == [getattr(c.benchmark, "seed", None) for c in again]  # in every session
    assert all(case.seed_derived for case in first)


def test_a_set_seed_is_honoured_as_written(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, "server: {model: m}\nbenchmark: {seed: 7}\nrepeat: 2\n")
    cases = cases_of(suite)
    assert [getattr(case.benchmark, "seed", None) for case in cases] == [7, 7]
    assert not any(case.seed_derived for case in cases)


@pytest.mark.parametrize(
    ("server_block", "bench_block", "names"),
    [
        (
            "{model: m, tensor_parallel_size: [1, 2]}",
            "{max_concurrency: [4, 16]}",
            ["m-tp1::random-conc4", "m-tp1::random-conc16",
             "m-tp2::random-conc4", "m-tp2::random-conc16"],
        ),
        (
            "{model: m, enable_prefix_caching: [true, false]}",
            "{request_rate: [0.5, inf]}",
            ["m-prefix-cache-on::random-rate0.5", "m-prefix-cache-on::random-rate-inf",
             "m-prefix-cache-off::random-rate0.5", "m-prefix-cache-off::random-rate-inf"],
        ),
        (
            "{model: [org/A, org/B]}",
            "{}",
            ["a::random", "b::random"],
        ),
        (
            "{model: m, kv_cache_dtype: [auto, fp8]}",  # no abbreviation: word initials
            "{}",
            ["m-kcd-auto::random", "m-kcd-fp8::random"],
        ),
    ],
)
def test_labels(tmp_path: Path, server_block: str, bench_block: str, names: list[str]) -> None:
    path = write_suite(tmp_path, f"server: {server_block}\nbenchmark: {bench_block}\n")
    assert [case.name for case in cases_of(path)] == names


def test_repeat_makes_numbered_cases(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path, "server: {model: m}\nbenchmark: {request_rate: [8, inf]}\nrepeat: 3\n"
    )
    cases = cases_of(path)
    assert [case.workload_label for case in cases] == [
        "random-rate8-r1", "random-rate8-r2", "random-rate8-r3",
        "random-rate-inf-r1", "random-rate-inf-r2", "random-rate-inf-r3",
    ]
    assert [case.repeat_index for case in cases] == [0, 1, 2, 0, 1, 2]
    assert {case.repeat_count for case in cases} == {3}
    assert len({case.name for case in cases}) == 6


def test_exclude_removes_exactly_matching_cases(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        SMOKE
        + """\
exclude:
  - server: {max_num_seqs: 64}
    benchmark: {request_rate: inf}
  - server: {max_num_seqs: 16}
    benchmark: {request_rate: 8}
""",
    )
    assert [case.name for case in cases_of(path)] == [
        "qwen3-8b-seqs16::random-rate-inf",
        "qwen3-8b-seqs64::random-rate8",
    ]


def test_exclude_on_server_only_drops_all_its_workloads(tmp_path: Path) -> None:
    path = write_suite(tmp_path, SMOKE + "exclude:\n  - server: {max_num_seqs: 16}\n")
    assert [case.name for case in cases_of(path)] == [
        "qwen3-8b-seqs64::random-rate8",
        "qwen3-8b-seqs64::random-rate-inf",
    ]


def test_exclude_naming_an_unknown_key_is_an_error(tmp_path: Path) -> None:
    # A typo in a rule would silently exclude nothing.
    path = write_suite(tmp_path, SMOKE + "exclude:\n  - server: {max_num_seq: 16}\n")
    with pytest.raises(SuiteError) as error:
        load_suite_file(path)
    message = str(error.value)
    assert "exclude[0].server.max_num_seq is not a key of 'server'" in message
    assert "did you mean 'max_num_seqs'?" in message
    assert "\n" not in message


def test_exclude_that_matches_nothing_keeps_everything(tmp_path: Path) -> None:
    path = write_suite(tmp_path, SMOKE + "exclude:\n  - server: {max_num_seqs: 32}\n")
    assert len(cases_of(path)) == 4


# --- server keys and GPUs -----------------------------------------------------------------


def test_equal_server_configs_share_a_server_key(tmp_path: Path) -> None:
    # Two suites with the same server block (keys in another order) and different workloads
    # can share one running server; a different value cannot.
    first = cases_of(write_suite(tmp_path, "server: {model: m, max_num_seqs: 8, dtype: half}\n",
                           name="bench_a.yaml"))
    second = cases_of(write_suite(
        tmp_path,
        "server: {dtype: half, model: m, max_num_seqs: 8}\nbenchmark: {num_prompts: [1, 2]}\n",
        name="bench_b.yaml",
    ))
    other = cases_of(write_suite(tmp_path, "server: {model: m, max_num_seqs: 9, dtype: half}\n",
                           name="bench_c.yaml"))
    assert {case.server_key for case in first + second} == {first[0].server_key}
    assert other[0].server_key != first[0].server_key


def test_server_keys_differ_per_server_config_within_a_suite(tmp_path: Path) -> None:
    cases = cases_of(write_suite(tmp_path, SMOKE))
    assert cases[0].server_key == cases[1].server_key
    assert cases[2].server_key == cases[3].server_key
    assert cases[0].server_key != cases[2].server_key
    assert cases[0].server_key == server_key(cases[0].server)


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ({"model": "m"}, 1),
        ({"model": "m", "tensor_parallel_size": 4}, 4),
        ({"model": "m", "tensor_parallel_size": 2, "pipeline_parallel_size": 3}, 6),
        (
            {"model": "m", "tensor_parallel_size": 2, "pipeline_parallel_size": 2,
             "data_parallel_size": 2},
            8,
        ),
        ({"model": "m", "data_parallel_size": 3}, 3),
        ({"model": "m", "tensor_parallel_size": None}, 1),
    ],
)
def test_gpus_needed(server: dict[str, object], expected: int) -> None:
    assert gpus_needed(server) == expected


def test_case_gpus_needed_follows_its_axis(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server: {model: m, tensor_parallel_size: [1, 2], "
                 "data_parallel_size: 2}\n")
    assert [case.gpus_needed for case in cases_of(path)] == [2, 4]


def serve(case: Case) -> BenchmarkConfig:
    """The case's workload, which is a serving one."""
    assert isinstance(case.benchmark, BenchmarkConfig)
    return case.benchmark


# --- BenchmarkConfig ----------------------------------------------------------------------


def test_request_rate_inf_from_yaml_is_float_inf_and_dumps_as_text(tmp_path: Path) -> None:
    # YAML reads `inf` as a string; the model must make it a float, and JSON has no infinity.
    path = write_suite(tmp_path, "server: {model: m}\nbenchmark: {request_rate: inf}\n")
    case = cases_of(path)[0]
    assert isinstance(serve(case).request_rate, float)
    assert math.isinf(serve(case).request_rate)
    assert case.benchmark.model_dump(mode="json")["request_rate"] == "inf"
    assert json.loads(case.benchmark.model_dump_json())["request_rate"] == "inf"


def test_finite_request_rate_dumps_as_number() -> None:
    assert BenchmarkConfig(request_rate=8).model_dump(mode="json")["request_rate"] == 8.0


def test_result_names_always_have_p95_ttft_and_tpot() -> None:
    # ProfLLM's record always carried p95 TTFT/TPOT, whatever percentiles a suite asks for.
    names = BenchmarkConfig(metric_percentiles="50,99").result_names()
    assert "p95_ttft_ms" in names
    assert "p95_tpot_ms" in names
    assert "p95_itl_ms" not in names
    assert {"p50_itl_ms", "p99_e2el_ms", "median_ttft_ms", "completed"} <= set(names)


# --- errors -------------------------------------------------------------------------------


def test_yaml_syntax_error_names_its_line(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nbenchmark:\n  num_prompts: 3: 4\n")
    message = suite_error(path)
    assert message.startswith(f"{path}:4: invalid YAML:")
    assert "mapping values are not allowed here" in message


@pytest.mark.parametrize("text", ["- server\n", "just text\n", ""])
def test_suite_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    path = write_suite(tmp_path, text)
    assert suite_error(path).startswith(f"{path}:1: a suite is a mapping")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "bench_missing.yaml"
    assert suite_error(path).startswith(f"{path}: cannot read suite:")


def test_unknown_top_level_key_suggests_and_lists_allowed(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nthresholdz:\n  completed: {min: 1}\n")
    assert suite_error(path) == (
        f"{path}:3: unknown key 'thresholdz' (did you mean 'thresholds'?); "
        "allowed: name, description, server, benchmark, thresholds, repeat, exclude, profile, "
        "regression"
    )


def test_unknown_benchmark_key_suggests_and_lists_allowed(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nbenchmark:\n  seed: 1\n  num_promts: 5\n")
    message = suite_error(path)
    assert message.startswith(
        f"{path}:5: unknown key 'benchmark.num_promts' (did you mean 'num_prompts'?); allowed: "
    )
    allowed = message.split("allowed: ")[1].split(", ")
    assert allowed == list(BenchmarkConfig.model_fields)


def test_unknown_key_without_close_match_has_no_suggestion(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nzzz: 1\n")
    message = suite_error(path)
    assert message.startswith(f"{path}:3: unknown key 'zzz'; allowed: name,")
    assert "did you mean" not in message


def test_unknown_exclusion_key_lists_exclusion_keys(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nexclude:\n  - servr: {}\n")
    assert suite_error(path) == (
        f"{path}:4: unknown key 'exclude.0.servr' (did you mean 'server'?); "
        "allowed: server, benchmark"
    )


def test_unknown_threshold_key_lists_min_and_max(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nthresholds:\n  completed: {min: 1, mx: 2}\n")
    message = suite_error(path)
    assert message.startswith(f"{path}:4: unknown key 'thresholds.completed.mx'")
    assert message.endswith("allowed: min, max")


@pytest.mark.parametrize(
    ("bench_line", "expected_parts"),
    [
        (
            "num_prompts: many",
            ["benchmark.num_prompts:", "valid integer", "(got 'many')"],
        ),
        (
            "random_range_ratio: 1.5",
            ["benchmark.random_range_ratio:", "less than 1", "(got 1.5)"],
        ),
        ("num_prompts: 0", ["benchmark.num_prompts:", "greater than 0", "(got 0)"]),
        ("request_rate: -1", ["benchmark.request_rate:", "greater than 0"]),
        ("dataset_name: mooncake", ["benchmark.dataset_name:", "'random'", "'mooncake'"]),
        ("percentile_metrics: ttft,foo", ["benchmark.percentile_metrics:", "'foo'",
                                          "allowed: ttft, tpot, itl, e2el"]),
        ("metric_percentiles: 50,100", ["benchmark.metric_percentiles:",
                                        "strictly between 0 and 100"]),
        # One bad value on an axis is reported at the axis' key.
        ("num_prompts: [10, many]", ["benchmark.num_prompts:", "(got 'many')"]),
        # Lengths no request may have (limits.py; a prompt of 10**9 tokens took 5.4 GB).
        ("random_input_len: 1000000000", ["benchmark.random_input_len:",
                                          "less than or equal to 10485760"]),
        ("conversation_output_len: 1000000000", ["benchmark.conversation_output_len:",
                                                 "less than or equal to 10485760"]),
    ],
)
def test_bad_benchmark_value(tmp_path: Path, bench_line: str, expected_parts: list[str]) -> None:
    path = write_suite(tmp_path, f"server:\n  model: m\nbenchmark:\n  seed: 1\n  {bench_line}\n")
    message = suite_error(path)
    assert message.startswith(f"{path}:5: ")
    for part in expected_parts:
        assert part in message


def test_unknown_threshold_metric_suggests_name(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        "server:\n  model: m\nthresholds:\n  completed: {min: 1}\n  median_ttft: {max: 10}\n",
    )
    message = suite_error(path)
    assert message.startswith(
        f"{path}:5: unknown metric 'thresholds.median_ttft' (did you mean 'median_ttft_ms'?); "
        "allowed: completed, failed,"
    )
    assert "p95_ttft_ms" in message


def test_threshold_on_a_percentile_the_suite_does_not_compute(tmp_path: Path) -> None:
    # p90 is only computed when metric_percentiles asks for it.
    path = write_suite(
        tmp_path,
        "server: {model: m}\nbenchmark: {metric_percentiles: '50'}\n"
        "thresholds:\n  p90_ttft_ms: {max: 10}\n",
    )
    assert suite_error(path).startswith(f"{path}:4: unknown metric 'thresholds.p90_ttft_ms'")


def test_threshold_needs_min_or_max(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nthresholds:\n  failed: {}\n")
    assert suite_error(path) == (
        f"{path}:4: thresholds.failed: a threshold needs 'min', 'max' or both"
    )


def test_missing_model(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "name: x\nserver:\n  dtype: half\n")
    message = suite_error(path)
    assert message.startswith(f"{path}:2: server: 'model' is required")


def test_missing_server_block(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "name: x\nbenchmark: {}\n")
    message = suite_error(path)
    assert message.startswith(f"{path}: server: Field required")


def test_leased_port_is_rejected(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\n  port: 8000\n")
    message = suite_error(path)
    assert "'port' is set by profllm's port lease; remove it" in message


def test_leased_host_is_rejected(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\n  host: 0.0.0.0\n")
    assert "'host' is set by profllm's port lease" in suite_error(path)


@pytest.mark.parametrize("key", ["maxNumSeqs", "max-num-seqs", "_private", "9lives"])
def test_server_key_must_be_snake_case(tmp_path: Path, key: str) -> None:
    path = write_suite(tmp_path, f"server:\n  model: m\n  {key}: 1\n")
    message = suite_error(path)
    assert f"'{key}' is not an engine argument name (snake_case" in message


@pytest.mark.parametrize("line", ["port: 8000", "MaxNumSeqs: 4"])
def test_bad_server_key_reports_its_own_line(tmp_path: Path, line: str) -> None:
    path = write_suite(tmp_path, f"server:\n  model: m\n  dtype: half\n  {line}\n")
    assert suite_error(path).startswith(f"{path}:4: ")


def test_server_error_does_not_leak_secrets(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\n  api_key: sk-secret\n  port: 8000\n")
    assert "sk-secret" not in suite_error(path)


def test_profile_is_carried_on_every_case_and_keys_its_own_servers(tmp_path: Path) -> None:
    text = "server:\n  model: m\nbenchmark:\n  num_prompts: [1, 2]\n"
    plain = expand(load_suite_file(write_suite(tmp_path, text))[0], "bench_x.yaml")
    profiled_path = write_suite(tmp_path, text + "profile: true\n", "bench_p.yaml")
    profiled = expand(load_suite_file(profiled_path)[0], "bench_p.yaml")
    assert [case.profile for case in plain + profiled] == [False, False, True, True]
    assert len({case.server_key for case in profiled}) == 1
    assert profiled[0].server_key != plain[0].server_key


def test_profile_must_be_a_boolean(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\nprofile: sometimes\n")
    assert suite_error(path) == (
        f"{path}:3: profile: Input should be a valid boolean, unable to interpret input "
        "(got 'sometimes')"
    )


def test_a_secret_axis_is_labelled_by_position(tmp_path: Path) -> None:
    # Case ids reach reports, JUnit XML and file names: never a secret's value. api_key takes
    # several keys, so its axis is a list of lists.
    path = write_suite(tmp_path, "server: {model: m, api_key: [[sk-aaa], [sk-bbb]]}\n")
    labels = [case.server_label for case in cases_of(path)]
    assert labels == ["m-ak1", "m-ak2"]


def test_a_one_value_list_is_no_axis_in_labels(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server: {model: m, served_model_name: [[a, b]]}\n")
    assert [case.server_label for case in cases_of(path)] == ["m"]


def test_thresholds_and_the_gate_may_name_the_client_overhead(tmp_path: Path) -> None:
    # docs/reference/record.md says so; the suite refused both names.
    (case, *_) = cases_of(write_suite(tmp_path, """
        server:
          model: Qwen/Qwen3-8B
        benchmark:
          num_prompts: 4
        repeat: 2
        thresholds:
          client_overhead_ttft_ms: {max: 50}
          client_overhead_e2el_ms: {max: 80}
        regression:
          client_overhead_ttft_ms: 20%
          client_overhead_e2el_ms: 20%
        """))
    assert set(case.thresholds) == {"client_overhead_ttft_ms", "client_overhead_e2el_ms"}
    assert set(case.regression) == {"client_overhead_ttft_ms", "client_overhead_e2el_ms"}
    # A capacity search's probes have no one /metrics window: it records no overhead.
    message = suite_error(write_suite(tmp_path, """
        server:
          model: Qwen/Qwen3-8B
        benchmark:
          kind: capacity
          request_rate: inf
          slo: {p99_ttft_ms: 500}
          search: {low: 1, high: 8}
        thresholds:
          client_overhead_ttft_ms: {max: 50}
        """, "bench_cap.yaml"))
    assert "unknown metric 'thresholds.client_overhead_ttft_ms'" in message


def test_client_processes_is_a_number_or_auto() -> None:
    assert BenchmarkConfig(client_processes="auto").client_processes == "auto"
    assert BenchmarkConfig(client_processes=3).client_processes == 3
    for wrong in (0, "many"):
        with pytest.raises(ValidationError):
            BenchmarkConfig(client_processes=wrong)
    # A conversation's turns wait on each other: one process, whatever `auto` would give.
    with pytest.raises(ValidationError, match="one client process"):
        BenchmarkConfig(dataset_name="conversation", backend="openai-chat",
                        client_processes="auto")
