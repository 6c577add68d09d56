"""What several test files share: a pytest run of suites on the simulated engine, the records
it wrote, suite files written for a test, and vLLM's own parse of argvs (in vLLM's Python)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pytest_profllm.plan.case import Case, expand
from pytest_profllm.plan.suite import SuiteError, load_suite_file

# A Python that imports vLLM (CPU-only is enough: its parsers run, it cannot serve).
VLLM_PYTHON = os.environ.get("PROFLLM_VLLM_PYTHON", "")
needs_vllm_python = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="no vLLM Python: set PROFLLM_VLLM_PYTHON to one that imports vLLM "
    "(.ci/vllm-env.sh parser builds a CPU-only one)",
)


def suite_args(
    ports: str,
    *,
    out: str | None = "results",
    gpus: int | None = 4,
    cache: bool = True,
    load_cores: bool = False,
) -> list[str]:
    """The options of a pytest run of suites on this test's ports. The schedule-lag verdict is
    off, and so are the loads' host cores (unless asked for): these runs test the path, side
    by side, in a session that oversubscribes the host. Hypothesis' pytest plugin is off: these
    runs have no property tests, and at each session's end it imported Hypothesis (about a tenth
    of an empty session's CPU, in each of the suite's hundreds of such runs)."""
    return [
        "-p", "no:hypothesispytest",
        f"--profllm-ports={ports}",
        *([f"--profllm-out={out}"] if out else []),
        *([f"--profllm-gpus={gpus}"] if gpus else []),
        "--profllm-max-schedule-lag=1000",
        "--profllm-max-foreign-cpu=1",
        *([] if load_cores else ["--profllm-no-load-cores"]),
        *([] if cache else ["-p", "no:cacheprovider"]),
    ]


def pytest_argv(
    ports: str,
    *args: str,
    out: str | None = "results",
    gpus: int | None = 4,
    cache: bool = True,
) -> list[str]:
    """The command line of such a run in a process of its own: `suite_args`, then `args`."""
    options = suite_args(ports, out=out, gpus=gpus, cache=cache)
    return [sys.executable, "-m", "pytest", *options, *args]


def run_suites(
    pytester: pytest.Pytester,
    ports: str,
    *args: str,
    out: str | None = "results",
    gpus: int | None = 4,
    cache: bool = True,
    timeout: float = 300,
    load_cores: bool = False,
) -> pytest.RunResult:
    """pytest in a subprocess over pytester's folder, with `suite_args` and then `args`."""
    options = suite_args(ports, out=out, gpus=gpus, cache=cache, load_cores=load_cores)
    return pytester.runpytest_subprocess(*options, *args, timeout=timeout)


def assert_invalid(result: pytest.RunResult, invalid: int, **outcomes: int) -> None:
    """The run counted `invalid` cases (not measurements of the server) apart from its other
    `outcomes` (assert_outcomes' keywords), and failed for them: status 1, as by default."""
    result.assert_outcomes(**outcomes)
    assert result.parseoutcomes().get("invalid", 0) == invalid, result.parseoutcomes()
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def records(folder: Path) -> list[dict[str, Any]]:
    """The JSON records in `folder`, by file name."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def run_records(pytester: pytest.Pytester, out: str = "results") -> list[dict[str, Any]]:
    """The records a run in pytester's folder wrote to --profllm-out=`out`."""
    return records(pytester.path / out)


def write_suite(folder: Path, text: str, name: str = "bench_x.yaml") -> Path:
    """`text`, dedented, in the suite file `folder`/`name`."""
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def cases_of(path: Path) -> list[Case]:
    """The cases of the suite file at `path`, loaded and expanded as collection does."""
    suite, lines = load_suite_file(path)
    return expand(suite, str(path), lines)


def suite_error(path: Path) -> str:
    """The message of the SuiteError that loading and expanding `path` raises."""
    with pytest.raises(SuiteError) as error:
        cases_of(path)
    message = str(error.value)
    assert "\n" not in message  # one line, fit for a collection error or a CLI
    return message


# The end of a script for `vllm_parse` that has built `parser` and a `plain` for its values:
# each argv on stdin (a JSON list of lists) parsed, and every namespace printed as JSON.
PARSE_EACH_ARGV = """
results = []
for argv in json.load(sys.stdin):
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exit:
        results.append({"error": f"exit {exit.code}"})
        continue
    results.append({name: plain(value) for name, value in vars(namespace).items()})
print(json.dumps(results, default=repr))
"""

# `vllm bench serve`'s own parser over each argv given on stdin: every option as it parsed, by
# its dest name (a dict's non-string keys, random-mm's bucket tuples, as their repr).
BENCH_SERVE_PARSE = (
    """
import json, sys
from vllm.benchmarks.serve import add_cli_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

def plain(value):
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): plain(v) for k, v in value.items()}
    return value

parser = FlexibleArgumentParser()
add_cli_args(parser)
"""
    + PARSE_EACH_ARGV
)


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


@contextlib.contextmanager
def simulator(
    first_port: int, log: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A simulated engine on 127.0.0.1 (`python -m pytest_profllm.sim ARGS --port P`, on the
    first of five ports from `first_port` that it can take, with `env` where given); yields
    its URL, and stops and reaps it whatever the test does."""
    for port in range(first_port, first_port + 5):  # a port someone else holds: the next one
        argv = [sys.executable, "-m", "pytest_profllm.sim", *args, "--port", str(port)]
        with log.open("wb") as handle:
            process = subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            if process.poll() is None and time.monotonic() < deadline:
                yield f"http://127.0.0.1:{port}"
                return
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    raise RuntimeError(f"the simulator did not start: {log.read_text(errors='replace')[-300:]}")


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


class Holder:
    """A process running `script` (lease holders of the pool tests) in its own process group,
    read line by line with a deadline; `release` writes a line to its standard input."""

    def __init__(self, script: str, args: list[str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-c", script, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )

    def read_line(self, timeout: float = 15.0) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline().decode().strip() if ready else ""
        assert line, f"holder said nothing; stderr: {self.stderr_path.read_text()}"
        return line

    def release(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
