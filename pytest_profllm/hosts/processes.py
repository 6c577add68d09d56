"""Processes on this host: a process's tree, a process group's members, processes tagged by an
environment variable, and who listens on a port (psutil)."""

from __future__ import annotations

import os

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants (vLLM's EngineCore and workers), those still alive."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tagged_processes(name: str, value: str) -> list[psutil.Process]:
    """Live processes of this user whose environment has name=value."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(name) == value and alive(process):
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of a process group."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and alive(process):
                members.append(process)
        except (OSError, psutil.Error):
            continue
    return members


def listening_pids(port: int) -> set[int | None]:
    """Pids of the TCP listeners on `port`, any address (None where the kernel does not tell
    us whose it is: another user's process)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {
        c.pid
        for c in connections
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }


def describe_pids(pids: list[int | None]) -> str:
    shown = []
    for pid in pids:
        if pid is None:
            shown.append("a process of another user")
            continue
        try:
            command = " ".join(" ".join(psutil.Process(pid).cmdline()).split())
            shown.append(f"pid {pid}: {command[:80]}")
        except psutil.Error:
            shown.append(f"pid {pid}")
    return "; ".join(shown)


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a reused pid is not the process we knew)."""
    try:
        # is_running() also tells a reused pid from the process we knew.
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# Every process a session starts (workers, servers and their children, wherever they moved)
# inherits this from the session's controller: "pid:start time", which outlives nothing.
OWNER_ENV = "PROFLLM_SESSION_OWNER"


# The environment variable that names a lease pool's folder (hosts/pool.py's POOL_DIR_ENV;
# named here too, as pool.py builds on this module).
POOL_SETTING_ENV = "PROFLLM_POOL_DIR"


def owner_token(pid: int) -> str:
    """A process's identity that a reused pid does not share: its pid and start time."""
    return f"{pid}:{psutil.Process(pid).create_time():.2f}"


def owner_alive(token: str) -> bool:
    pid_text, _, started = token.partition(":")
    try:
        return owner_token(int(pid_text)) == f"{pid_text}:{started}"
    except (ValueError, psutil.Error):
        return False


def orphans_of_dead_sessions(pool_setting: str = "") -> list[psutil.Process]:
    """Live processes of this user started by a session whose controller is gone (killed
    with SIGKILL, or a crashed node): nothing of that session will ever stop them. Only those
    of sessions of the same lease pool (their PROFLLM_POOL_DIR, inherited, equals
    `pool_setting`; empty: the default pool): a pool's sessions clean up after each other,
    as they sweep each other's turn folders, and leave other pools' processes to theirs."""
    found = []
    me = os.getpid()
    for process in psutil.process_iter():
        if process.pid == me:
            continue
        try:
            environment = process.environ()
        except (OSError, psutil.Error):
            continue  # another user's, or gone
        token = environment.get(OWNER_ENV)
        if (token and environment.get(POOL_SETTING_ENV, "") == pool_setting
                and not owner_alive(token) and alive(process)):
            found.append(process)
    return found
