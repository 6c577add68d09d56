"""CPU core sets as devices: the pool of sets, the server's binding, the client's core."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_profllm.hosts.devices import (
    core_sets,
    cores_of,
    cpu_model,
    cpu_pool,
    device_env,
    usable_cores,
)
from pytest_profllm.hosts.pool import Lease, LeaseTimeout
from pytest_profllm.server.launch import launch


@pytest.mark.parametrize(
    ("spec", "cores", "expected"),
    [
        (None, [0, 1], ("1",)),  # the first core stays with the client
        (None, [0], ("0",)),
        (None, list(range(8)), ("1-7",)),
        (1, [0, 1], ("1",)),
        (1, [0], ("0",)),  # one core: its one set shares it with the client
        (2, list(range(8)), ("1-3", "4-6")),  # cores 0 and 7 left to the client
        (("0,2", "4-5"), list(range(8)), ("0,2", "4-5")),
        (("0",), [0], ("0",)),
    ],
)
def test_core_sets(spec: int | tuple[str, ...] | None, cores: list[int], expected: object) -> None:
    assert core_sets(spec, cores) == expected


def test_core_sets_refuse_what_the_host_lacks() -> None:
    with pytest.raises(ValueError, match=r"core\(s\) 7 are not usable here \(usable: 0-1\)"):
        core_sets(("0", "7"), [0, 1])


@pytest.mark.parametrize(
    ("spec", "cores", "message"),
    [
        # On two cores, two sets would leave the load client none of its own.
        (2, [0, 1], "--profllm-cpus 2: room for 1 core set(s) here (2 usable core(s), core 0 "
                    "stays with the load client): use --profllm-cpus 1"),
        (2, [0], "--profllm-cpus 2: room for 1 core set(s) here (1 usable core(s), core 0 "
                 "stays with the load client): use --profllm-cpus 1"),
        (("0", "1"), [0, 1], "--profllm-cpus: the sets take every usable core (0-1): leave "
                             "core 0 out of them for the load client"),
        (("1-3", "0"), [0, 1, 2, 3], "--profllm-cpus: the sets take every usable core (0-3): "
                                     "leave core 0 out of them for the load client"),
    ],
)
def test_core_sets_leave_the_client_a_core(
    spec: int | tuple[str, ...], cores: list[int], message: str
) -> None:
    with pytest.raises(ValueError) as error:
        core_sets(spec, cores)
    assert str(error.value) == message


def test_cores_of_reads_vllm_lists() -> None:
    assert cores_of("5,2-4") == [5, 2, 3, 4]


def test_a_cpu_lease_binds_the_server(tmp_path: Path, port_range: str) -> None:
    cores = usable_cores()
    low, high = (int(port) for port in port_range.split("-"))
    pool = cpu_pool(tmp_path, 1, range(low, high + 1))
    first = pool.acquire(1, timeout=1)
    try:
        assert first.gpus == core_sets(None, cores)
        assert first.gpu_uuids == ()  # no NVML device to check for foreign processes
        _, env = launch("vllm", {"model": "/m"}, first, device="cpu")
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == first.gpus[0]
        assert "CUDA_VISIBLE_DEVICES" not in env
        # One set only: a second server waits for it.
        with pytest.raises(LeaseTimeout):
            pool.acquire(1, timeout=0.3)
    finally:
        first.release()


def test_a_server_of_two_workers_binds_one_set_each() -> None:
    lease = Lease(("0-1", "2-3"), (), 40000, 40001, 0.0)
    assert device_env("cpu", lease) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert device_env("gpu", Lease(("0", "1"), (), 40000, 40001, 0.0)) == {
        "CUDA_VISIBLE_DEVICES": "0,1"
    }


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
