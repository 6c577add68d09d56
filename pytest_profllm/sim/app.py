"""The simulated engine's HTTP server: the parts of vLLM's OpenAI-compatible API that
benchmarks use, with vLLM's response shapes and error bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

import pytest_profllm
from pytest_profllm.sim.audio import AudioError, AudioFacts, wav_seconds
from pytest_profllm.sim.batching import Scheduler, Sequence
from pytest_profllm.sim.faults import Faults
from pytest_profllm.sim.instruments import add_dev_routes, add_routes
from pytest_profllm.sim.logprobs import MAX_LOGPROBS, completion_logprobs, prompt_logprobs
from pytest_profllm.sim.profiler_config import ProfilerSettings
from pytest_profllm.sim.spans import SpanExporter
from pytest_profllm.sim.vision import (
    ImageError,
    VisionFacts,
    image_ids,
    image_size,
    video_frames,
)

log = logging.getLogger("profllm.sim")


@dataclass
class SimState:
    served_names: list[str]
    root: str
    max_model_len: int
    tokenizer: Any  # tokenizers.Tokenizer
    words: list[str]  # vocabulary of ordinary (non-special) tokens, for generated text
    api_key: str | None = field(repr=False)  # a secret: never in a traceback
    # Opt-in (PROFLLM_SIM_EMISSION_LOG): when each content message left, to check clients' timing.
    emissions: EmissionLog | None = None
    # --otlp-traces-endpoint: each finished request's `llm_request` span (sim/spans.py).
    spans: SpanExporter | None = None
    # The API server's own latency before a request reaches the engine (cost model's figure).
    request_delay_s: float = 0.0
    faults: Faults = field(default_factory=Faults)
    requests_seen: int = 0
    fault_rng: random.Random = field(default_factory=lambda: random.Random(0))
    # vLLM's --enable-prompt-tokens-details: usage says how many prompt tokens were cached.
    prompt_tokens_details: bool = False
    # A vision-language model's image rule (sim/vision.py); None: images are refused.
    vision: VisionFacts | None = None
    # An audio-language model's clip rule (sim/audio.py); None: audio is refused.
    audio: AudioFacts | None = None
    # vLLM's --runner: "generate" serves completions and chat, "pooling" embeddings and rerank.
    runner: str = "generate"
    hidden_size: int = 64  # a pooling model's embedding width
    # VLLM_SERVER_DEV_MODE: vLLM's development routes (/reset_prefix_cache, ...) are served.
    dev_mode: bool = False
    # vLLM's --enable-tokenizer-info-endpoint: GET /tokenizer_info answers the tokenizer's
    # configuration (what lm-eval's remote tokenizer reads); None: 404, as vLLM without it.
    tokenizer_info: dict[str, Any] | None = None
    # vLLM's --lora-modules (with --enable-lora): adapter name -> path (sim/lora.py).
    adapters: dict[str, str] = field(default_factory=dict)


class EmissionLog:
    """One JSON line per streamed request: its `x-request-id`, when its stream began
    (`received`) and when each content message was written, in seconds on the host's
    monotonic clock (`perf_counter`, which every process on the host shares), so a client's
    own timestamps can be compared; and its `timeline` as the engine stamped it for vLLM's
    histograms (arrived, queued, scheduled, first_token, last_token), on the same clock."""

    def __init__(self, path: str) -> None:
        # Line-buffered: a reader sees each request as soon as its stream ended.
        self._handle = open(path, "a", buffering=1)  # noqa: SIM115 (closed at cleanup)

    def add(
        self,
        request: web.Request,
        received: float,
        emitted: list[float],
        sequence: Sequence | None = None,
    ) -> None:
        line: dict[str, Any] = {
            "request_id": request.headers.get("x-request-id"),
            "received": received,
            "emitted": emitted,
        }
        if sequence is not None:
            line["timeline"] = {
                "arrived": sequence.arrived,
                "queued": sequence.queued,
                "scheduled": sequence.scheduled_at,
                "first_token": sequence.first_token_at,
                "last_token": sequence.last_token_at,
            }
        self._handle.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._handle.close()


def emission_log_from_env() -> EmissionLog | None:
    path = os.environ.get("PROFLLM_SIM_EMISSION_LOG")
    return EmissionLog(path) if path else None


_SCHEDULER = web.AppKey("scheduler", Scheduler)
_STATE = web.AppKey("state", SimState)


def build_app(
    state: SimState, scheduler: Scheduler, profiler: ProfilerSettings | None = None
) -> web.Application:
    # No body limit (aiohttp's default is 1 MiB), as vLLM's server has none: a request with
    # a few large images or a video's frames inline runs to megabytes.
    app = web.Application(middlewares=[_auth, _faults], client_max_size=1 << 40)
    # Every answer says which engine gave it, so a client (`profllm bench`) records the
    # simulator as the simulator, never as vLLM.
    app.on_response_prepare.append(_identify)
    app[_STATE] = state
    app[_SCHEDULER] = scheduler
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    # As vLLM: a generating runner serves completions and chat, a pooling runner embeddings
    # and rerank; the other routes are not there (404).
    if state.runner == "pooling":
        # numpy draws the embeddings (`_vector`): loaded now, before the step loop runs, and
        # only for a pooling model (it was about 0.05 s of every server's start).
        importlib.import_module("numpy")
        app.router.add_post("/v1/embeddings", _embeddings)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, _rerank)
    else:
        app.router.add_post("/v1/completions", _completions)
        app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    if state.tokenizer_info is not None:
        app.router.add_get("/tokenizer_info", _tokenizer_info)
    add_routes(app, scheduler, state.served_names[0], profiler or ProfilerSettings())
    if state.dev_mode:  # as vLLM: without it, 404
        add_dev_routes(app, scheduler)
    app.cleanup_ctx.append(_step_loop)
    if state.emissions is None:
        state.emissions = emission_log_from_env()
    if state.emissions is not None:
        app.on_cleanup.append(_close_emissions)
    return app


async def _close_emissions(app: web.Application) -> None:
    emissions = app[_STATE].emissions
    if emissions is not None:
        emissions.close()


async def _step_loop(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[_SCHEDULER].run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


ENGINE_HEADER = "X-Profllm-Engine"


async def _identify(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[ENGINE_HEADER] = f"sim {pytest_profllm.__version__}"


async def _version(request: web.Request) -> web.Response:
    # vLLM's /version answers {"version": ...}: the simulator's is the package's.
    return web.json_response({"version": pytest_profllm.__version__})


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


_FAULT_NUMBER = "profllm_request_number"


@web.middleware
async def _faults(request: web.Request, handler: Any) -> web.StreamResponse:
    """Faults on demand (`faults.py`) that concern requests: counted in arrival order."""
    state = request.app[_STATE]
    faults = state.faults
    if faults and request.method == "POST" and request.path.startswith("/v1/"):
        state.requests_seen += 1
        request[_FAULT_NUMBER] = state.requests_seen
        if faults.die_after is not None and state.requests_seen > faults.die_after:
            # As vLLM's EngineCore dying under the API server: the process goes, mid-load.
            log.error(
                "EngineCore encountered a fatal error. EngineDeadError: EngineCore "
                "encountered an issue. (simulated fault die_after=%d)",
                faults.die_after,
            )
            os._exit(1)
        if faults.error_rate and state.fault_rng.random() < faults.error_rate:
            return _error(
                "EngineCore encountered an issue. See stack trace for the root cause. "
                "(simulated fault error_rate)",
                500,
                "InternalServerError",
            )
    response: web.StreamResponse = await handler(request)
    return response


def _error(
    message: str, status: int, kind: str = "BadRequestError", param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


async def _health(request: web.Request) -> web.Response:
    # vLLM answers 503 while its engine is not healthy.
    return web.Response(status=503 if request.app[_STATE].faults.never_healthy else 200)


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
            "permission": [_permission(created)],
        }
        for name in state.served_names
    ]
    # As vLLM's: each adapter after the base model, its path as root and the base as parent.
    data += [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": path,
            "parent": state.served_names[0],
            "max_model_len": None,
            "permission": [_permission(created)],
        }
        for name, path in state.adapters.items()
    ]
    return web.json_response({"object": "list", "data": data})


def _permission(created: int) -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


# Fields vLLM's responses carry (0.32.0, 0.33.0) that the simulator has no value for: present
# and null, so that clients reading them see vLLM's shape.
_COMPLETION_FIELDS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
_SYSTEM_FINGERPRINT = "vllm-sim"


def _too_long(state: SimState, prompt_len: int, max_tokens: int) -> web.Response | None:
    """vLLM's 400 for a request over max_model_len: the prompt alone, or with its output."""
    limit = state.max_model_len
    if prompt_len >= limit:
        body = {
            "error": {
                "message": f"This model's maximum context length is {limit} tokens. However, "
                f"your prompt contains at least {prompt_len} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={prompt_len})",
                "type": "BadRequestError",
                "param": "input_tokens",
                "code": 400,
            }
        }
        return web.json_response(body, status=400)
    if prompt_len + max_tokens > limit:
        return _error(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.",
            400,
        )
    return None


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
    if model is not None and model not in state.served_names and model not in state.adapters:
        # vLLM's words (0.32.0 and 0.33.0, its serving engine): the base names, not adapters.
        aliases = ", ".join(state.served_names)
        return _error(
            f"The model `{model}` does not exist. Valid aliases: {aliases}.",
            404, "NotFoundError", "model",
        )
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


