"""What several test files share: a pytest run of suites on the simulated engine, the records
it wrote, suite files written for a test, and vLLM's own parse of argvs (in vLLM's Python)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pytest_profllm.plan.case import Case, expand
from pytest_profllm.plan.suite import load_suite_file

# A Python that imports vLLM (CPU-only is enough: its parsers run, it cannot serve).
VLLM_PYTHON = os.environ.get("PROFLLM_VLLM_PYTHON", "")


def run_suites(
    pytester: pytest.Pytester,
    ports: str,
    *args: str,
    out: str | None = "results",
    gpus: int | None = 4,
) -> pytest.RunResult:
    """pytest in a subprocess over pytester's folder, on this test's ports. The schedule-lag
    verdict is off: these runs test the path, in a session that oversubscribes the host."""
    return pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        *([f"--profllm-out={out}"] if out else []),
        *([f"--profllm-gpus={gpus}"] if gpus else []),
        "--profllm-max-schedule-lag=1000",
        *args,
        timeout=300,
    )


def records(folder: Path) -> list[dict[str, Any]]:
    """The JSON records in `folder`, by file name."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def write_suite(folder: Path, text: str, name: str = "bench_x.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def cases_of(path: Path) -> list[Case]:
    suite, lines = load_suite_file(path)
    return expand(suite, str(path), lines)


def vllm_parse(script: str, argvs: list[Any], *, refusals: bool = False) -> list[dict[str, Any]]:
    """What `script`, run in vLLM's Python with the argvs as JSON on its standard input, says
    of each (its last line, a JSON list). Unless `refusals`, vLLM must accept every argv."""
    done = subprocess.run(
        [VLLM_PYTHON, "-c", script],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    if not refusals:
        for argv, namespace in zip(argvs, parsed, strict=True):
            assert "error" not in namespace, f"vLLM refused {argv}: {namespace}"
    return parsed


@contextlib.asynccontextmanager
async def serve_handler(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    path: str = "/v1/completions",
    shutdown_timeout: float = 1.0,
) -> AsyncIterator[str]:
    """An in-process aiohttp server on 127.0.0.1 answering POST `path` with `handler`;
    yields its base URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    # A short shutdown timeout: cleanup never waits long on a handler the test left hanging.
    runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
