"""CPU core sets as devices: the pool of sets, the server's binding, the client kept off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_profllm.hosts.devices import (
    client_off,
    core_sets,
    cores_of,
    cpu_model,
    cpu_pool,
    device_env,
    leased_cores,
    usable_cores,
)
from pytest_profllm.hosts.pool import Lease
from pytest_profllm.server.launch import launch


@pytest.mark.parametrize(
    ("spec", "cores", "expected"),
    [
        (None, [0, 1], ("1",)),  # the first core stays with the client
        (None, [0], ("0",)),
        (None, list(range(8)), ("1-7",)),
        (2, [0, 1], ("0", "1")),
        (2, list(range(7)), ("0-2", "3-5")),  # core 6 left to the client
        (("0,2", "4-5"), list(range(8)), ("0,2", "4-5")),
    ],
)
def test_core_sets(spec: int | tuple[str, ...] | None, cores: list[int], expected: object) -> None:
    assert core_sets(spec, cores) == expected


def test_core_sets_refuse_what_the_host_lacks() -> None:
    with pytest.raises(ValueError, match="only 2 usable core"):
        core_sets(3, [0, 1])
    with pytest.raises(ValueError, match=r"core\(s\) 7 are not usable here \(usable: 0-1\)"):
        core_sets(("0", "7"), [0, 1])


def test_cores_of_reads_vllm_lists() -> None:
    assert cores_of("5,2-4") == [5, 2, 3, 4]


def test_a_cpu_lease_binds_the_server_and_keeps_the_client_off(
    tmp_path: Path, port_range: str
) -> None:
    cores = usable_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 usable cores")
    low, high = (int(port) for port in port_range.split("-"))
    pool = cpu_pool(tmp_path, 2, range(low, high + 1))
    first = pool.acquire(1, timeout=1)
    second = pool.acquire(1, timeout=1)
    try:
        assert {first.gpus, second.gpus} == {(core_sets(2, cores)[0],), (core_sets(2, cores)[1],)}
        assert first.gpu_uuids == ()  # no NVML device to check for foreign processes
        _, env = launch("vllm", {"model": "/m"}, first, device="cpu")
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == first.gpus[0]
        assert "CUDA_VISIBLE_DEVICES" not in env
        taken = leased_cores("cpu", first)
        with client_off(taken):
            assert not os.sched_getaffinity(0) & set(taken)
        assert os.sched_getaffinity(0) == set(cores)
    finally:
        first.release()
        second.release()


def test_a_server_of_two_workers_binds_one_set_each() -> None:
    lease = Lease(("0-1", "2-3"), (), 40000, 40001, 0.0)
    assert device_env("cpu", lease) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert device_env("gpu", Lease(("0", "1"), (), 40000, 40001, 0.0)) == {
        "CUDA_VISIBLE_DEVICES": "0,1"
    }


def test_client_off_leaves_the_client_alone_when_no_core_would_be_left() -> None:
    before = os.sched_getaffinity(0)
    with client_off(sorted(before)):
        assert os.sched_getaffinity(0) == before


def test_cpu_model_names_the_cpu() -> None:
    assert cpu_model().strip()


def test_a_cpu_vllm_session_leases_core_sets_and_binds_its_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_profllm.engine.choice import EngineChoice
    from pytest_profllm.engine.install import VllmInstall
    from pytest_profllm.options import Settings
    from pytest_profllm.session.identity import RunIdentity
    from pytest_profllm.session.worker import WorkerSession

    monkeypatch.setenv("PROFLLM_POOL_DIR", str(tmp_path))
    install = VllmInstall(
        "/envs/vllm-cpu/bin/python", "vllm-cpu", "0.32.0", "cpu",
        "vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.cli_args", True,
    )
    settings = Settings(
        out_dir=None, db_path=None, engine="vllm", gpus=None, ports=range(40000, 40020),
        startup_timeout=1.0, lease_timeout=1.0, suite_glob="bench_*.yaml", cpus=("0",),
    )
    identity = RunIdentity("s", EngineChoice("vllm", "test", "0.32.0", install))
    worker = WorkerSession(settings, identity, "main")
    assert worker.pool.gpu_ids == ("0",)
    assert (worker.servers.device, worker.servers.vllm) == ("cpu", install)
    # And through xdist's hand-over to a worker.
    assert RunIdentity.from_workerinput(identity.to_workerinput()) == identity


def test_the_simulator_leases_virtual_gpus_on_a_gpu_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On an H100 host a job holding the GPU failed every simulated case ("leased GPU(s) in use
    # by a process profllm did not start"): the simulator uses no GPU, so it leases none.
    from pytest_profllm.engine.choice import EngineChoice
    from pytest_profllm.hosts import nvml
    from pytest_profllm.hosts.pool import VIRTUAL_PREFIX
    from pytest_profllm.options import Settings
    from pytest_profllm.session.identity import host_pool

    monkeypatch.setenv("PROFLLM_POOL_DIR", str(tmp_path))
    h100 = nvml.Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-52720938", 81559.0)
    monkeypatch.setattr(nvml, "discover", lambda: nvml.GpuHost((h100,), "580.159.04"))
    settings = Settings(
        out_dir=None, db_path=None, engine="auto", gpus=None, ports=range(40000, 40020),
        startup_timeout=1.0, lease_timeout=1.0, suite_glob="bench_*.yaml",
    )
    simulated = host_pool(settings, EngineChoice("sim", "test", None))
    assert simulated.gpu_ids == tuple(str(i) for i in range(8))
    assert all(name.startswith(VIRTUAL_PREFIX) for name in simulated.gpu_lock_names)
    real = host_pool(settings, EngineChoice("vllm", "test", "0.33.0"))
    assert (real.gpu_ids, real.gpu_lock_names) == (("0",), ("GPU-52720938",))
