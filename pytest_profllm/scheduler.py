"""xdist scheduling that keeps every case of one server on one worker, in order.

pytest-xdist 3.8 with pytest 9.2 no longer groups `xdist_group` tests under `--dist loadgroup`
(xdist #1386), so grouping is ours. A suite's cases are children of one collector per server
(`file.yaml::server::workload`), and xdist's scope scheduling hands out whole scopes: one scope
per server, run back to back by one worker, which starts that server once.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# Modes that would split a server's cases over workers; the others already keep them together.
TAKEN_OVER_MODES = frozenset({"load", "loadgroup", "worksteal"})


class ServerScopeScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """One work unit per server: `file.yaml::server` for suites, the module for marked tests."""

    def _split_scope(self, nodeid: str) -> str:
        return nodeid.rsplit("::", 1)[0]
