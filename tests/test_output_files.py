"""Output files follow the user's umask, as every file a process creates with open() does:
record JSON, per-request records, and whatever else profllm writes atomically."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_profllm.hosts.files import write_atomic
from pytest_profllm.results.record_files import write_record, write_requests


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    mask: int = request.param
    previous = os.umask(mask)
    try:
        yield mask
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_have_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("as open() makes it")  # what the database and the logs get
    record = write_record(tmp_path, {"run_id": "r1", "status": "passed"})
    requests = write_requests(tmp_path, "r1", [{"index": 0}])
    atomic = tmp_path / "sub" / "other.json"
    write_atomic(atomic, b"{}")
    assert mode(plain) == 0o666 & ~umask
    for path in (record, requests, atomic):
        assert mode(path) == mode(plain), f"{path.name}: {oct(mode(path))}"
