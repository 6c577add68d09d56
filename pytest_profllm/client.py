"""The load generator: streams completions from an OpenAI-compatible server, timing each message.

Timing follows `vllm bench serve`: a request's clock starts just before it is sent (after any
`max_concurrency` wait), TTFT is the first content message, ITL the gaps between content
messages, latency the last content message. Arrival times follow vLLM's schedule: all at once
for an infinite rate, else gamma-distributed gaps (burstiness 1.0 is a Poisson process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_profllm.dataset import PromptRequest
from pytest_profllm.metrics import RequestOutcome

if TYPE_CHECKING:
    import aiohttp

_NO_CONTENT = "Never received a valid chunk to calculate TTFT."


@dataclass(frozen=True)
class LoadSettings:
    base_url: str
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    num_warmups: int = 0
    request_timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class LoadResult:
    outcomes: list[RequestOutcome]
    duration: float  # seconds from the benchmark's start to the last response
    started_at: float  # Unix seconds
    clock_start: float  # the same moment on the perf_counter clock the outcomes use


def arrival_offsets(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Intended send times in seconds from the start, as vLLM schedules them."""
    import numpy as np

    if math.isinf(rate):
        return [0.0] * count
    if math.isinf(burstiness):
        gaps = np.full(count, 1.0 / rate)
    else:
        gaps = np.random.RandomState(seed).gamma(
            shape=burstiness, scale=1.0 / (rate * burstiness), size=count
        )
    offsets = np.cumsum(gaps)
    # vLLM rescales so the last request goes at count / rate: the mean rate is exact.
    if count and offsets[-1] != 0:
        offsets = offsets * (count / rate) / offsets[-1]
    result: list[float] = offsets.tolist()
    return result


async def run_load(settings: LoadSettings, requests: Sequence[PromptRequest]) -> LoadResult:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=settings.max_concurrency or 0, force_close=False)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    semaphore: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(settings.max_concurrency)
        if settings.max_concurrency
        else contextlib.nullcontext()
    )
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        for _ in range(settings.num_warmups):
            await _stream_completion(session, settings, requests[0], 0.0)

        offsets = arrival_offsets(
            len(requests), settings.request_rate, settings.burstiness, settings.seed
        )
        started_at = time.time()
        start = time.perf_counter()

        async def one(request: PromptRequest, offset: float) -> RequestOutcome:
            async with semaphore:
                return await _stream_completion(session, settings, request, start + offset)

        tasks = []
        async for request, offset in _on_schedule(requests, offsets, start):
            tasks.append(asyncio.create_task(one(request, offset)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return LoadResult(list(outcomes), duration, started_at, start)


async def _on_schedule(
    requests: Sequence[PromptRequest], offsets: Sequence[float], start: float
) -> AsyncIterator[tuple[PromptRequest, float]]:
    for request, offset in zip(requests, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield request, offset


async def _stream_completion(
    session: aiohttp.ClientSession,
    settings: LoadSettings,
    request: PromptRequest,
    intended_start: float,
) -> RequestOutcome:

    payload = {
        "model": settings.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        payload["ignore_eos"] = True
    outcome = RequestOutcome(prompt_len=request.prompt_len, intended_start=intended_start)
    text_parts: list[str] = []
    start = time.perf_counter()
    outcome.start_time = start
    last = start
    try:
        async with session.post(f"{settings.base_url}/v1/completions", json=payload) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                outcome.error = f"HTTP {response.status} {response.reason}: {body}"
                return outcome
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                # SSE messages end with a blank line; one read may hold several or a part of one.
                *messages, buffer = buffer.split(b"\n\n")
                for message in messages:
                    data = message.strip().removeprefix(b"data:").strip()
                    if not data or data == b"[DONE]" or data.startswith(b":"):
                        continue
                    event = json.loads(data)
                    if event.get("choices"):
                        now = time.perf_counter()
                        if not outcome.success:
                            outcome.success = True
                            outcome.ttft = now - start
                        else:
                            outcome.itl.append(now - last)
                        last = now
                        text_parts.append(event["choices"][0].get("text") or "")
                    elif usage := event.get("usage"):
                        outcome.output_tokens = usage.get("completion_tokens")
            if not outcome.success:
                outcome.error = _NO_CONTENT
    except Exception as error:  # as in vLLM's client: any error fails this request only
        outcome.success = False
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.latency = last - start
    outcome.generated_text = "".join(text_parts)
    return outcome
