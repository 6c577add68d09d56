"""One server group on the node Ray picked for it.

The group runs through the same `WorkerSession` and `WorkerServers` as on one host: it leases
the GPUs Ray gave it and a port block from the node's own pool (so other pytest sessions on
that host still see them taken), starts the server once, runs its cases with the client on
this node, and stops the server with the usual checks. Each case's result is yielded as soon
as the case ends, so a node that dies loses only the case it was running.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_profllm.cluster.wire import CaseResult, NodeInfo
from pytest_profllm.hosts.devices import DeviceKind, real_gpus
from pytest_profllm.hosts.pool import VIRTUAL_PREFIX, HostPool, default_pool_dir
from pytest_profllm.options import Settings
from pytest_profllm.plan.case import Case
from pytest_profllm.run.outcome import CaseOutcome
from pytest_profllm.server.tracing import wanting_spans
from pytest_profllm.session.identity import RunIdentity
from pytest_profllm.session.worker import CASE_ERRORS, OUTCOME_KEY, WorkerSession


@dataclass
class NodeSession(WorkerSession):
    """A worker session whose pool is this node's, holding only the GPUs Ray gave the group."""

    node: NodeInfo | None = None

    @functools.cached_property
    def pool(self) -> HostPool:
        assert self.node is not None, "a node session knows its node"
        return node_pool(self.node, self.settings.ports, self.identity.engine.device_kind)


def node_pool(node: NodeInfo, ports: range, kind: DeviceKind) -> HostPool:
    """The host-wide pool folder, so ports and server starts are shared with every session on
    this host; GPUs are locked by UUID where NVML knows them and vLLM uses them (`real_gpus`).
    Logical GPUs (a test cluster, several Ray nodes on one host) and the simulator's are named
    after their node, since node A's GPU 0 is not node B's."""
    real = dict(real_gpus(kind))
    names = tuple(
        real.get(gpu) or f"{VIRTUAL_PREFIX}{node.node_id[:12]}-{gpu}" for gpu in node.gpus
    )
    return HostPool(default_pool_dir(), node.gpus, names, ports)


def this_node() -> NodeInfo:
    # Deferred: Ray is the optional extra pytest-profllm[ray].
    import ray

    context = ray.get_runtime_context()
    return NodeInfo(
        node_id=context.get_node_id(),
        node_ip=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        host=socket.gethostname(),
        gpus=tuple(str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])),
    )


def run_group(
    settings: Settings, identity: RunIdentity, cases: list[tuple[str, Case]]
) -> Iterator[NodeInfo | CaseResult]:
    """The Ray task of one server group: first where it runs, then each case's result."""
    node = this_node()
    session = NodeSession(
        node_settings(settings, identity), identity, f"ray-{node.node_id[:8]}", node=node,
        wanting_spans=wanting_spans((case for _, case in cases), settings.gated),
    )
    yield node
    try:
        for index, (nodeid, case) in enumerate(cases):
            stash = pytest.Stash()
            error: Exception | None = None
            try:
                session.run(case, nodeid, stash)
            except Exception as raised:  # the case fails; the group goes on, as on one host
                error = raised
            session.after_case(cases[index + 1][1] if index + 1 < len(cases) else None)
            yield case_result(stash[OUTCOME_KEY], error, node)
    finally:
        session.close()  # also when the driver cancels the group: the server stops here


def node_settings(settings: Settings, identity: RunIdentity) -> Settings:
    """Logs and traces go to the driver's output folder where this node can write it (a shared
    or the same filesystem), else to a folder of this node's own."""
    out = settings.out_dir
    if out is not None:
        try:
            (out / "logs").mkdir(parents=True, exist_ok=True)
            return settings
        except OSError:
            pass
    local = Path(tempfile.gettempdir()) / f"pytest-profllm-{identity.session_id}"
    return dataclasses.replace(settings, out_dir=local, db_path=None)


def case_result(outcome: CaseOutcome, error: Exception | None, node: NodeInfo) -> CaseResult:
    # The status is the driver's to decide (a marked test's own asserts count): this one holds
    # only until then.
    record = outcome.record("error" if error is not None else "passed", None)
    record["runtime"].update(node_id=node.node_id, node_ip=node.node_ip)
    named = isinstance(error, CASE_ERRORS)
    return CaseResult(
        nodeid=outcome.nodeid,
        record=record,
        requests=outcome.requests,
        results=outcome.results,
        threshold_results=[result.model_dump(mode="json") for result in outcome.threshold_results],
        invalid_reason=outcome.invalid_reason,
        started_at=outcome.started_at,
        finished_at=outcome.finished_at,
        error_kind=type(error).__name__ if named else None,
        error=None
        if error is None
        else str(error)
        if named
        else f"on {node.describe()}:\n" + "".join(traceback.format_exception(error)),
    )
