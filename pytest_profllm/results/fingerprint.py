"""A run's fingerprint: what must be equal for two runs to be compared. The effective server
configuration, the workload, the engine and its version, the device model and count, and the
simulated engine's clock where it is virtual, and the simulator's profile file where one
priced the run; for an accuracy case, its task as lm-eval ran it (the digest of its
configuration and data) and lm-eval's version.

The workload's `seed` is left out: it draws other prompts of the same distribution, which is
the noise a gate must tolerate, not another workload.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import orjson

from pytest_profllm.results.record import SIM_DEFAULT_DEVICE, sim_device

_NOT_THE_WORKLOAD = ("seed",)
# Keys that shape one dataset's workload only (by prefix: the dataset they belong to). Under
# another dataset they change nothing, and records written before they existed lack them:
# left out there, a run's fingerprint stays what it was, and its baselines still match.
_ONE_DATASET_KEYS = {
    "conversation_": "conversation",
    "timed_trace_": "timed_trace",
    "trace_": "timed_trace",
    "self_timed": "timed_trace",
    "random_mm_": "random-mm",
    "spec_bench_": "spec_bench",
    "speed_bench_": "speed_bench",
}
# Keys that shape a pooling backend's workload only (prompts to a request).
_POOLING_KEYS = ("random_batch_size",)
_POOLING_BACKENDS = ("openai-embeddings", "vllm-rerank")


# Keys left out at their default value: records written before the key existed lack it, and
# their runs were measured the same way.
_LEFT_OUT_AT_DEFAULT = {"warm_cache": False}


@functools.lru_cache(maxsize=4096)
def _datasets_of(key: str) -> frozenset[str]:
    """The datasets whose prefixes `key` starts with (empty: a key of every workload). Cached:
    an ingest asks it for 60 keys of each of 100,000 records, of a few dozen names."""
    return frozenset(name for prefix, name in _ONE_DATASET_KEYS.items()
                     if key.startswith(prefix))


def _of_the_workload(key: str, benchmark: dict[str, Any]) -> bool:
    if key in _NOT_THE_WORKLOAD:
        return False
    if key in _LEFT_OUT_AT_DEFAULT and benchmark.get(key) == _LEFT_OUT_AT_DEFAULT[key]:
        return False
    if key in _POOLING_KEYS:
        return benchmark.get("backend") in _POOLING_BACKENDS
    datasets = _datasets_of(key) if key.__class__ is str else frozenset()
    return not datasets or datasets == {benchmark.get("dataset_name")}


def fingerprint(record: dict[str, Any], with_version: bool = True) -> dict[str, Any]:
    config = record.get("config") or {}
    engine = record.get("engine") or {}
    system = record.get("system") or {}
    runtime = record.get("runtime") or {}
    workload = config.get("benchmark") or {}
    benchmark = {
        key: value for key, value in workload.items() if _of_the_workload(key, workload)
    }
    parts: dict[str, Any] = {
        "server": config.get("server") or {},
        "benchmark": benchmark,
        "engine": engine.get("name"),
        # The simulator has no device model: its GPUs are virtual.
        "device_model": sorted(set(system.get("gpu_names") or [])) or None,
        "device_count": len(runtime.get("gpus") or []),
    }
    if engine.get("clock") == "virtual":
        # A prediction on the virtual clock is never compared with a measurement (nor the
        # reverse); real-time runs keep the fingerprint they had before the clock was recorded.
        parts["clock"] = "virtual"
    # A profile file (--profllm-sim-profile) by the digest of its bytes: runs it priced are
    # never compared with runs another profile priced, or none. Left out where there is none,
    # so the fingerprints of runs without one stay what they were.
    sim_profile = engine.get("sim_profile")
    if isinstance(sim_profile, dict):
        parts["sim_profile"] = sim_profile.get("sha256")
    elif (modelled := sim_device(engine)) not in (None, SIM_DEFAULT_DEVICE):
        # A shipped profile other than the default (--profllm-sim-device): a run simulated as
        # an A100 is never gated against one simulated as an H100. Left out at the default,
        # so the fingerprints of runs on it stay what they were.
        parts["sim_device"] = modelled
    if with_version:
        parts["engine_version"] = engine.get("version")
        parts["engine_args_version"] = (config.get("engine_args") or {}).get("vllm_version")
    accuracy = record.get("accuracy")
    if isinstance(accuracy, dict):
        parts.update(accuracy_parts(accuracy.get("task_hash"), accuracy.get("lm_eval_version"),
                                    with_version))
    return parts


def accuracy_parts(
    task_hash: Any, lm_eval_version: Any, with_version: bool = True
) -> dict[str, Any]:
    """An accuracy case's parts: a changed task (its data, its prompt) is another
    measurement, and so is another lm-eval (its scoring). Only accuracy records have them, so
    every other run's fingerprint stays what it was."""
    parts = {"accuracy_task_hash": task_hash}
    if with_version:
        parts["lm_eval_version"] = lm_eval_version
    return parts


