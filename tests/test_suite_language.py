"""The suite language as users write it: list values of list-valued arguments, every error at
once, numbers in quotes, dotted keys and the types inside config arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cases_of, write_suite

from pytest_profllm.engine.command import serve_command
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import SuiteError


def errors_of(path: Path) -> list[str]:
    with pytest.raises(SuiteError) as error:
        cases_of(path)
    assert str(error.value).splitlines() == error.value.problems
    return error.value.problems


def argv_of(case: Case) -> list[str]:
    return serve_command("vllm", case.server, "127.0.0.1", 20000)


def flag_values(argv: list[str], flag: str) -> list[str]:
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


# --- list-valued arguments -------------------------------------------------------------------


def test_a_flat_list_is_the_value_of_an_argument_that_takes_a_list(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          cudagraph_capture_sizes: [1, 2, 4, 8]
          served_model_name: [a, b]
        """,
    )
    [case] = cases_of(path)  # one server, not four
    assert case.server["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    assert case.server_label == "m"  # no axis, nothing in the id
    assert case.axis_values == ()
    argv = argv_of(case)
    assert flag_values(argv, "--cudagraph-capture-sizes") == ["1", "2", "4", "8"]
    assert flag_values(argv, "--served-model-name") == ["a", "b"]


def test_a_list_of_lists_is_an_axis_of_list_values(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        "server: {model: m, cudagraph_capture_sizes: [[1, 2], [1, 2, 4, 8]]}\n",
    )
    cases = cases_of(path)
    assert [case.server["cudagraph_capture_sizes"] for case in cases] == [[1, 2], [1, 2, 4, 8]]
    assert [case.server_label for case in cases] == ["m-ccs-1_2", "m-ccs-1_2_4_8"]
    assert [case.axis_values for case in cases] == [
        (("server.cudagraph_capture_sizes", [1, 2]),),
        (("server.cudagraph_capture_sizes", [1, 2, 4, 8]),),
    ]


def test_a_plain_item_among_lists_is_a_value_of_one(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server: {model: m, served_model_name: [a, [b, c]]}\n")
    assert [case.server["served_model_name"] for case in cases_of(path)] == ["a", ["b", "c"]]


def test_a_list_of_a_scalar_argument_is_still_an_axis(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server: {model: m, max_num_seqs: [8, 16]}\n")
    assert [case.server["max_num_seqs"] for case in cases_of(path)] == [8, 16]


def test_a_json_list_argument_takes_a_yaml_list(tmp_path: Path) -> None:
    # --allowed-origins takes a JSON list; a YAML list is that list.
    path = write_suite(tmp_path, 'server: {model: m, allowed_origins: ["http://localhost"]}\n')
    [case] = cases_of(path)
    assert case.server["allowed_origins"] == ["http://localhost"]
    assert flag_values(argv_of(case), "--allowed-origins") == ['["http://localhost"]']


def test_a_json_list_argument_refuses_items_of_the_wrong_type(tmp_path: Path) -> None:
    path = write_suite(tmp_path, "server:\n  model: m\n  allowed_origins: [1]\n")
    assert errors_of(path) == [
        f"{path}:3: server.allowed_origins[0]: Input should be a valid string (got 1)"
    ]


# --- every error at once ---------------------------------------------------------------------

THREE_MISTAKES = """\
server:
  model: m
  max_num_seqz: 16
  gpu_memory_utilization: high
benchmark:
  num_prompts: 0
thresholds:
  median_ttft: {max: 5}
"""


def test_every_error_of_a_suite_is_reported_at_once_in_line_order(tmp_path: Path) -> None:
    path = write_suite(tmp_path, THREE_MISTAKES)
    problems = errors_of(path)
    assert [problem.split(": ")[0] for problem in problems] == [
        f"{path}:3",
        f"{path}:4",
        f"{path}:6",
        f"{path}:8",
    ]
    assert "server.max_num_seqz: unknown engine argument" in problems[0]
    assert "(did you mean 'max_num_seqs'?)" in problems[0]
    assert problems[1].endswith("server.gpu_memory_utilization: takes a number (got 'high')")
    assert problems[2].endswith("benchmark.num_prompts: Input should be greater than 0 (got 0)")
    assert "unknown metric 'thresholds.median_ttft' (did you mean 'median_ttft_ms'?)" in (
        problems[3]
    )


def test_every_error_is_one_collection_error_with_a_line_each(
    pytester: pytest.Pytester,
) -> None:
    pytester.makefile(".yaml", bench_bad=THREE_MISTAKES)
    result = pytester.runpytest_inprocess("--collect-only")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting bench_bad.yaml*",
            "bench_bad.yaml:3: server.max_num_seqz: unknown engine argument*",
            "bench_bad.yaml:4: server.gpu_memory_utilization: takes a number (got 'high')",
            "bench_bad.yaml:6: benchmark.num_prompts: Input should be greater than 0 (got 0)",
            "bench_bad.yaml:8: unknown metric 'thresholds.median_ttft'*",
        ]
    )


def test_cross_field_rules_report_each_broken_combination_once(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          max_num_seqs: 64
          max_num_batched_tokens: 32
          data_parallel_size: 1
          data_parallel_size_local: 2
        """,
    )
    problems = errors_of(path)
    assert len(problems) == 1  # the first rule that a combination breaks, as vLLM stops there
    assert problems[0] == (
        f"{path}:4: server: max_num_batched_tokens (32) must be at least max_num_seqs (64)"
    )


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        # An unclosed bracket: YAML stops on a later line; the mistake is where it opened.
        (
            "server:\n  model: m\n  max_num_seqs: [16, 64\nbenchmark:\n  num_prompts: 8\n",
            3,
            "invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence "
            "that began at line 3; YAML stopped at line 4)",
        ),
        # A key without its colon reads on into the next line.
        (
            "server:\n  model m\n  max_num_seqs: 4\n",
            2,
            "invalid YAML: expected 'key: value', found no ':' on this line (YAML read it on "
            "into line 3)",
        ),
        # An unclosed quote.
        (
            'server:\n  model: "m\n  max_num_seqs: 4\n',
            2,
            "invalid YAML: found unexpected end of stream (while scanning a quoted scalar "
            "that began at line 2; YAML stopped at line 4)",
        ),
        # A key indented less than its siblings.
        (
            "server:\n  model: x\n bad: 1\n",
            3,
            "invalid YAML: expected <block end>, but found '<block mapping start>'*",
        ),
    ],
)
def test_a_yaml_syntax_error_points_at_the_mistake(
    tmp_path: Path, text: str, line: int, says: str
) -> None:
    import fnmatch

    path = write_suite(tmp_path, text)
    [problem] = errors_of(path)
    assert fnmatch.fnmatchcase(problem, f"{path}:{line}: {says}"), problem


# --- numbers in quotes -----------------------------------------------------------------------


def test_numbers_in_quotes_are_read_as_vllms_parser_reads_them(tmp_path: Path) -> None:
    quoted = write_suite(
        tmp_path,
        """\
        server:
          model: m
          max_num_seqs: "16"
          gpu_memory_utilization: "0.85"
          max_num_batched_tokens: "4k"
          cudagraph_capture_sizes: ["1", "2"]
        """,
    )
    plain = write_suite(
        tmp_path,
        """\
        server:
          model: m
          max_num_seqs: 16
          gpu_memory_utilization: 0.85
          max_num_batched_tokens: 4k
          cudagraph_capture_sizes: [1, 2]
        """,
        name="bench_plain.yaml",
    )
    [case] = cases_of(quoted)
    assert case.server["max_num_seqs"] == 16
    assert case.server["gpu_memory_utilization"] == 0.85
    assert case.server["cudagraph_capture_sizes"] == [1, 2]
    assert case.server_key == cases_of(plain)[0].server_key  # the same server


def test_what_vllms_parser_refuses_in_quotes_stays_an_error(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        'server:\n  model: m\n  max_num_seqs: "16.0"\n  gpu_memory_utilization: "most"\n'
        "  enforce_eager: \"true\"\n",
    )
    assert errors_of(path) == [
        f"{path}:3: server.max_num_seqs: takes an integer (got '16.0')",
        f"{path}:4: server.gpu_memory_utilization: takes a number (got 'most')",
        f"{path}:5: server.enforce_eager: takes true or false (got 'true')",
    ]


def test_an_exclusion_compares_quoted_numbers_as_numbers(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server: {model: m, max_num_seqs: [8, 16]}
        exclude:
          - server: {max_num_seqs: "16"}
        """,
    )
    assert [case.server["max_num_seqs"] for case in cases_of(path)] == [8]


# --- dotted keys and types inside config arguments --------------------------------------------


def test_a_dotted_key_sets_one_field_of_a_config_argument(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          compilation_config: {cudagraph_capture_sizes: [1, 2]}
          compilation_config.mode: 3
        """,
    )
    [case] = cases_of(path)
    assert case.server["compilation_config"] == {"cudagraph_capture_sizes": [1, 2], "mode": 3}
    assert "compilation_config.mode" not in case.server
    argv = argv_of(case)
    assert json.loads(flag_values(argv, "--compilation-config")[0]) == {
        "cudagraph_capture_sizes": [1, 2],
        "mode": 3,
    }
    # The same server as the mapping written whole.
    whole = write_suite(
        tmp_path,
        "server: {model: m, compilation_config: {cudagraph_capture_sizes: [1, 2], mode: 3}}\n",
        name="bench_whole.yaml",
    )
    assert case.server_key == cases_of(whole)[0].server_key


def test_a_dotted_key_is_an_axis_by_its_fields_type(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          compilation_config.mode: [0, 3]
          compilation_config.cudagraph_capture_sizes: [1, 2, 4]
        """,
    )
    cases = cases_of(path)
    assert [case.server["compilation_config"] for case in cases] == [
        {"mode": 0, "cudagraph_capture_sizes": [1, 2, 4]},
        {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]},
    ]
    assert [case.server_label for case in cases] == ["m-cc.mode0", "m-cc.mode3"]


