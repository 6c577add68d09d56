"""The load client's event loop: uvloop's where it is installed (`pip install -e '.[uvloop]'`),
else asyncio's default.

On a client that is the bottleneck, uvloop read more messages per second and added less to
TTFT than asyncio's loop (docs/developing/performance.md, "The client's event loop"). Every
load runs through `run`, in this process and in each client process (load/processes.py), and
the record names the loop (`system.client_loop`). `PROFLLM_CLIENT_LOOP=asyncio` keeps
asyncio's loop where uvloop is installed (to compare the two).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopName = Literal["asyncio", "uvloop"]
CHOICE_ENV = "PROFLLM_CLIENT_LOOP"


def name() -> LoopName:
    """The loop `run` uses: uvloop where it is installed and not turned off."""
    if os.environ.get(CHOICE_ENV, "").strip().lower() == "asyncio":
        return "asyncio"
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def _factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name() != "uvloop":
        return None
    import uvloop  # an optional extra: imported only where it is installed and chosen

    new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return new_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the client's loop."""
    with asyncio.Runner(loop_factory=_factory()) as runner:
        return runner.run(main)
