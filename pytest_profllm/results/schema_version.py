"""The results database's schema version, in SQLite's `PRAGMA user_version`: which schema
states there were, reading it, refusing a database newer than this plugin, and setting it.

A load (results/store.py) migrates any older database in its one transaction (the steps add
what is missing, so they do not depend on the number) and sets the version before it commits:
a migration killed half-way leaves the database as it was, version included (SQLite keeps
`user_version` in the file's header, which a rollback restores).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# Each schema state, by the commit that made it. Databases written before the version was
# kept read 0; their state is told by their tables and columns, and a load migrates them all.
HISTORY: dict[int, str] = {
    1: "5863c89: the landing table `runs` and the swept axes `benchmark_axes`",
    2: "76e1748: `run_series`, a run over time",
    3: "c6ecf25: `request_samples` gains conversation, turn and cached_tokens",
    4: "be8632f: `cost_*` columns of energy and money per output token",
    5: "629c97c: `accuracy_*` columns of lm-eval's evaluation",
    6: "979a26f: `engine_clock`, real or the simulator's virtual clock",
    7: "1cb9b20: `engine_sim_profile`, the profile file that priced a simulated run",
    8: "1277b7a: `facet_counts`, the counts each load takes of the faceted columns",
    9: "123b7ac: the `summary_*` tables of the canned queries",
    10: "the version kept in PRAGMA user_version; every load makes all the tables; stored "
    "fingerprints re-derived by today's rules (c6ecf25's random workloads held conversation "
    "keys)",
    11: "`system_host_foreign_cpu_share` (others' share of a load's cores) and "
    "`runtime_client_core_shared` (why the client had no core of its own)",
    12: "`request_samples` gains prompt_len, start_ms and each request's server span "
    "(server_*_ms, client_overhead_*_ms)",
    13: "`system_implied_prefix_cache_hit_rate` and `system_prefix_cache_hit_rate_vs_implied` "
    "(a trace case's ideal prefix-cache hit rate, and the server's over it)",
    14: "`by_adapter`, a LoRA adapter mix's figures per model",
    15: "`system_server_spec_decode_*`: speculative decoding's drafts, accepted tokens, "
    "acceptance rate, mean acceptance length and rate per draft position",
    16: "`until_stopped_by` and `until`: a load sent in rounds until its statistic's interval "
    "was narrow enough, or its cap",
}
SCHEMA_VERSION = max(HISTORY)


class NewerSchema(sqlite3.DatabaseError):
    """A database written by a newer plugin: its tables may mean what this one cannot tell
    (a DatabaseError, so that whoever handles a database it cannot use handles this too)."""

    def __init__(self, db_path: Path | str, version: int) -> None:
        super().__init__(
            f"{db_path}: schema version {version} is newer than this plugin's "
            f"{SCHEMA_VERSION}: upgrade pytest-profllm to read or write it"
        )
        self.version = version


def read(connection: sqlite3.Connection) -> int:
    """The database's schema version (0: written before versions were kept, or empty)."""
    version: int = connection.execute("PRAGMA user_version").fetchone()[0]
    return version


def refuse_newer(connection: sqlite3.Connection, db_path: Path | str) -> int:
    """The version, or NewerSchema where this plugin is older than the database."""
    version = read(connection)
    if version > SCHEMA_VERSION:
        raise NewerSchema(db_path, version)
    return version


# How long the check before a session waits on a locked database; past it, the load at the end
# still refuses a newer schema.
_LOCKED_WAIT_S = 0.5


def refuse_newer_file(db_path: Path) -> None:
    """NewerSchema where the file at `db_path` is a database newer than this plugin; a
    missing file, or one that is not a database, is left to whatever opens it next."""
    if not db_path.is_file():
        return
    try:
        # Not sqlite's default 5 s: a database another process holds locked would stall the
        # session's start that long, then skip the check anyway; a commit takes milliseconds.
        connection = sqlite3.connect(
            f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=_LOCKED_WAIT_S
        )
    except sqlite3.Error:
        return
    try:
        refuse_newer(connection, db_path)
    except NewerSchema:
        raise
    except sqlite3.DatabaseError:
        return
    finally:
        connection.close()


def stamp(connection: sqlite3.Connection) -> None:
    """Sets this plugin's version, inside the open transaction of the migration it ends."""
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