def upgraded(parts: dict[str, Any], task_hash: Any, lm_eval_version: Any) -> tuple[str, str]:
    """Both digests of a stored run whose parts (with the versions) predate the accuracy
    parts: what `digests` gives its record now."""
    now = {**parts, **accuracy_parts(task_hash, lm_eval_version)}
    return digest(now), digest({k: v for k, v in now.items() if k not in _VERSIONS})


def rederived(parts: dict[str, Any]) -> tuple[str, str, str]:
    """A stored run's digests (with the version, without) and canonical parts by today's
    rules, from the parts an earlier version stored: its workload without the keys that are
    not of it (the conversation keys that a random workload's fingerprint held for a while).
    What the parts lack (clock, profile) such runs never had."""
    now = dict(parts)
    benchmark = parts.get("benchmark")
    if isinstance(benchmark, dict):
        now["benchmark"] = {key: value for key, value in benchmark.items()
                            if _of_the_workload(key, benchmark)}
    return digest(now), digest({k: v for k, v in now.items() if k not in _VERSIONS}), \
        _canonical(now)


def digest(parts: dict[str, Any]) -> str:
    return _hash(_canonical(parts))


def digests(record: dict[str, Any], cache: dict[Any, str] | None = None) -> tuple[str, str]:
    """(with the engine version, without it)."""
    with_version, any_version, _ = described(record, cache)
    return with_version, any_version


def described(
    record: dict[str, Any], cache: dict[Any, str] | None = None
) -> tuple[str, str, str]:
    """Both digests and the canonical JSON of the parts (with the version). The canonical
    JSON of both is assembled from one dump of each part: the server block (every engine
    argument) is most of the cost, and `cache` keeps its dump for records that share it (an
    ingest's batch)."""
    with_version = fingerprint(record, True)
    dumped = {
        name: _cached_dump(value, cache) if isinstance(value, dict) else _dump(value)
        for name, value in with_version.items()
    }
    without = {name: text for name, text in dumped.items() if name not in _VERSIONS}
    canonical = _join(dumped)
    return _hash(canonical), _hash(_join(without)), canonical


_VERSIONS = ("engine_version", "engine_args_version", "lm_eval_version")


def _cached_dump(block: dict[str, Any], cache: dict[Any, str] | None) -> str:
    # Keyed by orjson's dump (ten times faster than json's, but not the same text), in the
    # block's own order (a third of the cost of sorting 300 keys): records written by one
    # writer list a block's keys alike, and a block listed otherwise only misses the cache.
    if cache is None:
        return _dump(block)
    try:
        key = orjson.dumps(block)
    except (TypeError, orjson.JSONEncodeError):
        return _dump(block)  # what orjson cannot write (an integer past 64 bits): no cache
    text = cache.get(key)
    if text is None:
        text = cache[key] = _dump(block)
    return text


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _join(dumped: dict[str, str]) -> str:
    # What _dump of the whole mapping writes: its keys sorted, each with its value's dump.
    return "{" + ",".join(f"{json.dumps(name)}:{dumped[name]}" for name in sorted(dumped)) + "}"


def _canonical(parts: dict[str, Any]) -> str:
    return _dump(parts)


def _hash(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
