"""The load client under the open-file limit: every connection is a descriptor, so a
load caps its connections to what the limit leaves free and says so; a request the client
could not open a connection for is the client's, never a failure of the server's."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import records, suite_args
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_profllm.hosts.descriptors import HEADROOM, ClientCap, connection_cap
from pytest_profllm.load import metrics
from pytest_profllm.load.client import out_of_descriptors, stream_request
from pytest_profllm.load.http import HttpResponse
from pytest_profllm.load.metrics import RequestOutcome
from pytest_profllm.load.schedule import LoadResult, LoadSettings, back_to_back

LIMIT = 128
SUITE = """
server:
  model: Qwen/Qwen3-0.6B
benchmark:
  num_prompts: 400
  random_input_len: 8
  random_output_len: 4
  request_timeout_s: 60
"""


@settings(max_examples=300)
@given(
    limit=st.one_of(st.none(), st.integers(0, 1 << 31)),
    in_use=st.integers(-5, 1 << 20),
    headroom=st.integers(-5, 4096),
)
def test_the_connection_cap_leaves_the_headroom_free(
    limit: int | None, in_use: int, headroom: int
) -> None:
    cap = connection_cap(limit, in_use, headroom)
    if limit is None:
        assert cap is None  # no limit, no cap
        return
    assert cap is not None and cap >= 1  # a load always sends
    if limit > max(0, in_use) + max(0, headroom):
        assert cap + max(0, in_use) + max(0, headroom) == limit


@settings(max_examples=200)
@given(
    connections=st.integers(1, 1 << 20),
    wanted=st.one_of(st.none(), st.integers(1, 1 << 21)),
)
def test_the_cap_is_said_only_where_it_holds_a_load_back(
    connections: int, wanted: int | None
) -> None:
    cap = ClientCap(connections, connections + HEADROOM)
    assert cap.limits(wanted) == (wanted is None or wanted > connections)
    assert ClientCap(None, None).limits(wanted) is False
    line = cap.describe()
    assert line == (
        f"client capped at {connections} concurrent connections: open-file limit "
        f"{connections + HEADROOM}"
    )


@pytest.mark.parametrize(
    ("error", "ours"),
    [
        (OSError(errno.EMFILE, "Too many open files"), True),
        (OSError(errno.ENFILE, "Too many open files in system"), True),
        # asyncio's create_connection over several addresses: one OSError, no errno.
        (OSError("Multiple exceptions: [Errno 24] Too many open files, [Errno 24] Too"), True),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), False),
        (ValueError("Too many open files"), False),
    ],
)
def test_the_clients_own_want_of_descriptors_is_told_apart(
    error: Exception, ours: bool
) -> None:
    assert out_of_descriptors(error) is ours


class _NoDescriptors:
    async def post(self, *args: object) -> HttpResponse:
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_request_the_client_could_not_open_is_no_server_failure() -> None:
    import asyncio

    settings = LoadSettings(base_url="http://127.0.0.1:1", model="m")
    client: Any = _NoDescriptors()
    lost = asyncio.run(
        stream_request(client, "/v1/completions", b"{}", RequestOutcome(prompt_len=1), settings)
    )
    assert lost.out_of_descriptors and not lost.success
    done = [
        RequestOutcome(prompt_len=1, success=True, output_tokens=2, status=200) for _ in range(3)
    ]
    outcomes = [*done, lost]
    results = metrics.compute(outcomes, 1.0)
    assert metrics.served_problem(outcomes, results) is None  # not the server's failure
    assert metrics.request_failures(outcomes) is None
    assert metrics.client_out_of_descriptors(outcomes, 256) == (
        "client ran out of file descriptors on 1 of 4 requests (its open-file limit 256; "
        "raise it with ulimit -n or lower max_concurrency): not the server's failures"
    )
    only = metrics.served_problem([lost], metrics.compute([lost], 1.0))
    assert only == (
        "all 1 requests failed in the client: it ran out of file descriptors (EMFILE), not "
        "the server's failure"
    )
    # The case's validity names the client's limit, never "server failed".
    from pytest_profllm.load.validity import InvalidKind, LoadFacts, Rules, judge
    from pytest_profllm.plan.suite import BenchmarkConfig

    load = LoadResult(outcomes, 1.0, 0.0, 0.0, intended_offsets=[0.0] * 4, open_file_limit=256)
    health = metrics.client_health(outcomes, [0.0] * 4, 0.0, 1.0, 0.0)
    (reason,) = judge(LoadFacts(load, BenchmarkConfig(), health, {}), (None, None), Rules()).reasons
    assert reason.kind is InvalidKind.CLIENT_DESCRIPTORS and not reason.host_caused
    assert reason.text.startswith("client ran out of file descriptors on 1 of 4 requests")


def _low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))


def test_a_load_past_the_open_file_limit_is_capped_and_keeps_its_record(
    tmp_path: Path, ports: str, test_pool_dir: Path
) -> None:
    """400 requests at once under a limit of 128 descriptors (soft and hard, as `ulimit -n`):
    the client opens what the limit leaves, says so, and no request fails for it."""
    (tmp_path / "bench_x.yaml").write_text(textwrap.dedent(SUITE))
    env = {**os.environ, "PROFLLM_POOL_DIR": str(test_pool_dir)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *suite_args(ports), "-rA"]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        preexec_fn=_low_limit, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    (record,) = records(tmp_path / "results")
    assert (tmp_path / "results" / "results.db").is_file(), out
    line = record["runtime"]["client_limit"]
    assert line is not None and line.startswith("client capped at "), out
    assert line.endswith(f" concurrent connections: open-file limit {LIMIT}")
    assert f"{line} (1 case(s))" in out
    assert record["results"]["failed"] == 0, json.dumps(record["validity_reasons"])
    assert record["results"]["completed"] == 400
    assert "Too many open files" not in out and "got no response" not in out
    assert record["status"] == "passed", out
    assert record["system"]["telemetry_problem"] is None
    assert done.returncode == 0, out



def test_a_capacity_probe_pooled_from_runs_keeps_where_its_client_was_capped() -> None:
    # A capacity case's figures are its probe's runs laid back to back. Before, the pooled
    # load dropped the cap, and a capacity record's runtime.client_limit was always null.
    line = "client capped at 43 concurrent connections: open-file limit 128"
    capped = LoadResult([], 1.0, 0.0, 0.0, open_file_limit=128, client_limit=line)
    free = LoadResult([], 1.0, 0.0, 0.0, open_file_limit=4096)
    pooled = back_to_back([free, capped, capped])
    assert (pooled.client_limit, pooled.open_file_limit) == (line, 128)
    assert back_to_back([free, free]).client_limit is None