async def _tokenizer_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[_STATE].tokenizer_info)


async def _detokenize(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        return _error("'tokens' must be a list of integers", 400)
    vocab = state.tokenizer.get_vocab_size()
    if any(not 0 <= t < vocab for t in tokens):
        # As vLLM: an id outside the vocabulary is a bad request, not an empty string.
        return _error(f"Token id {max(tokens)} is out of vocabulary (size {vocab})", 400)
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
    if not prompt_ids:
        # As vLLM: a prompt of no tokens (whitespace alone, to this tokenizer) is refused, not
        # scored; echoing it indexed an empty list.
        return _error("The decoder prompt cannot be empty", 400)
    prompt_len = len(prompt_ids)
    echo, logprobs = bool(body.get("echo")), body.get("logprobs")
    max_tokens = body.get("max_tokens", 16)
    # As vLLM: no output at all only makes sense when the prompt is echoed (scoring a prompt).
    least = 0 if echo else 1
    if not isinstance(max_tokens, int) or max_tokens < least:
        return _error(f"max_tokens must be at least {least}, got {max_tokens}.", 400)
    if logprobs is not None and (
        not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS
    ):
        return _error(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}.", 400)
    if (echo or logprobs is not None) and body.get("stream"):
        # The simulator's own limit, said rather than answered in a shape vLLM never sends.
        return _error("the simulated engine answers echo and logprobs with stream: false", 400)
    if (too_long := _too_long(state, prompt_len, max_tokens)) is not None:
        return too_long
    model = body.get("model") or state.served_names[0]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    # A prompt scored with no output still costs its prefill: the engine runs one step for it.
    sequence = await _submit(
        state, scheduler, prompt_len, max(max_tokens, 1), prompt_ids, adapter=_adapter(state, model)
    )
    if not body.get("stream"):
        text = []
        while (token := await sequence.tokens.get()) is not None:
            text.append(_word(state, token))
        _span(request, sequence)
        text = text[:max_tokens]
        echoed = [state.tokenizer.decode([i]) for i in prompt_ids] if echo else None
        prompt_text = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids)
        scores = None
        if logprobs is not None:
            scores = completion_logprobs(echoed, text, logprobs, _alternative(state))
        return web.json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": (prompt_text if echo else "") + "".join(text),
                        "logprobs": scores,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "token_ids": None,
                        # As vLLM: an echoed prompt's logprobs also come per token id.
                        "prompt_logprobs": None
                        if scores is None or not echo
                        else prompt_logprobs(prompt_ids, scores),
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": _SYSTEM_FINGERPRINT,
                "usage": _usage(prompt_len, len(text), _cached(state, sequence), details=True),
                **_COMPLETION_FIELDS,
            }
        )
    received = time.perf_counter()
    created = int(time.time())
    envelope = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def event(text: str, finish: str | None) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        return {**envelope, "choices": [choice]}

    return await _stream(request, body, sequence, (prompt_len, max_tokens), received, event)