def test_config_values_are_checked_against_vllms_config_classes(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        """\
        server:
          model: m
          compilation_config: {cudagraph_capture_sizes: [1, x], dynamic_shapes_config: {typo: 1}}
          compilation_config.levle: 3
          compilation_config.compile_mm_encoder: maybe
          max_num_seqs.x: 1
          structured_outputs_config: {backend: nope}
        """,
    )
    assert errors_of(path) == [
        f"{path}:3: server.compilation_config: cudagraph_capture_sizes[1]: Input should be a "
        "valid integer, unable to parse string as an integer (got 'x')",
        f"{path}:4: server.compilation_config.levle: 'levle' is not a field of "
        "CompilationConfig (got 3)",
        f"{path}:5: server.compilation_config.compile_mm_encoder: Input should be a valid "
        "boolean, unable to interpret input (got 'maybe')",
        f"{path}:6: server.max_num_seqs.x: max_num_seqs is not a JSON argument: it takes no "
        "dotted keys (got 1)",
        f"{path}:7: server.structured_outputs_config: backend: Input should be 'auto', "
        "'xgrammar', 'guidance', 'outlines' or 'lm-format-enforcer' (got 'nope')",
    ]


def test_a_nested_config_refuses_unknown_fields(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path,
        "server:\n  model: m\n  compilation_config: {dynamic_shapes_config: {typo: 1}}\n",
    )
    assert errors_of(path) == [
        f"{path}:3: server.compilation_config: dynamic_shapes_config.typo: not a field of "
        "DynamicShapesConfig"
    ]


OUTSIDE_SUITE = """\
server:
  model: sim-m
benchmark:
  num_prompts: 4
  random_input_len: 16
  random_output_len: 4
"""


def test_a_suite_outside_the_rootdir_is_named_in_its_node_ids(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Given by its own path, pytest's id for such a file is "": "::sim-m::random".
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "bench_out.yaml"
    elsewhere.write_text(OUTSIDE_SUITE)
    (pytester.path / "root").mkdir()
    rootdir = ("--rootdir", str(pytester.path / "root"))
    result = pytester.runpytest_inprocess("--collect-only", "-q", *rootdir, str(elsewhere))
    result.stdout.fnmatch_lines(["bench_out.yaml::sim-m::random"])
    # Under the current directory but outside the rootdir: the path from here.
    (pytester.path / "suites").mkdir()
    (pytester.path / "suites" / "bench_in.yaml").write_text(OUTSIDE_SUITE)
    result = pytester.runpytest_inprocess(
        "--collect-only", "-q", *rootdir, str(pytester.path / "suites" / "bench_in.yaml"),
    )
    result.stdout.fnmatch_lines(["suites/bench_in.yaml::sim-m::random"])
