"""`echo` and `logprobs` on the simulated engine's /v1/completions, in vLLM's shape (what
lm-eval's `local-completions` model reads to score answers), and `/tokenizer_info` with vLLM's
`--enable-tokenizer-info-endpoint`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import simulator
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.sim.logprobs import completion_logprobs

TOKEN = st.text(min_size=1, max_size=6)


def _well_formed(logprobs: dict[str, Any], echoed: int, count: int) -> None:
    tokens = logprobs["tokens"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(tokens)
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets[: len(tokens)]
    for index, (token, logprob, top) in enumerate(
        zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    ):
        if index == 0 and echoed:
            assert (logprob, top) == (None, None)  # nothing came before the first token
            continue
        assert logprob is not None and top is not None
        assert math.isfinite(logprob) and logprob <= 0
        assert top[token] == logprob
        assert len(top) <= count + 1
        assert max(top.values()) >= logprob
        assert sum(math.exp(value) for value in top.values()) <= 1 + 1e-9
        if index >= echoed:  # temperature 0: a generated token is the likeliest
            assert logprob == max(top.values())


@given(
    prompt=st.lists(TOKEN, max_size=12),
    generated=st.lists(TOKEN, max_size=4),
    count=st.integers(0, 20),
)
def test_logprobs_are_well_formed_and_the_same_for_the_same_tokens(
    prompt: list[str], generated: list[str], count: int
) -> None:
    vocabulary = ["a", " b", "c", " d", "ee"]
    logprobs = completion_logprobs(prompt, generated, count, lambda n: vocabulary[n % 5])
    _well_formed(logprobs, len(prompt), count)
    assert logprobs == completion_logprobs(prompt, generated, count, lambda n: vocabulary[n % 5])


@pytest.fixture
def sim_url(port_range: str, tmp_path: Path) -> Iterator[str]:
    first = int(port_range.split("-")[0]) + 70
    log = tmp_path / "sim.log"
    with simulator(first, log, "sim", "--enable-tokenizer-info-endpoint") as url:
        yield url


def _complete(url: str, **body: Any) -> requests.Response:
    return requests.post(url + "/v1/completions", json={"model": "sim", **body}, timeout=30)


def test_echo_with_logprobs_answers_vllms_shape_for_any_prompt(sim_url: str) -> None:
    # One simulator for every example (a process each would take minutes).
    settings(max_examples=25, deadline=None)(
        given(prompt=st.text(min_size=1, max_size=80), max_tokens=st.integers(0, 3))(
            lambda prompt, max_tokens: _check_echo(sim_url, prompt, max_tokens)
        )
    )()


def _check_echo(sim_url: str, prompt: str, max_tokens: int) -> None:
    response = _complete(sim_url, prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens)
    ids = requests.post(
        sim_url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=10
    ).json()["tokens"]
    if not ids:
        # A prompt of no tokens is refused as vLLM refuses it, never answered with an error 500.
        assert response.status_code == 400, response.text
        assert "prompt cannot be empty" in response.json()["error"]["message"]
        return
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + max_tokens
    assert choice["text"].startswith(prompt)
    _well_formed(logprobs, len(ids), 1)
    # vLLM's prompt_logprobs beside them: per prompt token id, the same figure.
    by_id = choice["prompt_logprobs"]
    assert len(by_id) == len(ids) and by_id[0] is None
    for index, (token_id, entry) in enumerate(zip(ids[1:], by_id[1:], strict=True), start=1):
        assert entry[str(token_id)]["logprob"] == logprobs["token_logprobs"][index]
        assert entry[str(token_id)]["rank"] >= 1
    again = _complete(sim_url, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert again.json()["choices"][0]["logprobs"]["token_logprobs"] == (
        logprobs["token_logprobs"][: len(ids)]
    )


def test_a_prompt_of_no_tokens_is_refused_as_vllm_refuses_it(sim_url: str) -> None:
    # Found by the property above: '\r' echoed with logprobs was an IndexError (a 500).
    for prompt in ("\r", " ", "\n\t"):
        for max_tokens in (0, 2):
            _check_echo(sim_url, prompt, max_tokens)
    assert _complete(sim_url, prompt="\r", max_tokens=2).status_code == 400


def test_logprobs_without_echo_cover_the_output_only(sim_url: str) -> None:
    choice = _complete(sim_url, prompt="2 + 2 =", logprobs=2, max_tokens=3).json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 3
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert choice["prompt_logprobs"] is None  # nothing echoed
    plain = _complete(sim_url, prompt="2 + 2 =", max_tokens=3).json()["choices"][0]
    assert plain["logprobs"] is None


def test_requests_the_simulator_cannot_answer_are_refused_with_a_reason(sim_url: str) -> None:
    no_output = _complete(sim_url, prompt="x", max_tokens=0)
    too_many = _complete(sim_url, prompt="x", logprobs=21)
    streamed = _complete(sim_url, prompt="x", echo=True, logprobs=1, stream=True)
    assert [r.status_code for r in (no_output, too_many, streamed)] == [400, 400, 400]
    assert "max_tokens must be at least 1" in no_output.json()["error"]["message"]
    assert "logprobs must be between 0 and 20" in too_many.json()["error"]["message"]
    assert "stream: false" in streamed.json()["error"]["message"]


def test_tokenizer_info_is_served_only_when_asked_as_vllm(
    sim_url: str, port_range: str, tmp_path: Path
) -> None:
    info = requests.get(sim_url + "/tokenizer_info", timeout=10)
    assert info.status_code == 200
    assert info.json()["eos_token"] == "</s>"
    first = int(port_range.split("-")[0]) + 80
    with simulator(first, tmp_path / "plain.log", "sim") as plain:
        assert requests.get(plain + "/tokenizer_info", timeout=10).status_code == 404