async def _stream(
    request: web.Request,
    body: dict[str, Any],
    sequence: Any,
    lengths: tuple[int, int],
    received: float,
    event: Any,
    opening: dict[str, Any] | None = None,
) -> web.StreamResponse:
    """One SSE message per generated token (`event(text, finish_reason)`), then the usage chunk
    when asked for, then [DONE]; when each message left goes to the emission log."""
    state = request.app[_STATE]
    prompt_len, max_tokens = lengths
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    generated = 0
    emitted: list[float] = []
    try:
        if opening is not None:
            await response.write(_sse(opening))
        number = request.get(_FAULT_NUMBER)
        short = state.faults.short_stream == number and number is not None
        while (token := await sequence.tokens.get()) is not None:
            generated += 1
            cut = short and generated == 2
            finish = "length" if generated == max_tokens or cut else None
            message = _sse(event(_word(state, token), finish))
            emitted.append(time.perf_counter())  # handed to the socket now
            await response.write(message)
            if cut:
                request.app[_SCHEDULER].cancel(sequence)
                log.warning("short_stream: request %d finishes after 2 tokens", number)
                break
            if generated == 1 and state.faults.in_stream(number):
                await _fault_in_stream(request, response, sequence)
        if include_usage:
            usage = event("", None)
            claimed = _claimed_usage(
                state.faults, prompt_len, generated, _cached(state, sequence)
            )
            usage.update(choices=[], usage=claimed)
            usage.pop("prompt_token_ids", None)  # chat's opening fields stay in the opening
            usage.pop("prompt_text", None)
            usage["system_fingerprint"] = _SYSTEM_FINGERPRINT
            await response.write(_sse(usage))
        await response.write(b"data: [DONE]\n\n")
    except _StreamEnded:
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[_SCHEDULER].cancel(sequence)
        raise
    if state.emissions is not None:
        timed = sequence if isinstance(sequence, Sequence) else None
        state.emissions.add(request, received, emitted, timed)
    _span(request, sequence)
    return response


