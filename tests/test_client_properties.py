"""The client against a generated misbehaving server: truncated, stalled and cut
streams, error events, lines that are not JSON, lying, negative or string usage, and error
statuses. Whatever the server does, no exception escapes the client, and a request completes
only if its stream ended normally; a count that is not a count is never believed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from helpers import serve_handler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_profllm.load import bench, metrics
from pytest_profllm.load.bench import run_load
from pytest_profllm.load.dataset import PromptRequest
from pytest_profllm.load.schedule import LoadSettings

TIMEOUT_S = 0.5


@pytest.fixture(autouse=True, scope="module")
def _no_collection_before_each_load() -> Iterator[None]:
    # run_load collects the whole process's garbage before each load (load/bench.py,
    # `_objects_frozen`): a tenth of a second in a pytest process, most of this module's time
    # over its examples. How a request's ending is read does not depend on it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "_objects_frozen", contextlib.nullcontext)
        yield


@dataclass(frozen=True)
class Step:
    kind: str  # content, usage, error, junk, done
    text: str = ""
    finish: bool = False
    count: Any = 0  # usage's completion_tokens, as the server sends it


content = st.builds(
    Step, st.just("content"), st.text(max_size=3), st.booleans(), st.just(0)
)
usage = st.builds(
    Step,
    st.just("usage"),
    st.just(""),
    st.just(False),
    st.one_of(
        st.integers(-5, 40), st.text(max_size=3), st.none(), st.booleans(), st.floats(-1, 40)
    ),
)
others = st.sampled_from([Step("error"), Step("junk"), Step("done")])
steps = st.lists(st.one_of(content, content, usage, others), max_size=8)
statuses = st.sampled_from([200, 200, 200, 400, 500, 503])
endings = st.sampled_from(["eof", "eof", "close", "stall"])


def _bytes(step: Step) -> bytes:
    if step.kind == "content":
        choice = {"index": 0, "text": step.text, "finish_reason": "length" if step.finish else None}
        return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
    if step.kind == "usage":
        body = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": step.count}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"
    if step.kind == "error":
        return b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    if step.kind == "junk":
        return b"data: <html>502 Bad Gateway</html>\n\n"
    return b"data: [DONE]\n\n"


def _expected(status: int, script: list[Step], ending: str) -> tuple[bool, bool]:
    """(completes, a usage count that is not a count was sent before the stream broke)."""
    if status != 200:
        return False, False
    messages, ended, bad_usage = 0, False, False
    for step in script:
        if step.kind in ("error", "junk"):
            return False, bad_usage
        if step.kind == "content":
            messages += 1
            ended = ended or step.finish
        elif step.kind == "done":
            ended = True
        elif step.kind == "usage":
            count = step.count
            bad_usage = bad_usage or not (
                isinstance(count, int) and not isinstance(count, bool) and count >= 0
            )
    return ending == "eof" and messages > 0 and ended, bad_usage


async def _one_request(status: int, script: list[Step], ending: str) -> metrics.RequestOutcome:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status != 200:
            return web.json_response({"error": {"message": "no", "code": status}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for step in script:
            await response.write(_bytes(step))
        if ending == "stall":
            await asyncio.sleep(TIMEOUT_S * 4)
        elif ending == "close" and request.transport is not None:
            request.transport.close()
            return response
        await response.write_eof()
        return response

    async with serve_handler(handler, shutdown_timeout=0.1) as url:
        settings_ = LoadSettings(base_url=url, model="m", request_timeout_s=TIMEOUT_S)
        load = await run_load(settings_, [PromptRequest("hi", 3, 4)])
        return load.outcomes[0]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(status=statuses, script=steps, ending=endings)
def test_a_request_completes_only_on_a_normal_end(
    status: int, script: list[Step], ending: str
) -> None:
    outcome = asyncio.run(_one_request(status, script, ending))
    completes, bad_usage = _expected(status, script, ending)
    assert outcome.success == completes, (outcome.error, status, script, ending)
    if not outcome.success:
        assert outcome.error  # every failed request says why
    elif bad_usage:
        problem = metrics.token_problem(outcome, ignore_eos=False)
        assert problem is not None and "not a count" in problem
    if outcome.output_tokens is not None:
        assert isinstance(outcome.output_tokens, int) and outcome.output_tokens >= 0
