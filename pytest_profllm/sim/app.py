"""The simulated engine's HTTP server: the parts of vLLM's OpenAI-compatible API that
benchmarks use, with vLLM's response shapes and error bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pytest_profllm.sim.instruments import ProfilerSettings, add_routes
from pytest_profllm.sim.scheduler import Scheduler


@dataclass
class SimState:
    served_names: list[str]
    root: str
    max_model_len: int
    tokenizer: Any  # tokenizers.Tokenizer
    words: list[str]  # vocabulary of ordinary (non-special) tokens, for generated text
    api_key: str | None


_SCHEDULER = web.AppKey("scheduler", Scheduler)
_STATE = web.AppKey("state", SimState)


def build_app(
    state: SimState, scheduler: Scheduler, profiler: ProfilerSettings | None = None
) -> web.Application:
    app = web.Application(middlewares=[_auth])
    app[_STATE] = state
    app[_SCHEDULER] = scheduler
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    add_routes(app, scheduler, state.served_names[0], profiler or ProfilerSettings())
    app.cleanup_ctx.append(_step_loop)
    return app


async def _step_loop(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[_SCHEDULER].run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@web.middleware
async def _auth(request: web.Request, handler: Any) -> web.StreamResponse:
    # vLLM checks the key on /v1 routes only.
    key = request.app[_STATE].api_key
    if (
        key
        and request.path.startswith("/v1")
        and request.headers.get("Authorization") != f"Bearer {key}"
    ):
        return web.json_response({"error": "Unauthorized"}, status=401)
    response: web.StreamResponse = await handler(request)
    return response


def _error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    created = int(time.time())
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": state.root,
            "parent": None,
            "max_model_len": state.max_model_len,
        }
        for name in state.served_names
    ]
    return web.json_response({"object": "list", "data": data})


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as error:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"message": f"invalid JSON: {error}", "code": 400}}),
            content_type="application/json",
        ) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error": {"message": "expected a JSON object"}}')
    return body


def _check_model(state: SimState, body: dict[str, Any]) -> web.Response | None:
    model = body.get("model")
    if model is not None and model not in state.served_names:
        return _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
    return None


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return _error("'prompt' must be a string", 400)
    add_special = bool(body.get("add_special_tokens", True))
    encoding = state.tokenizer.encode(prompt, add_special_tokens=add_special)
    response: dict[str, Any] = {
        "count": len(encoding.ids),
        "max_model_len": state.max_model_len,
        "tokens": encoding.ids,
        "token_strs": encoding.tokens if body.get("return_token_strs") else None,
    }
    return web.json_response(response)


async def _detokenize(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return _error("'tokens' must be a list of integers", 400)
    return web.json_response({"prompt": state.tokenizer.decode(tokens, skip_special_tokens=False)})


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    scheduler = request.app[_SCHEDULER]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        prompt_ids = prompt
    elif isinstance(prompt, str):
        prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=False).ids
    else:
        return _error("'prompt' must be a string or a list of token ids", 400)
    prompt_len = len(prompt_ids)
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(f"max_tokens must be at least 1, got {max_tokens}.", 400)
    if prompt_len + max_tokens > state.max_model_len:
        return _error(
            f"This model's maximum context length is {state.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            400,
        )
    model = body.get("model") or state.served_names[0]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sequence = scheduler.submit(prompt_len, max_tokens, prompt_ids)
    if not body.get("stream"):
        text = []
        while (token := await sequence.tokens.get()) is not None:
            text.append(_word(state, token))
        return web.json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(text),
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "usage": _usage(prompt_len, len(text)),
            }
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    created = int(time.time())
    generated = 0
    try:
        while (token := await sequence.tokens.get()) is not None:
            generated += 1
            finish = "length" if generated == max_tokens else None
            chunk = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": _word(state, token),
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
            }
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if include_usage:
            usage: dict[str, Any] = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(prompt_len, generated),
            }
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        scheduler.cancel(sequence)
        raise
    return response


def _word(state: SimState, token: int) -> str:
    return " " + state.words[token % len(state.words)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