def _span(request: web.Request, sequence: Any, pooled: bool = False) -> None:
    """The finished request's `llm_request` span, where spans are exported (sim/spans.py):
    streamed or not, generated or pooled (one per input, all of the request's trace)."""
    state = request.app[_STATE]
    if state.spans is not None and isinstance(sequence, Sequence):
        headers = request.headers
        scheduler = request.app[_SCHEDULER]
        state.spans.finished(sequence, headers.get("traceparent"),
                             headers.get("x-request-id", ""), pooled=pooled,
                             idle=not scheduler.running and not scheduler.waiting)


async def _submit(
    state: SimState,
    scheduler: Scheduler,
    prompt_len: int,
    max_tokens: int,
    prompt_ids: list[int] | None,
    encoder_flops: float = 0.0,
    adapter: str | None = None,
) -> Sequence:
    """Hand the request to the engine after the API server's own latency (template, tokens);
    its arrival, for vLLM's queue and TTFT histograms, is when it came in."""
    arrived = scheduler.clock()
    if state.request_delay_s:
        await asyncio.sleep(state.request_delay_s)
    return scheduler.submit(
        prompt_len, max_tokens, prompt_ids, arrived=arrived, encoder_flops=encoder_flops,
        adapter=adapter,
    )


def _adapter(state: SimState, model: str) -> str | None:
    """The LoRA adapter a request's model names; None: the base model."""
    return model if model in state.adapters else None


async def _fault_in_stream(
    request: web.Request, response: web.StreamResponse, sequence: Sequence
) -> None:
    """After the first token: stall this stream for good, cut it, send an error event (and
    end it, as vLLM does) or a line that is not JSON (and go on) (faults.py)."""
    faults, number = request.app[_STATE].faults, request.get(_FAULT_NUMBER)
    if number == faults.junk_line:
        log.warning("junk_line: request %d gets a line that is not JSON", number)
        await response.write(b"data: <html>502 Bad Gateway</html>\n\n")
        return
    if number == faults.error_event:
        log.warning("error_event: request %d gets an error event", number)
        request.app[_SCHEDULER].cancel(sequence)
        error = {"message": "simulated fault error_event", "type": "InternalServerError"}
        body = {"error": {**error, "param": None, "code": 500}}
        await response.write(_sse(body) + b"data: [DONE]\n\n")
        raise _StreamEnded
    request.app[_SCHEDULER].cancel(sequence)
    if number == faults.stall_request:
        log.warning("stall_request: request %d stalls after its first token", number)
        # Until the client gives up and closes the connection: aiohttp does not cancel a
        # handler whose client left, and one still waiting held the server's shutdown (SIGTERM)
        # until the runner's SIGKILL, 15 s later.
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.1)
        raise ConnectionResetError("simulated fault stall_request: the client closed it")
    log.warning("close_request: request %d's stream is cut after its first token", number)
    if request.transport is not None:
        request.transport.close()
    raise ConnectionResetError("simulated fault close_request")


class _StreamEnded(Exception):
    """The stream was ended by a fault: nothing more is written to it."""


