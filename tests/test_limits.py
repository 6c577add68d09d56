"""limits.py: a depth- and size-checked JSON read that never recurses per level,
and the pixel limit of an image."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.limits import (
    MAX_IMAGE_PIXELS,
    MAX_JSON_DEPTH,
    InputLimitError,
    check_pixels,
    load_json,
    read_gzip_lines,
)


def nested(depth: int, inner: str = "") -> str:
    return "[" * depth + inner + "]" * depth


def test_nesting_up_to_the_limit_is_read_and_one_more_is_refused() -> None:
    assert load_json(nested(MAX_JSON_DEPTH), what="x") is not None
    with pytest.raises(InputLimitError, match=r"^x nests JSON deeper than 64 levels$"):
        load_json(nested(MAX_JSON_DEPTH + 1), what="x")


@pytest.mark.parametrize("text", [
    nested(100_000),  # orjson refuses it; Python's json recursed into a RecursionError
    nested(100_000, "NaN"),  # NaN: read by Python's json, after the scan
    '{"a": NaN, "b": ' + nested(2_000) + "}",
    "[NaN, " + "[" * 100_000,  # not even JSON: still refused for its depth, not a traceback
])
def test_deep_nesting_is_refused_without_recursion(text: str) -> None:
    with pytest.raises(InputLimitError, match="nests JSON deeper than 64 levels"):
        load_json(text, what="f.json")


def test_brackets_inside_strings_do_not_nest() -> None:
    data = ["[" * 200, '\\"[[' * 50, {"k]": "{" * 100}]
    # NaN makes orjson refuse the text: the linear scan then judges its depth.
    assert load_json("[NaN, " + json.dumps(data) + "]", what="x")[1] == data


def test_size_over_the_limit_is_refused_before_parsing() -> None:
    with pytest.raises(InputLimitError, match=r"^x is 11 bytes, more than the 10 read$"):
        load_json(b"[1,2,3,4,5]", what="x", max_bytes=10)


def test_not_json_is_a_value_error_of_its_own() -> None:
    with pytest.raises(ValueError) as caught:
        load_json("{", what="x")
    assert not isinstance(caught.value, InputLimitError)


def test_pixels_over_the_limit_are_refused() -> None:
    check_pixels(8000, 8000, what="img")
    with pytest.raises(InputLimitError, match=r"^img is 8001x8000 pixels, more than the "):
        check_pixels(8001, 8000, what="img")
    assert MAX_IMAGE_PIXELS == 8000 * 8000


json_text = st.recursive(
    st.sampled_from(["1", "-2.5e300", "NaN", "Infinity", '"a[b"', '"\\\\"', "null", "1" * 30]),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
        st.lists(inner, max_size=3).map(
            lambda items: "{" + ",".join(f'"k{n}":{v}' for n, v in enumerate(items)) + "}"),
        st.integers(1, 3000).map(lambda depth: nested(depth)),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(json_text, st.text(max_size=40), json_text.map(lambda t: t[: len(t) // 2])))
def test_any_text_is_a_value_or_one_value_error(text: str) -> None:
    try:
        value: Any = load_json(text, what="x")
    except InputLimitError as error:
        assert str(error).startswith("x ")
    except ValueError:
        pass  # not JSON: the caller names it
    else:
        # What is read is what Python's json reads (orjson reads integers beyond 64 bits as
        # floats).
        expected = json.loads(text, parse_int=_as_orjson_reads)
        assert json.dumps(value) == json.dumps(expected)


def _as_orjson_reads(digits: str) -> int | float:
    number = int(digits)
    return number if -(2**63) <= number < 2**64 else float(number)


def test_a_gzip_bomb_is_refused_before_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: gzip.decompress held the whole expansion (a few MB of gzip, terabytes of zeros).
    monkeypatch.setattr("pytest_profllm.limits.MAX_REQUEST_FILE_BYTES", 1 << 20)
    path = tmp_path / "r.requests.jsonl.gz"
    path.write_bytes(gzip.compress(b"{}\n" * (1 << 20)))  # 3 MB of lines from 3 KB
    with pytest.raises(InputLimitError, match=r"^r.requests.jsonl.gz decompresses to more "
                       r"than the 1,048,576 bytes read$"):
        read_gzip_lines(path)


def test_a_line_over_the_limit_is_refused_with_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pytest_profllm.limits.MAX_JSON_LINE_BYTES", 100)
    path = tmp_path / "r.requests.jsonl.gz"
    path.write_bytes(gzip.compress(b"{}\n" + b"[" + b"0," * 1000 + b"0]\n"))
    with pytest.raises(InputLimitError, match=r"^r.requests.jsonl.gz:2 is more than the 100 "):
        read_gzip_lines(path)


def test_gzip_lines_within_the_limits_are_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.requests.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"a": 1}\n{"b": 2}'))
    assert read_gzip_lines(path) == [b'{"a": 1}\n', b'{"b": 2}']
    path.write_bytes(b"not gzip")
    with pytest.raises(OSError):
        read_gzip_lines(path)
