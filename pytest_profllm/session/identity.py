"""What the controller decides once and hands to every worker: the session's id and engine,
and the host-wide lease pool that engine's devices come from."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psutil
import pytest

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.engine.install import VllmInstall
from pytest_profllm.hosts.devices import cpu_pool, real_gpus
from pytest_profllm.hosts.pool import (
    POOL_DIR_ENV,
    HostPool,
    SessionTurns,
    default_pool_dir,
    make_pool,
    sweep_stale_turns,
)
from pytest_profllm.hosts.processes import OWNER_ENV, orphans_of_dead_sessions, owner_token
from pytest_profllm.options import Settings


def new_session_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunIdentity:
    """Decided once by the controller and handed to every worker."""

    session_id: str
    engine: EngineChoice

    def to_workerinput(self) -> dict[str, Any]:
        engine = self.engine
        vllm = engine.vllm.as_record() if engine.vllm is not None else None
        return {
            "session_id": self.session_id,
            "name": engine.name,
            "reason": engine.reason,
            "version": engine.version,
            "vllm": vllm,
            "clock": engine.clock,
        }

    @classmethod
    def from_workerinput(cls, data: dict[str, Any]) -> RunIdentity:
        vllm = VllmInstall.from_record(data["vllm"]) if data.get("vllm") else None
        engine = EngineChoice(
            data["name"], data["reason"], data["version"], vllm, data.get("clock", "real")
        )
        return cls(data["session_id"], engine)


def host_pool(settings: Settings, engine: EngineChoice) -> HostPool:
    """NVML's GPUs for vLLM, CPU core sets where vLLM runs on CPU, virtual GPUs for the
    simulator (`real_gpus`); ValueError for devices the host lacks."""
    kind = engine.device_kind
    if kind == "cpu":
        return cpu_pool(default_pool_dir(), settings.cpus, settings.ports)
    return make_pool(default_pool_dir(), settings.gpus, settings.ports, real_gpus(kind))


def session_turns(pool: HostPool, identity: RunIdentity) -> SessionTurns:
    return SessionTurns(pool.directory / "turns" / identity.session_id)


def worker_name() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


SETTINGS_KEY = pytest.StashKey[Settings]()
IDENTITY_KEY = pytest.StashKey[RunIdentity]()


def claim_session(settings: Settings) -> list[str]:
    """On the controller, before anything starts: what sessions killed outright (SIGKILL, a
    crashed node) left behind is ended and removed, then this process becomes the owner of
    everything the session starts (OWNER_ENV, inherited). Returns one line per leftover."""
    said = []
    for process in orphans_of_dead_sessions(os.environ.get(POOL_DIR_ENV, "")):
        try:
            command = " ".join(process.cmdline())[:80]
            process.kill()
            said.append(f"ended pid {process.pid} ({command}), left by a session that was killed")
        except psutil.Error:
            continue
    if settings.ray is None:
        for folder in sweep_stale_turns(default_pool_dir()):
            said.append(f"removed {folder}, left by a session that was killed")
    os.environ[OWNER_ENV] = owner_token(os.getpid())
    return said
