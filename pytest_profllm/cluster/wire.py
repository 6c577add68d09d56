"""What a node sends the driver: first where it runs, then one result per case as it ends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_profllm.run.outcome import CaseFailed


class NodeLost(CaseFailed):
    """The Ray node running a case's server group died, or left the cluster."""

    def __init__(self, message: str, node: NodeInfo | None = None) -> None:
        super().__init__(message)
        self.node = node  # where the case was to run, when the group had said


class NodeError(CaseFailed):
    """A case failed on its node with an error we did not name; the message is its traceback."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str  # Ray's node id (hex)
    node_ip: str
    host: str
    gpus: tuple[str, ...]  # the device ids Ray gave the group (CUDA_VISIBLE_DEVICES)

    def describe(self) -> str:
        return f"Ray node {self.node_id[:12]} ({self.host}, {self.node_ip})"


@dataclass
class CaseResult:
    """One case as its node saw it: the record (its status and message are the driver's to set,
    since a marked test's own asserts count), the per-request rows, and how it failed if it did.
    """

    nodeid: str
    record: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    results: dict[str, float | int | None] = field(default_factory=dict)
    threshold_results: list[dict[str, Any]] = field(default_factory=list)
    invalid_reason: str | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    error_kind: str | None = None  # the class name of a named case error (session.CASE_ERRORS)
    error: str | None = None  # its message, or the traceback of an unnamed one
