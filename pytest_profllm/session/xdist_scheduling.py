"""Keeping every case of one server on one worker, in order, so each server starts once.

pytest-xdist 3.8 with pytest 9.2 no longer groups `xdist_group` tests under `--dist loadgroup`
(xdist #1386), so grouping is ours, and it needs no `--dist` choice from the user:

- in every process, collected items are reordered so the cases of one server key are adjacent
  (this alone groups them without xdist);
- each xdist worker writes which server key and how many GPUs each collected case has to a
  folder the controller made; the controller's scheduler hands out one work unit per server key
  (cases of one server from several files or test functions included), the servers that need
  the most GPUs first, so small servers fill the gaps at the end rather than making a large one
  wait for the whole pool at the end.

Where the workers cannot write to the controller's folder (remote workers), units fall back to
the item's parent: `file.yaml::server` for suites, the module for marked tests.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm.plan.case import Case

SCOPE_DIR_INPUT = "profllm_scope_dir"
# On the controller: the folder the workers write their scope maps to.
SCOPE_DIR_KEY = pytest.StashKey[Path]()
# On a worker: each server key's rank in the scheduler's order.
RANKS_KEY = pytest.StashKey[dict[str, int]]()


@dataclass(frozen=True)
class Scope:
    server_key: str
    gpus: int


def group_by_server(items: list[Any], case_of: Callable[[Any], Case | None]) -> None:
    """Reorder `items` in place: each server's cases move up to its first case, in order.

    Items that are not benchmark cases keep their place relative to each other.
    """
    first_seen: dict[str, int] = {}
    rank: dict[int, int] = {}
    for position, item in enumerate(items):
        case = case_of(item)
        if case is None:
            rank[id(item)] = position
        else:
            rank[id(item)] = first_seen.setdefault(case.server_key, position)
    items.sort(key=lambda item: rank[id(item)])  # stable: a server's cases keep their order


def make_scope_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="profllm-scopes-"))


def write_scopes(directory: Path, worker: str, scopes: dict[str, Scope]) -> None:
    """This worker's map of node id -> scope, written whole or not at all."""
    document = {nodeid: [scope.server_key, scope.gpus] for nodeid, scope in scopes.items()}
    temporary = directory / f".{worker}.json.tmp"
    temporary.write_text(json.dumps(document))
    os.replace(temporary, directory / f"{worker}.json")


def read_scopes(directory: Path | None) -> dict[str, Scope]:
    """The scope map of any worker (their collections are identical), or {} if none wrote."""
    if directory is None:
        return {}
    for path in sorted(directory.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return {nodeid: Scope(str(key), int(gpus)) for nodeid, (key, gpus) in document.items()}
    return {}


def work_order(nodeids: Sequence[str], scopes: dict[str, Scope]) -> dict[str, list[str]]:
    """Work units (scope name -> node ids, in collection order), largest GPU need first."""
    units: dict[str, list[str]] = {}
    need: dict[str, int] = {}
    for nodeid in nodeids:
        name = scope_name(nodeid, scopes)
        units.setdefault(name, []).append(nodeid)
        need[name] = max(need.get(name, 0), scopes[nodeid].gpus if nodeid in scopes else 0)
    order = sorted(units, key=lambda name: -need[name])  # stable: ties keep collection order
    return {name: units[name] for name in order}


def server_ranks(
    nodeids: Sequence[str], scopes: dict[str, Scope], skipped: set[str]
) -> dict[str, int]:
    """Each server key's place in the order the scheduler hands servers out (servers whose
    cases are all skipped take no lease, and no place)."""
    ranks: dict[str, int] = {}
    for unit in work_order(nodeids, scopes).values():
        leasing = [nodeid for nodeid in unit if nodeid in scopes and nodeid not in skipped]
        if leasing:
            ranks.setdefault(scopes[leasing[0]].server_key, len(ranks))
    return ranks


def scope_name(nodeid: str, scopes: dict[str, Scope]) -> str:
    scope = scopes.get(nodeid)
    if scope is not None:
        return f"profllm-server-{scope.server_key}"
    return nodeid.rsplit("::", 1)[0]


def server_scheduling(config: Any, log: Any) -> Any:
    """The xdist scheduler."""
    # Imported here: xdist's scheduler module is needed only on an xdist controller.
    from xdist.scheduler import LoadScopeScheduling

    class ServerScopeScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with our units and order, one unit ahead per worker."""

        def __init__(self, config: Any, log: Any = None) -> None:
            super().__init__(config, log)
            self._scope_dir: Path | None = config.stash.get(SCOPE_DIR_KEY, None)
            self._scopes: dict[str, Scope] | None = None

        @property
        def scopes(self) -> dict[str, Scope]:
            # Read once, after every worker finished collecting (xdist calls schedule() then).
            if self._scopes is None:
                self._scopes = read_scopes(self._scope_dir)
            return self._scopes

        def _split_scope(self, nodeid: str) -> str:
            return scope_name(nodeid, self.scopes)

        def schedule(self) -> None:
            if self.collection is not None:  # type: ignore[has-type]  # a new worker joined
                super().schedule()
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            collection: list[str] = list(next(iter(self.registered_collections.values())))
            self.collection = collection
            for name, nodeids in work_order(collection, self.scopes).items():
                self.workqueue[name] = dict.fromkeys(nodeids, False)
            # One unit per worker to start: a second would tie a server to a busy worker
            # while another one idles.
            for node in list(self.nodes)[len(self.workqueue) :]:
                self.assigned_work.pop(node, None)
                node.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            # A worker holds back its last item until it knows the next one (or must stop).
            for node in self.nodes:
                self._reschedule(node)

        def remove_node(self, node: Any) -> str | None:
            # xdist's scope scheduling gives the crashed case itself out again with the rest of
            # its unit; it has its crash report already, so only the cases after it go back.
            workload = self.assigned_work.pop(node)
            pending = [
                (name, nodeid)
                for name, unit in workload.items()
                for nodeid, done in unit.items()
                if not done
            ]
            if not pending:
                return None
            crashed_unit, crashed = pending[0]
            workload[crashed_unit][crashed] = True
            for name, unit in workload.items():
                if not all(unit.values()):
                    self.workqueue[name] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return str(crashed)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # The next unit goes out when the worker starts the last case of its unit: it
            # needs the next item to know whether its server stops after that case.
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return ServerScopeScheduling(config, log)


# Modes that would split a server's cases over workers, or group them by file only.
TAKEN_OVER_MODES = frozenset({"load", "loadgroup", "worksteal", "loadscope"})
