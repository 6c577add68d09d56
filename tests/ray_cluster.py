"""A Ray cluster of logical GPUs on this host, in a process of its own, for tests and
benchmarks: a head without GPUs and N nodes of G GPUs each (`ray.cluster_utils.Cluster`).

Ray's in-process state does not survive a second Cluster in one process (a segfault in its
GCS client), so each cluster lives in this helper: it prints one JSON line (address, node ids,
the pids of Ray's daemons), then takes commands on stdin, one per line (`remove NODE_ID`), and
shuts the cluster down at end of input.

    python tests/ray_cluster.py NODES GPUS_PER_NODE
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

# Each node maps its object store in /dev/shm: small, on a shared machine.
OBJECT_STORE_BYTES = 100 * 1024**2
_DAEMONS = ("raylet", "gcs_server")


def serve(nodes: int, gpus: int) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
        },
    )
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, num_gpus=gpus, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        by_id = {node.node_id: node for node in cluster.worker_nodes}
        daemons = [
            child.pid
            for child in psutil.Process().children(recursive=True)
            if child.name() in _DAEMONS
        ]
        print(json.dumps({"address": cluster.address, "nodes": list(by_id), "daemons": daemons}))
        sys.stdout.flush()
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "remove":
                cluster.remove_node(by_id.pop(argument))
                print(json.dumps({"removed": argument}))
                sys.stdout.flush()
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


@dataclass
class LocalCluster:
    address: str
    nodes: list[str]  # Ray node ids of the GPU nodes
    daemons: list[int]  # pids of the raylets and the GCS
    process: subprocess.Popen[str]

    def remove(self, node_id: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"remove {node_id}\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        assert reply == {"removed": node_id}, reply


@contextmanager
def local_cluster(nodes: int, gpus: int, env: dict[str, str] | None = None) -> Iterator[Any]:
    """The cluster, shut down on exit; its Ray daemons are gone after, or this raises."""
    process = subprocess.Popen(
        [sys.executable, __file__, str(nodes), str(gpus)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    daemons: list[int] = []
    try:
        assert process.stdout is not None
        started = json.loads(process.stdout.readline() or "{}")
        if "address" not in started:
            raise RuntimeError(f"the Ray cluster did not start (exit {process.wait()})")
        daemons = started["daemons"]
        yield LocalCluster(started["address"], started["nodes"], daemons, process)
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        left = [pid for pid in daemons if _alive(pid)]
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [pid for pid in left if _alive(pid)]
        for pid in left:
            psutil.Process(pid).kill()
        if left:
            raise RuntimeError(f"Ray daemons outlived their cluster: {left}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
