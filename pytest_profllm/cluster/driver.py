"""pytest's side of `--profllm-ray`: hand each server group to the Ray cluster, take each case's
result as it streams back, and give it to the item that runs the case.

Collection, reports, thresholds and records stay pytest's, exactly as on one host: the item of
a case waits for its result, puts the outcome in its stash, and the usual hooks decide its
verdict and hand its record to the controller, which writes it and loads the database. Only the
server and the client run elsewhere.

Every group is submitted at once, largest first (Ray queues what does not fit yet and picks the
node and the GPUs). A thread takes each result off the cluster as soon as its case ends, so a
node that dies loses only the case it was running: its other cases fail with the node's name,
or run once more elsewhere with `--profllm-ray-retry`.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_profllm.cluster.node import run_group
from pytest_profllm.cluster.wire import CaseResult, NodeError, NodeInfo, NodeLost
from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.hosts.devices import real_gpus
from pytest_profllm.options import Settings
from pytest_profllm.plan.case import Case
from pytest_profllm.results.record import Status, ThresholdResult
from pytest_profllm.run.outcome import CaseOutcome
from pytest_profllm.session.collect import case_of
from pytest_profllm.session.identity import RunIdentity, host_pool
from pytest_profllm.session.worker import CASE_ERRORS, OUTCOME_KEY, WorkerSession

INSTALL_HINT = "pip install -e '.[ray]' in the pytest-profllm clone"
# `local` starts a cluster of this host alone; records are small, so is its object store.
LOCAL_OBJECT_STORE_BYTES = 200 * 1024**2
# How long a cancelled group may take to stop its server (SIGTERM, grace, checks) at the end.
CANCEL_WAIT_S = 30.0
# How often the driver looks for groups that no live node can hold any more (a node was lost).
_FEASIBLE_CHECK_S = 2.0
_WAIT_S = 0.5


class ClusterWarning(UserWarning):
    """Something about the cluster run the user should know that fails nothing: a case ran
    again on another node after its first node was lost."""


def check_usage(config: pytest.Config) -> None:
    """`--profllm-ray` without Ray, or with xdist, is a usage error that says what to do."""
    if importlib.util.find_spec("ray") is None:
        raise pytest.UsageError(f"--profllm-ray needs Ray in this environment: {INSTALL_HINT}")
    if config.getoption("numprocesses", None):
        raise pytest.UsageError(
            "--profllm-ray: the Ray cluster runs the server groups in parallel; drop -n "
            "(pytest-xdist workers would each drive the cluster)"
        )


def planned_cases(items: list[pytest.Item]) -> list[tuple[str, Case]]:
    """The cases this run will ask for, in the items' order (node id, case)."""

    planned = []
    for item in items:
        case = case_of(item)
        if case is not None and item.get_closest_marker("skip") is None:
            planned.append((item.nodeid, case))
    return planned


@dataclass
class NodeOutcome(CaseOutcome):
    """A case's outcome as its node sent it; its record is the node's, with the status and
    message that this side's reports decide."""

    node_record: dict[str, Any] | None = None
    node: NodeInfo | None = None

    def record(self, status: Status, message: str | None) -> dict[str, Any]:
        if self.node_record is not None:
            return {**self.node_record, "status": status, "message": message}
        # Nothing came back (the node was lost): what is known here, where it was to run.
        record = super().record(status, message)
        if self.node is not None:
            record["runtime"].update(node_id=self.node.node_id, node_ip=self.node.node_ip)
            record["system"]["host"] = self.node.host
        return record


@dataclass(frozen=True)
class Unrunnable:
    """A case no node of the cluster can hold: skipped, as on a host whose pool is too small."""

    reason: str


Delivery = CaseResult | NodeLost | NodeError | Unrunnable


