"""This process's open-file limit: raised to what the hard limit allows, and how many connections
a load may hold open under it. Every connection of the load client is a descriptor; one past
the limit fails with EMFILE in the client, which is no failure of the server."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from dataclasses import dataclass

# Descriptors a load leaves free for what else runs in its process while it runs: the
# telemetry sampler (its /metrics session, psutil's /proc reads, NVML), logs, the database, a
# server's pipes, the event loop's own.
HEADROOM = 64
# Linux refuses a soft limit over fs.nr_open (1,048,576 by default), even under an unlimited
# hard one: never ask for more.
_MOST = 1 << 20
# errno of a socket the client could not open for want of descriptors: its own (EMFILE) or
# the host's (ENFILE).
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

_raised = False


def raise_open_file_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit, once per process; servers started
    afterwards inherit it. Where the system refuses, the limit stays as it was."""
    global _raised
    if _raised:
        return
    _raised = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _MOST if hard == resource.RLIM_INFINITY else min(hard, _MOST)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        # Refused (a container's policy): the connection cap sizes loads to the limit as is.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def open_file_limit() -> int | None:
    """The soft limit on this process's descriptors; None where there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def descriptors_in_use() -> int:
    """How many descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
    except OSError:
        return 0  # no /proc: the headroom alone is kept


def connection_cap(limit: int | None, in_use: int, headroom: int = HEADROOM) -> int | None:
    """The most connections a load may open under `limit` descriptors with `in_use` already
    held, keeping `headroom` free; None where there is no limit. At least one: a load sends."""
    if limit is None:
        return None
    return max(1, limit - max(0, in_use) - max(0, headroom))


@dataclass(frozen=True)
class ClientCap:
    """The connections this process's load may open, and the limit that set them."""

    connections: int | None  # None: no limit
    open_file_limit: int | None

    @classmethod
    def now(cls) -> ClientCap:
        limit = open_file_limit()
        return cls(connection_cap(limit, descriptors_in_use()), limit)

    def limits(self, wanted: int | None) -> bool:
        """Whether the cap holds a load that would open `wanted` connections (None: one per
        request, all at once) to fewer."""
        return self.connections is not None and (wanted is None or wanted > self.connections)

    def describe(self, connections: int | None = None) -> str:
        """The one line that says so: `connections` where several processes share a load."""
        shown = self.connections if connections is None else connections
        return (
            f"client capped at {shown} concurrent connections: open-file limit "
            f"{self.open_file_limit}"
        )