def _claimed_usage(
    faults: Faults, prompt_len: int, generated: int, cached: int | None
) -> dict[str, object]:
    """The usage chunk, as the faults would have it lie."""
    usage: dict[str, object] = dict(_usage(prompt_len, generated, cached))
    if faults.usage_claims is not None:
        usage["completion_tokens"] = faults.usage_claims
    if faults.usage_text:
        usage["completion_tokens"] = str(generated)
    return usage


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    """vLLM's chat endpoint: the messages' text is the prompt (no chat template in the
    simulator); the stream opens with a role-only delta, then one content delta per token."""
    state = request.app[_STATE]
    scheduler = request.app[_SCHEDULER]
    received = time.perf_counter()
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error("'messages' must be a non-empty list", 400)
    try:
        prompt_ids, encoder_flops = _render_chat(state, messages)
    except ImageError as error:
        return _error(str(error), 400)
    prompt_len = len(prompt_ids)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(f"max_completion_tokens must be at least 1, got {max_tokens}.", 400)
    if (too_long := _too_long(state, prompt_len, max_tokens)) is not None:
        return too_long
    model = body.get("model") or state.served_names[0]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    sequence = await _submit(
        state, scheduler, prompt_len, max_tokens, prompt_ids, encoder_flops,
        adapter=_adapter(state, model),
    )

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        # As vLLM: the opening (role) delta carries the prompt fields, a content delta its
        # token ids, and the last one its stop reason.
        choice: dict[str, Any] = {
            "index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
        }
        if "role" not in delta:
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        message = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if "role" in delta:
            message.update(prompt_token_ids=None, prompt_text=None)
        return message

    if not body.get("stream"):
        text = []
        while (token := await sequence.tokens.get()) is not None:
            text.append(_word(state, token))
        _span(request, sequence)
        message = {
            "role": "assistant",
            "content": "".join(text),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": _SYSTEM_FINGERPRINT,
                "usage": _usage(prompt_len, len(text), _cached(state, sequence), details=True),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                **_COMPLETION_FIELDS,
            }
        )
    return await _stream(
        request,
        body,
        sequence,
        (prompt_len, max_tokens),
        received,
        lambda text, finish: chunk({"content": text}, finish),
        opening=chunk({"role": "assistant", "content": ""}, None),
    )


async def _pooled(request: web.Request, texts: list[Any]) -> list[int]:
    """Each input priced as a prefill (a pooling model runs its prompt once and emits
    nothing): submitted together, answered when the last prefill is done; their token counts.
    A long input is cut to max_model_len, as vLLM's `truncate_prompt_tokens: -1` asks. As
    vLLM, each input is an engine request of its own: a span each, of the request's trace."""
    state, scheduler = request.app[_STATE], request.app[_SCHEDULER]
    lengths = []
    for text in texts:
        if isinstance(text, list):  # token ids
            count = len(text)
        else:
            count = len(state.tokenizer.encode(str(text), add_special_tokens=True).ids)
        lengths.append(max(1, min(count, state.max_model_len)))
    sequences = [await _submit(state, scheduler, n, 1, None) for n in lengths]
    for sequence in sequences:
        while await sequence.tokens.get() is not None:
            pass
        _span(request, sequence, pooled=True)
    return lengths


def _vector(text: object, width: int) -> list[float]:
    """A unit vector that depends only on the input: the same text, the same embedding. Drawn
    with numpy: the handler runs on the step loop's thread, and a vector of a thousand Python
    draws per input made the loop's steps end late (vLLM's API server builds its responses in
    another process than its engine)."""
    import numpy as np  # loaded by build_app for a pooling model

    seed = int.from_bytes(hashlib.sha256(repr(text).encode()).digest()[:8])
    values = np.random.default_rng(seed).standard_normal(width)
    norm = float(np.linalg.norm(values)) or 1.0
    rounded: list[float] = np.round(values / norm, 6).tolist()
    return rounded


async def _embeddings(request: web.Request) -> web.Response:
    """vLLM's /v1/embeddings: one vector per input (a string, token ids, or a list of them)."""
    state = request.app[_STATE]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    given = body.get("input")
    single = isinstance(given, str) or (
        isinstance(given, list) and bool(given) and all(isinstance(t, int) for t in given)
    )
    inputs = [given] if single else given
    if not isinstance(inputs, list) or not inputs:
        return _error("'input' must be a string, token ids or a non-empty list of them", 400)
    lengths = await _pooled(request, inputs)
    data = [
        {"index": i, "object": "embedding", "embedding": _vector(text, state.hidden_size)}
        for i, text in enumerate(inputs)
    ]
    tokens = sum(lengths)
    # orjson: a response of thousands of floats takes json.dumps milliseconds on the thread
    # the steps run on.
    return web.json_response(
        dumps=_fast_dumps,
        data={
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or state.served_names[0],
            "data": data,
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        },
    )