@dataclass
class ClusterSession(WorkerSession):
    """The case-running side when servers run on a Ray cluster; same interface as on one host."""

    planned: list[tuple[str, Case]] = field(default_factory=list)
    dispatch: Dispatch | None = None

    def start(self) -> None:
        """Connect and submit every planned group (before the first item runs)."""
        if self.dispatch is None and self.planned:
            self.dispatch = Dispatch(self.settings, self.identity)
            self.dispatch.submit_all(self.planned)

    def run(self, case: Case, nodeid: str, stash: pytest.Stash) -> CaseOutcome:
        if self.dispatch is None:
            self.dispatch = Dispatch(self.settings, self.identity)
        delivered, retried_after = self.dispatch.take(nodeid, case)
        if isinstance(delivered, Unrunnable):
            pytest.skip(delivered.reason)
        now = time.time()
        outcome = stash[OUTCOME_KEY] = NodeOutcome(
            case=case,
            nodeid=nodeid,
            session_id=self.identity.session_id,
            engine=self.identity.engine,
            worker=self.worker,
            started_at=now,
            finished_at=now,
        )
        if isinstance(delivered, Exception):
            outcome.node = getattr(delivered, "node", None)
            if outcome.node is not None:
                outcome.worker = f"ray-{outcome.node.node_id[:8]}"
            outcome.error = str(delivered).splitlines()[0]
            raise delivered
        if retried_after is not None:
            warnings.warn(
                f"{nodeid}: ran again on another node after {retried_after} was lost",
                ClusterWarning,
                stacklevel=1,
            )
        outcome.node_record = delivered.record
        outcome.results = delivered.results
        outcome.threshold_results = [ThresholdResult.model_validate(result)
                                     for result in delivered.threshold_results]
        outcome.requests = delivered.requests
        outcome.invalid_reason = delivered.invalid_reason
        outcome.started_at, outcome.finished_at = delivered.started_at, delivered.finished_at
        if delivered.error is not None:
            outcome.error = delivered.error.splitlines()[0]
            raise _case_error(delivered.error_kind, delivered.error)
        return outcome

    def after_case(self, next_case: Case | None) -> None:
        """Servers live on the nodes; each group stops its own after its last case."""

    def close(self) -> None:
        if self.dispatch is not None:
            self.dispatch.close()


def _case_error(kind_name: str | None, message: str) -> Exception:
    """The error the case failed with on its node, as the same class where it is one we name."""
    named = {kind.__name__: kind for kind in CASE_ERRORS}
    kind = named.get(kind_name or "")
    return kind(message) if kind is not None else NodeError(message)


@dataclass
class _Group:
    """One server's cases on their way through the cluster."""

    cases: list[tuple[str, Case]]
    gpus: int
    attempt: int = 0
    node: NodeInfo | None = None
    done: set[str] = field(default_factory=set)
    retried_after: str | None = None  # the node lost before this attempt, if any

    def remaining(self) -> list[tuple[str, Case]]:
        return [(nodeid, case) for nodeid, case in self.cases if nodeid not in self.done]


