"""Every number that enters is finite, and suites have limits: a non-finite
threshold, goodput or sampling value, a YAML alias bomb, a key given twice and a matrix of
millions are each one line naming the file (and line), refused before anything expands.
Generated suites are collected or refused with such a line, never with another exception."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import cases_of, suite_error, write_suite
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.plan.case import MAX_CASES, expand
from pytest_profllm.plan.suite import SuiteError, load_suite_file

BASE = "server:\n  model: Qwen/Qwen3-0.6B\nbenchmark:\n  num_prompts: 4\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("thresholds:\n  completed: {min: .nan}\n",
         "bench_x.yaml:6: thresholds.completed.min: Input should be a finite number"),
        ("thresholds:\n  p99_ttft_ms: {max: .inf}\n",
         "bench_x.yaml:6: thresholds.p99_ttft_ms.max: Input should be a finite number"),
        ("  goodput: {ttft: .inf}\n",
         "bench_x.yaml:5: benchmark.goodput.ttft: Input should be a finite number"),
        ("  temperature: .inf\n",
         "bench_x.yaml:5: benchmark.temperature: Input should be a finite number"),
        ("  request_timeout_s: .inf\n",
         "bench_x.yaml:5: benchmark.request_timeout_s: Input should be a finite number"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_with_its_line(
    tmp_path: Path, extra: str, message: str
) -> None:
    with pytest.raises(SuiteError) as error:
        cases_of(write_suite(tmp_path, BASE + extra))
    assert message in str(error.value)


def test_an_infinite_request_rate_still_means_all_at_once(tmp_path: Path) -> None:
    assert len(cases_of(write_suite(tmp_path, BASE + "  request_rate: .inf\n"))) == 1


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        # Before: collected, and the case slept for the first gap of 1e300 s (forever).
        ("1e-300", "bench_x.yaml:3: benchmark: request_rate: 4 requests at 1e-300 req/s would "
         "take about 1.11e+297 h, past the 24 h a load may last"),
        ("0.00001", "4 requests at 1e-05 req/s would take about 111 h"),
        ("0.0001", None),  # 4 requests in about 11 h: slow, but a load a user may mean
    ],
)
def test_a_rate_whose_schedule_runs_past_a_day_is_one_line(
    tmp_path: Path, rate: str, message: str | None
) -> None:
    path = write_suite(tmp_path, BASE + f"  request_rate: {rate}\n")
    _collected_or_refused_in_one_line(path, message)


def _collected_or_refused_in_one_line(path: Path, message: str | None) -> None:
    """`path` expands to its one case (message None), or is refused in one line holding
    `message`."""
    if message is None:
        assert len(cases_of(path)) == 1
        return
    with pytest.raises(SuiteError) as error:
        cases_of(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    rows = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for name, previous in zip("bcdefghi", "abcdefgh", strict=True):
        rows.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    text = "\n".join(rows) + "\nserver: {model: m, seed: *i}\nbenchmark: {num_prompts: 1}\n"
    started = time.monotonic()
    with pytest.raises(SuiteError, match="expands to more than 100,000 values through YAML"):
        cases_of(write_suite(tmp_path, text))
    assert time.monotonic() - started < 2  # before: 4 GB and a MemoryError


def test_a_key_given_twice_names_both_lines(tmp_path: Path) -> None:
    text = BASE + "thresholds:\n  completed: {min: 4}\n  completed: {min: 1}\n"
    with pytest.raises(SuiteError) as error:
        cases_of(write_suite(tmp_path, text))
    assert str(error.value) == (
        f"{tmp_path / 'bench_x.yaml'}:7: key 'completed' appears twice in one mapping "
        "(first at line 6): YAML would keep the last alone"
    )


def test_a_matrix_over_the_cap_is_one_line_before_expanding(tmp_path: Path) -> None:
    values = list(range(1, 101))
    text = (
        f"server:\n  model: m\n  max_num_seqs: {values}\n  seed: {values}\n"
        f"benchmark:\n  num_prompts: {values}\nrepeat: 2\n"
    )
    started = time.monotonic()
    with pytest.raises(SuiteError) as error:
        cases_of(write_suite(tmp_path, text))
    assert time.monotonic() - started < 2  # before: over 60 s and 3.6 GB
    assert str(error.value).endswith(
        "bench_x.yaml: 2,000,000 cases (server.max_num_seqs 100 x server.seed 100 x "
        f"benchmark.num_prompts 100 x repeat 2) is over the limit of {MAX_CASES:,}; raise it "
        "with --profllm-max-cases (ini: profllm_max_cases)"
    )


def test_the_cap_can_be_raised(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path, "server:\n  model: m\n  seed: [1, 2, 3]\nbenchmark:\n  num_prompts: 1\n"
    )
    suite, lines = load_suite_file(path)
    with pytest.raises(SuiteError, match="3 cases"):
        expand(suite, str(path), lines, max_cases=2)
    assert len(expand(suite, str(path), lines, max_cases=3)) == 3


# Generated suites: known keys with values of any type, unknown keys, non-finite numbers,
# axes (lists), aliases and repeated keys, written as YAML text.
KEYS = ["model", "max_num_seqs", "seed", "tensor_parallel_size", "num_prompts",
        "request_rate", "random_input_len", "temperature", "goodput", "completed", "bogus"]
scalars = st.one_of(
    st.integers(-3, 100), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.text(max_size=5), st.none(),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(KEYS), inner, max_size=3), max_leaves=12,
)


def _yaml_value(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix(
        "\n..."
    ).removesuffix("...").strip()


@st.composite
def suite_texts(draw: st.DrawFn) -> str:
    blocks = []
    for block in ("server", "benchmark", "thresholds", draw(st.sampled_from(["exclude", "x"]))):
        entries = draw(st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=4))
        if block == "server" and draw(st.booleans()):
            entries.insert(0, ("model", "Qwen/Qwen3-0.6B"))
        lines = [f"  {key}: {_yaml_value(value)}" for key, value in entries]
        if draw(st.booleans()) and lines:
            lines.append(lines[0])  # a key given twice
        blocks.append(f"{block}:\n" + ("\n".join(lines) if lines else "  {}"))
    if draw(st.booleans()):
        blocks.insert(0, "anchor: &big [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]")
        blocks.append("repeat: 1")
    return "\n".join(blocks) + "\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=suite_texts())
def test_a_generated_suite_is_collected_or_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    path = tmp_path_factory.mktemp("suite") / "bench_gen.yaml"
    path.write_text(text)
    try:
        suite, lines = load_suite_file(path)
        expand(suite, str(path), lines)
    except SuiteError as error:
        message = str(error)
        assert message.startswith(str(path)), message
        assert "Traceback" not in message


CAPACITY = (
    "server:\n  model: sim-8b\nbenchmark:\n  kind: capacity\n  num_prompts: 4\n"
    "  slo: {p99_ttft_ms: 500}\n"
)


@pytest.mark.parametrize(
    ("search", "message"),
    [
        # Before: the search ran, and died with a ZeroDivisionError traceback (or hung).
        ("{low: 1e-300}", "bench_x.yaml:7: benchmark.search: search.low: a request_rate "
         "search starts at 0.001 req/s or more (one request every 1000 s), got 1e-300"),
        ("{low: 0.0001, high: 0.0002}", "search.low: a request_rate search starts at 0.001"),
        ("{high: 1e300}", "bench_x.yaml:7: benchmark.search: a probe at search.high would "
         "send 1e+301 requests (search.high x search.min_duration_s), over the limit of "
         "1,000,000"),
        ("{min_duration_s: 1e300}", "(search.high x search.min_duration_s), over the limit"),
        ("{over: max_concurrency, high: 1e200}", "(10 x search.high), over the limit"),
        ("{low: 0}", "benchmark.search.low: Input should be greater than 0"),
        ("{precision: 1e-300%}", None),  # a tiny precision stops at max_probes: allowed
    ],
)
def test_a_search_that_divides_by_almost_nothing_is_one_line(
    tmp_path: Path, search: str, message: str | None
) -> None:
    path = write_suite(tmp_path, CAPACITY + f"  search: {search}\n")
    _collected_or_refused_in_one_line(path, message)


def test_search_problems_are_reported_together(tmp_path: Path) -> None:
    path = write_suite(tmp_path, CAPACITY + "  search: {low: 1e-9, high: 1e-10}\n")
    with pytest.raises(SuiteError) as error:
        cases_of(path)
    assert "must lie below search.high" in str(error.value)
    assert "starts at 0.001 req/s" in str(error.value)


def test_every_bad_tolerance_of_the_gate_is_reported(tmp_path: Path) -> None:
    text = BASE + "regression:\n  p99_ttft_ms: 150%\n  mean_tpot_ms: abc\n  capacity: 5%\n"
    with pytest.raises(SuiteError) as error:
        cases_of(write_suite(tmp_path, text))
    assert error.value.problems == [
        f"{tmp_path / 'bench_x.yaml'}:6: regression: p99_ttft_ms: a tolerance is a percentage "
        "from 0% to under 100%, got '150%'",
        f"{tmp_path / 'bench_x.yaml'}:7: regression: mean_tpot_ms: a tolerance is a percentage "
        "like '5%', got 'abc'",
    ]


# Generated `regression:` and `search:` sections: tolerances and search numbers of every
# size and sign (tiny, huge, zero, negative, NaN), as numbers, percentages or other types.
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e300, -1.0, 1.0, 0.5, 200.0, 1e6]),
    st.integers(-10, 10**7),
)
tolerance_values = st.one_of(
    numbers, numbers.map(lambda n: f"{n}%"), st.none(), st.booleans(), st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)
GATED = ["p99_ttft_ms", "mean_tpot_ms", "output_throughput", "capacity", "p0_itl_ms",
         "p100.5_e2el_ms", "bogus", "1"]
SEARCH_KEYS = ["over", "low", "high", "precision", "max_probes", "max_time_s",
               "min_duration_s", "confidence", "max_extension", "confirm", "bogus"]
search_values = st.one_of(
    numbers, numbers.map(lambda n: f"{n}%"), st.sampled_from(["request_rate", "max_concurrency"]),
    st.none(), st.booleans(),
)


@st.composite
def gated_suite_texts(draw: st.DrawFn) -> str:
    text = CAPACITY if draw(st.booleans()) else BASE
    if text is CAPACITY and draw(st.booleans()):
        search = draw(st.dictionaries(st.sampled_from(SEARCH_KEYS), search_values, max_size=5))
        text += f"  search: {{{', '.join(f'{k}: {_yaml_value(v)}' for k, v in search.items())}}}\n"
    if draw(st.booleans()):
        text += f"repeat: {draw(st.integers(-1, 3))}\n"
    block = draw(st.one_of(
        st.dictionaries(st.sampled_from(GATED), tolerance_values, max_size=4),
        st.lists(st.sampled_from(GATED) | st.integers() | st.lists(st.text(max_size=2)),
                 max_size=3),
        numbers, st.none(),
    ))
    if isinstance(block, dict):
        rows = [f"  {key}: {_yaml_value(value)}" for key, value in block.items()]
        text += "regression:\n" + ("\n".join(rows) if rows else "  {}") + "\n"
    else:
        text += f"regression: {_yaml_value(block)}\n"
    return text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=gated_suite_texts())
def test_a_generated_gate_or_search_is_collected_or_refused_in_one_line(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    path = tmp_path_factory.mktemp("suite") / "bench_gen.yaml"
    path.write_text(text)
    try:
        suite, lines = load_suite_file(path)
        cases = expand(suite, str(path), lines)
    except SuiteError as error:
        for problem in error.problems:
            assert problem.startswith(str(path)) and "\n" not in problem, problem
            assert "Traceback" not in problem
        return
    for case in cases:
        for tolerance in case.regression.values():
            assert 0 <= tolerance < 1
        search = getattr(case.benchmark, "search", None)
        if search is not None:
            assert search.low < search.high
            assert math.isfinite(search.low) and math.isfinite(search.high)


def test_a_server_argument_longer_than_exec_takes_is_one_line(tmp_path: Path) -> None:
    # A 10 MB value passed the suite's checks and ended, at the server's start, in a traceback
    # of 1,530 lines (OSError: Argument list too long): Linux takes 128 KiB per argument.
    # 1 MB is well over it too; reading 10 MB of YAML took most of this test's time.
    from pytest_profllm.limits import MAX_ARGUMENT_BYTES

    def suite(name: str, size: int) -> Path:
        return write_suite(tmp_path, "server:\n  model: Qwen/Qwen3-0.6B\n"
                           f"  served_model_name: {'x' * size}\n"
                           "benchmark:\n  num_prompts: 4\n", name)

    assert cases_of(suite("bench_fits.yaml", MAX_ARGUMENT_BYTES))
    message = suite_error(suite("bench_long.yaml", 1_000_000))
    assert message.startswith(f"{tmp_path}/bench_long.yaml:3: server.served_model_name: ")
    assert message.removeprefix(f"{tmp_path}/").startswith(
        "bench_long.yaml:3: server.served_model_name: a value of 1,000,000 bytes on the "
        "server's command line: Linux takes at most 131,071 bytes per argument")
    assert len(message) < 600  # the value is not repeated whole
    assert suite_error(suite("bench_just_over.yaml", MAX_ARGUMENT_BYTES + 1))