def _fast_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _rerank(request: web.Request) -> web.Response:
    """vLLM's rerank: each document scored against the query, best first."""
    state = request.app[_STATE]
    body = await _read_json(request)
    if (problem := _check_model(state, body)) is not None:
        return problem
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list) or not documents:
        return _error("rerank needs a string 'query' and a non-empty list 'documents'", 400)
    pairs = [f"{query}\n{document}" for document in documents]
    lengths = await _pooled(request, pairs)
    scores = [(i, (_vector(pair, 1)[0] + 1) / 2) for i, pair in enumerate(pairs)]
    results = [
        {"index": i, "document": {"text": documents[i]}, "relevance_score": score}
        for i, score in sorted(scores, key=lambda item: -item[1])
    ]
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": body.get("model") or state.served_names[0],
            "usage": {"total_tokens": sum(lengths)},
            "results": results,
        }
    )


def _render_chat(state: SimState, messages: list[Any]) -> tuple[list[int], float]:
    """The prompt's token ids under the simulator's fixed chat template, and its images'
    encoder FLOPs: per message, its role line then its parts in order, text tokenized on its
    own and each image as its placeholder tokens (between its markers). So a conversation's
    next turn (its history, the answer, a new user message) starts with exactly the ids of the
    turn before, and the prefix cache finds that history, as it does behind a real template."""
    ids: list[int] = []
    flops = 0.0
    encode = state.tokenizer.encode
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        ids += encode(f"{role or 'user'}:\n", add_special_tokens=False).ids
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind == "text" or kind is None:
                ids += encode(str(part.get("text") or ""), add_special_tokens=False).ids
                continue
            image_ids, image_flops = _media_part(state, part)
            ids += image_ids
            flops += image_flops
    return ids, flops


def _media_part(state: SimState, part: dict[str, Any]) -> tuple[list[int], float]:
    """An image, video or audio part's placeholder ids and encoder FLOPs; ImageError (a 400)
    for what the model cannot take, with vLLM's message for a text-only model."""
    vision, audio = state.vision, state.audio
    if vision is None and audio is None:
        raise ImageError(f"{state.served_names[0]} is not a multimodal model")
    kind = part.get("type")
    vocab = state.tokenizer.get_vocab_size()
    if kind in ("image_url", "video_url") and vision is not None:
        media = part.get(kind)
        url = str((media.get("url") if isinstance(media, dict) else media) or "")
        if kind == "image_url":
            (width, height), data = image_size(url)
            count = vision.image_tokens(width, height) + vision.marker_tokens
            return image_ids(data, count, vocab), vision.encoder_flops(width, height)
        if vision.takes_video:
            (width, height), frames, data = video_frames(url)
            count = vision.video_tokens(width, height, frames) + vision.marker_tokens
            flops = vision.video_encoder_flops(width, height, frames)
            return image_ids(data, count, vocab), flops
    if kind == "input_audio" and audio is not None:
        clip = part.get("input_audio")
        try:
            seconds, data = wav_seconds(str(clip.get("data") if isinstance(clip, dict) else ""))
        except AudioError as error:
            raise ImageError(str(error)) from None
        count = audio.audio_tokens(seconds) + audio.marker_tokens
        return image_ids(data, count, vocab), audio.encoder_flops(seconds)
    modality = {"image_url": "image", "video_url": "video", "input_audio": "audio"}.get(
        str(kind), repr(kind)
    )
    raise ImageError(f"{state.served_names[0]} does not take {modality} input")


def _word(state: SimState, token: int) -> str:
    return " " + state.words[token % len(state.words)]


def _alternative(state: SimState) -> Any:
    """A token's text from any number: the top entries of a position's logprobs."""
    vocab = state.tokenizer.get_vocab_size()
    return lambda number: state.tokenizer.decode([number % vocab])


def _cached(state: SimState, sequence: Sequence) -> int | None:
    """The prompt tokens found in the prefix cache, where the server is asked to say."""
    return sequence.cached_tokens if state.prompt_tokens_details else None


def _usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, details: bool = False
) -> dict[str, Any]:
    # As vLLM: prompt_tokens_details only with --enable-prompt-tokens-details (cached_tokens
    # given); otherwise null in a whole response and absent from a stream's usage chunk.
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    elif details:
        usage["prompt_tokens_details"] = None
    if details:  # a whole response has them (null); a stream's usage chunk does not
        usage.update(completion_tokens_details=None)
    return usage