class Dispatch:
    """The Ray side of a session: groups in flight and the results they sent back."""

    def __init__(self, settings: Settings, identity: RunIdentity) -> None:
        self.settings = settings
        self.identity = identity
        self._connect()
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        # max_retries=0: Ray would run a failed group again from its first case; a lost node's
        # unfinished cases are ours to fail or retry.
        self._task = ray.remote(num_returns="streaming", max_retries=0, num_cpus=0)(run_group)
        self._changed = threading.Condition()
        self._streams: dict[Any, _Group] = {}
        self._delivered: dict[str, tuple[Delivery, str | None]] = {}
        self._closing = False
        self._thread: threading.Thread | None = None
        self._last_feasible_check = 0.0

    def _connect(self) -> None:
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        address = self.settings.ray
        quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
        try:
            if address == "local":
                ray.init(
                    address="local",
                    num_gpus=_local_gpus(self.settings, self.identity.engine),
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    **quiet,
                )
            else:
                ray.init(address=address, **quiet)
        except Exception as error:  # Ray raises several kinds; all mean the same to the user
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise pytest.UsageError(
                f"--profllm-ray {address}: cannot start or reach the Ray cluster: "
                f"{type(error).__name__}: {first}"
            ) from None

    # -- submitting ---------------------------------------------------------------------------

    def submit_all(self, planned: list[tuple[str, Case]]) -> None:
        groups: dict[str, list[tuple[str, Case]]] = {}
        for nodeid, case in planned:
            groups.setdefault(case.server_key, []).append((nodeid, case))
        # Largest first, as the host scheduler does: small servers fill the gaps at the end.
        ordered = sorted(groups.values(), key=lambda cases: -cases[0][1].gpus_needed)
        for cases in ordered:
            self._submit(_Group(cases, cases[0][1].gpus_needed))

    def _submit(self, group: _Group) -> None:
        largest = largest_node_gpus()
        if group.gpus > largest:
            reason = (
                f"needs {group.gpus} GPUs (tensor x pipeline x data parallel size) but no node "
                f"of the Ray cluster has more than {largest}"
            )
            self._deliver_all(group, lambda _: Unrunnable(reason))
            return
        stream = self._task.options(num_gpus=group.gpus).remote(
            self.settings, self.identity, group.remaining()
        )
        with self._changed:
            self._streams[stream] = group
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._fetch, name="profllm-ray-results", daemon=True
                )
                self._thread.start()

    # -- taking results off the cluster (the fetch thread) -------------------------------------

    def _fetch(self) -> None:
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        while True:
            with self._changed:
                streams = list(self._streams)
            if not streams:
                return
            ready, _ = ray.wait(streams, num_returns=1, timeout=_WAIT_S)
            for stream in ready:
                self._take_next(stream)
            if time.monotonic() - self._last_feasible_check > _FEASIBLE_CHECK_S:
                self._last_feasible_check = time.monotonic()
                self._fail_infeasible()

    def _take_next(self, stream: Any) -> None:
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        group = self._streams[stream]
        try:
            sent = ray.get(next(stream))
        except StopIteration:
            self._end(stream)
            self._deliver_all(
                group, lambda _: NodeError("the server group ended without running this case")
            )
            return
        except ray.exceptions.TaskCancelledError:
            self._end(stream)
            return
        except ray.exceptions.RayTaskError as error:  # our code on the node, outside a case
            self._end(stream)
            where = group.node.describe() if group.node else "its node"
            text = str(error)
            self._deliver_all(
                group, lambda _: NodeError(f"the server group failed on {where}: {text}")
            )
            return
        except ray.exceptions.RayError as error:  # the node died, left, or lost the worker
            self._end(stream)
            self._lost(group, error)
            return
        if isinstance(sent, NodeInfo):
            group.node = sent
        else:
            group.done.add(sent.nodeid)
            self._deliver(sent.nodeid, sent, group.retried_after)

    def _lost(self, group: _Group, error: Exception) -> None:
        where = group.node.describe() if group.node else _node_named_in(error)
        remaining = group.remaining()
        if not remaining:
            return
        why = type(error).__name__
        if self.settings.ray_retry and group.attempt == 0 and not self._closing:
            retry = _Group(remaining, group.gpus, attempt=1, retried_after=where)
            self._submit(retry)
            return
        running = remaining[0][0] if group.node is not None else None
        self._deliver_all(
            group,
            lambda nodeid: (
                NodeLost(f"{where} was lost while this case ran ({why})", group.node)
                if nodeid == running
                else NodeLost(
                    f"not run: {where} was lost before this case's turn ({why})", group.node
                )
            ),
        )

    def _fail_infeasible(self) -> None:
        """A group still waiting for a node that no live node can hold any more would wait for
        ever: it fails now."""
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        with self._changed:
            waiting = [(s, g) for s, g in self._streams.items() if g.node is None]
        if not waiting:
            return
        largest = largest_node_gpus()
        for stream, group in waiting:
            if group.gpus <= largest:
                continue
            ray.cancel(stream)
            self._end(stream)
            self._deliver_all(
                group,
                lambda _, group=group: NodeLost(
                    f"not run: no live node of the Ray cluster has {group.gpus} GPUs any more "
                    f"(largest: {largest})"
                ),
            )

    def _end(self, stream: Any) -> None:
        with self._changed:
            self._streams.pop(stream, None)
            self._changed.notify_all()

    def _deliver(self, nodeid: str, delivery: Delivery, retried_after: str | None = None) -> None:
        with self._changed:
            self._delivered[nodeid] = (delivery, retried_after)
            self._changed.notify_all()

    def _deliver_all(self, group: _Group, make: Any) -> None:
        for nodeid, _ in group.remaining():
            group.done.add(nodeid)
            self._deliver(nodeid, make(nodeid))

    # -- the items' side -----------------------------------------------------------------------

    def take(self, nodeid: str, case: Case) -> tuple[Delivery, str | None]:
        """This case's result, waiting for it; a case nobody submitted is submitted alone."""
        with self._changed:
            known = nodeid in self._delivered or any(
                nodeid == planned for group in self._streams.values() for planned, _ in group.cases
            )
        if not known:
            self._submit(_Group([(nodeid, case)], case.gpus_needed))
        with self._changed:
            while nodeid not in self._delivered:
                self._changed.wait(_WAIT_S)
            return self._delivered.pop(nodeid)

    def close(self) -> None:
        """Cancel what still runs (its node stops its server), then leave the cluster."""
        # Deferred: Ray is the optional extra pytest-profllm[ray].
        import ray

        with self._changed:
            self._closing = True
            streams = list(self._streams)
        for stream in streams:
            ray.cancel(stream)
        if self._thread is not None:
            self._thread.join(timeout=CANCEL_WAIT_S)
        ray.shutdown()


def largest_node_gpus() -> int:
    # Deferred: Ray is the optional extra pytest-profllm[ray].
    import ray

    return max(
        (
            int(node["Resources"].get("GPU", 0))
            for node in ray.nodes()  # type: ignore[no-untyped-call]
            if node.get("Alive")
        ),
        default=0,
    )


def _local_gpus(settings: Settings, engine: EngineChoice) -> int | None:
    """A local cluster has this host's GPUs for vLLM (Ray finds real ones itself); for the
    simulated engine, or where there is none, as many logical GPUs as the pool has virtual
    ones."""
    if real_gpus(engine.device_kind):
        return None
    return len(host_pool(settings, engine).gpu_ids)


def _node_named_in(error: Exception) -> str:
    """The node a Ray error names (a group lost before it said where it ran)."""
    found = re.search(r"node ID: ([0-9a-f]+)", str(error))
    return f"Ray node {found.group(1)[:12]}" if found else "a node of the Ray cluster"
