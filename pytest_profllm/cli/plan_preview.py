"""`profllm plan`: the plan of suite files as it would run, without starting anything: each
server with its exact argv and environment (leased from an empty pool), and its cases."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

from pytest_profllm.engine.registry import registry_for
from pytest_profllm.engine.secrets import REDACTED, is_secret, redact, redact_argv, redact_env
from pytest_profllm.hosts.devices import real_gpus
from pytest_profllm.hosts.pool import default_pool_dir, make_pool
from pytest_profllm.offline.commands import offline_command, offline_env, serve_only_args
from pytest_profllm.options import DEFAULT_PORTS, parse_ports
from pytest_profllm.plan.case import Case
from pytest_profllm.server.launch import engine_args_for, launch, server_env


def shown_id(nodeid: str, path: Path | None) -> str:
    """A case's node id with its file as the user finds it: from the current directory when
    under it, else the absolute path. pytest's ids are from its rootdir, which for suites
    outside the project is the common folder of them and the current directory (from a clone
    under /tmp, `/tmp/x/bench.yaml` read `x/bench.yaml`)."""
    if path is None:
        return nodeid
    _, sep, rest = nodeid.partition("::")
    try:
        shown = path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except (ValueError, OSError):
        shown = str(path.resolve())
    return shown + sep + rest


def plan_document(
    cases: list[tuple[str, Case]],
    engine: str,
    engine_reason: str,
    profile_root: Path = Path("results/profiles"),
) -> dict[str, Any]:
    """What a run would start and measure, as JSON-ready data, for the cases pytest collected
    (node id, case): YAML suites and marked tests alike.

    Each server's argv and environment are those `launch` gives for the lease an empty pool
    would hand out (the default pool: NVML's GPUs for vLLM, else 8 virtual ones; the default
    ports): the plan itself leases nothing.
    """
    registry = registry_for(engine)
    real = real_gpus("virtual" if engine == "sim" else "gpu")
    pool = make_pool(default_pool_dir(), None, parse_ports(DEFAULT_PORTS), real)
    servers: dict[str, dict[str, Any]] = {}
    listed: list[dict[str, Any]] = []
    for nodeid, case in cases:
        if case.kind not in SERVED_KINDS:
            listed.append(_offline_entry(engine, case, nodeid, pool, registry))
            continue
        if case.server_key not in servers:
            lease = pool.lease_when_empty(case.gpus_needed)
            engine_args, _ = engine_args_for(case, profile_root)
            argv, env = launch(engine, engine_args, lease, registry)  # type: ignore[arg-type]
            entry = {
                "server_key": case.server_key,
                "label": case.server_label,
                "suite": case.suite,
                "gpus_needed": case.gpus_needed,
                "axes": _shown_axes(case, "server."),
                "config": redact(case.server),
                "argv": redact_argv(argv),
                "env": redact_env(env),
            }
            if case.gpus_needed > len(pool.gpu_ids):
                entry["problem"] = (
                    f"needs {case.gpus_needed} GPUs but the default pool has "
                    f"{len(pool.gpu_ids)}: skipped unless --profllm-gpus gives more"
                )
            servers[case.server_key] = entry
        listed.append(
            {
                "case_id": nodeid,
                "suite": case.suite,
                "kind": case.kind,
                "server_key": case.server_key,
                "repeat_index": case.repeat_index,
                "axes": _shown_axes(case, "benchmark."),
                "benchmark": case.benchmark.model_dump(mode="json"),
                "thresholds": {k: v.model_dump() for k, v in case.thresholds.items()},
            }
        )
    where = "NVML's GPUs" if real else f"{len(pool.gpu_ids)} virtual GPUs"
    return {
        "engine": engine,
        "engine_reason": engine_reason,
        "engine_args": registry.describe(),
        "lease": (
            f"argv and env as leased from an empty pool ({where}, ports {DEFAULT_PORTS}); "
            "a run leases GPUs and ports when each server starts"
        ),
        "servers": list(servers.values()),
        "cases": listed,
    }


# Kinds whose cases are measured against a server (the rest run a command of their own).
SERVED_KINDS = ("serve", "capacity", "accuracy")


def _shown_axes(case: Case, prefix: str) -> dict[str, Any]:
    def shown(key: str, value: Any) -> Any:
        if is_secret(key.split(".")[-1]):
            return REDACTED
        # JSON has no infinity; records write "inf" too.
        return "inf" if isinstance(value, float) and math.isinf(value) else value

    return {
        key.removeprefix(prefix): shown(key, value)
        for key, value in case.axis_values
        if key.startswith(prefix)
    }


def _offline_entry(
    engine: str, case: Case, case_id: str, pool: Any, registry: Any
) -> dict[str, Any]:
    """An offline case runs its own command, no server: the plan shows that command."""
    lease = pool.lease_when_empty(case.gpus_needed)
    output = Path("<out>/logs") / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', case_id)}.json"
    argv = offline_command(engine, case.benchmark, case.server, output, registry)  # type: ignore[arg-type]
    entry: dict[str, Any] = {
        "case_id": case_id,
        "suite": case.suite,
        "kind": case.kind,
        "server_key": case.server_key,
        "repeat_index": case.repeat_index,
        "gpus_needed": case.gpus_needed,
        "axes": _shown_axes(case, "benchmark."),
        "argv": redact_argv(argv),
        "env": redact_env({**server_env(lease), **offline_env(case.server)}),
        "benchmark": case.benchmark.model_dump(mode="json"),
        "thresholds": {k: v.model_dump() for k, v in case.thresholds.items()},
    }
    left_out = serve_only_args(case.server, registry)
    if left_out:
        entry["serve_only_args"] = left_out  # `vllm serve` options an engine alone lacks
    return entry


def plan_lines(document: dict[str, Any]) -> list[str]:
    """The plan as text; each server's command line can be pasted into a shell as it is."""
    lines = [f"engine {document['engine']} ({document['engine_reason']})"]
    for server in document["servers"]:
        env = [f"{key}={shlex.quote(value)}" for key, value in server["env"].items()]
        axes = _axes_text(server["axes"])
        lines.append(
            f"server {server['label']} [{server['server_key']}] "
            f"({server['gpus_needed']} GPU(s){'; axes: ' + axes if axes else ''}): "
            f"{' '.join(env)} {shlex.join(server['argv'])}"
        )
        for case in document["cases"]:
            if case["server_key"] == server["server_key"]:
                axes = _axes_text(case["axes"])
                lines.append(f"  case {case['case_id']}" + (f" (axes: {axes})" if axes else ""))
    for case in document["cases"]:
        if case.get("kind", "serve") not in SERVED_KINDS:
            env = [f"{key}={shlex.quote(value)}" for key, value in case["env"].items()]
            lines.append(
                f"offline {case['kind']} {case['case_id']} ({case['gpus_needed']} GPU(s)): "
                f"{' '.join(env)} {shlex.join(case['argv'])}"
            )
    lines.append(f"{len(document['servers'])} server(s), {len(document['cases'])} case(s)")
    lines.append(f"({document['lease']})")
    return lines


def _axes_text(axes: dict[str, Any]) -> str:
    return ", ".join(
        f"{key}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"
        for key, value in axes.items()
    )
