"""The whole path through real pytest runs: suites -> servers (the simulated engine, real
processes on loopback) -> records -> results.db, with and without xdist."""

from __future__ import annotations

import gzip
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import assert_invalid, records, run_records, run_suites

from conftest import ExampleRun
from pytest_profllm.sim.hardware import PROFILE_DIR

REPO = Path(__file__).resolve().parent.parent
SMALL_WORKLOAD = """
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: 8
"""


def db_rows(pytester: pytest.Pytester, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        return db.execute(sql).fetchall()


def test_example_suites_with_two_workers(example_run: ExampleRun) -> None:
    # README's main job, run once for the session (conftest.py `example_run`; the browser's
    # pages read the same run): the capacity, lora, parallel and trace suites on the virtual
    # clock, the others in real time at -n 2, into one results folder.
    virtual = example_run.virtual
    virtual.assert_outcomes(passed=12)
    virtual.stdout.fnmatch_lines(
        [
            "profllm: engine sim (--profllm-sim-clock virtual*",
            "*profllm benchmark results*",
            "12 row(s) loaded into *results.db (table benchmark_runs)*",
        ]
    )
    result = example_run.result
    result.assert_outcomes(passed=10)
    result.stdout.fnmatch_lines(
        [
            "profllm: engine sim (auto: *",
            "*profllm benchmark results*",
            "10 row(s) loaded into *results.db (table benchmark_runs)*",
        ]
    )
    written = records(example_run.results)
    assert len(written) == 22
    with sqlite3.connect(example_run.results / "results.db") as db:
        assert db.execute("select count(*) from benchmark_runs").fetchall() == [(22,)]
    assert {r["engine"]["name"] for r in written} == {"sim"}
    assert {r["status"] for r in written} == {"passed"}
    by_clock: dict[str, list[dict[str, Any]]] = {}
    for record in written:
        by_clock.setdefault(record["engine"]["clock"], []).append(record)
    real = by_clock.pop("real")
    virtual_records = by_clock.pop("virtual")
    assert not by_clock
    virtual_suites = sorted({r["suite"] for r in virtual_records})
    assert virtual_suites == ["capacity", "lora", "parallel", "speculative", "trace"]
    assert {r["runtime"]["worker"] for r in real} <= {"gw0", "gw1"}
    # One start per server configuration: its cases all saw the same server start.
    starts: dict[str, set[float]] = {}
    for record in real:
        starts.setdefault(record["runtime"]["server_key"], set()).add(
            record["runtime"]["server_started_at"]
        )
    # The conversation suite's sets enable_prompt_tokens_details, so it is a server of its
    # own; the multimodal and pooling suites' models are their own.
    assert len(starts) == 7
    assert all(len(times) == 1 for times in starts.values())
    # The capacity suite's server is the smoke suite's (the same arguments): in real time
    # its cases share the smoke cases' servers, which the server key decides.
    smoke = {r["runtime"]["server_key"] for r in real if r["suite"] == "smoke"}
    capacity = {r["runtime"]["server_key"] for r in virtual_records if r["suite"] == "capacity"}
    assert len(smoke) == 2 and capacity == smoke
    # Per-request records beside each case record.
    assert len(list(example_run.results.glob("*.requests.jsonl.gz"))) == 22
    assert len(list((example_run.results / "logs").glob("*.log"))) == 7
    # Every record holds every engine argument of the registry, defaults included.
    for record in written:
        assert len(record["config"]["server"]) == 320
        assert record["config"]["engine_args"]["vllm_version"] == "0.33.0"


def test_missed_threshold_fails_only_its_case(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(
        ".yaml",
        bench_gate="""
server:
  model: Qwen/Qwen3-8B
benchmark:
  num_prompts: 6
  random_input_len: 32
  random_output_len: [8, 16]
thresholds:
  total_output_tokens: {max: 60}
""",
    )
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "total_output_tokens = 96 > max 60 (threshold missed)",
        ]
    )
    by_case = {r["case_id"]: r for r in run_records(pytester)}
    failed = by_case["bench_gate.yaml::qwen3-8b::random-out16"]
    assert failed["status"] == "failed"
    assert failed["threshold_results"] == [
        {
            "metric": "total_output_tokens",
            "bound": "max",
            "limit": 60.0,
            "value": 96.0,
            "passed": False,
        }
    ]
    assert by_case["bench_gate.yaml::qwen3-8b::random-out8"]["status"] == "passed"
    assert db_rows(
        pytester, "select status, failed_verdicts from benchmark_runs order by status"
    ) == [("failed", "total_output_tokens"), ("passed", None)]


# A busy host: every paced client also falls short of its target rate (a reason named before
# the lag's), as a loaded 2-core host makes it.
BUSY_HOST = (
    "import pytest_profllm.load.metrics as busy\nbusy.MIN_ACHIEVED_RATE_FRACTION = 2.0\n"
)


def test_client_that_fell_behind_is_invalid_not_passed(
    pytester: pytest.Pytester, ports: str
) -> None:
    # Any client CPU counts as saturated: the case must fail as invalid, apart from a miss.
    # On a busy host the client's other reasons (lag, achieved rate) may come with it, in
    # any order: the test asserts the reason is named, not where.
    pytester.makeconftest(
        "import pytest_profllm.load.metrics as metrics\nmetrics.MAX_CLIENT_CPU_PERCENT = 0.0\n"
        + BUSY_HOST
    )
    pytester.makefile(
        ".yaml",
        bench_slow="server:\n  model: Qwen/Qwen3-8B\n" + SMALL_WORKLOAD,
    )
    # One attempt: the rule itself (tests/test_cold_cache.py measures again).
    result = run_suites(pytester, ports, "--profllm-remeasure=0")
    assert_invalid(result, 1)
    # Invalid, for the client: its reasons may come in any order, and a busy host adds its own.
    result.stdout.fnmatch_lines(
        ["INVALID * - invalid measurement: client fell behind:"
         "*client CPU saturated (*% of a core)*"]
    )
    (record,) = run_records(pytester)
    assert record["status"] == "invalid"
    assert record["message"].startswith("client fell behind: ")
    assert "client CPU saturated" in record["message"]
    assert record["threshold_results"] == []
    assert record["results"]["completed"] == 6
    assert "p99_schedule_lag_ms" in record["results"]
    assert db_rows(pytester, "select status from benchmark_runs") == [("invalid",)]


BAD_SUITES = {
    "yaml-error": ("server:\n  model: [unclosed\n", "bench_bad.yaml:2: invalid YAML: expected *"),
    "unknown-key": (
        "server:\n  model: m\nbenchmrk:\n  num_prompts: 2\n",
        "bench_bad.yaml:3: unknown key 'benchmrk' (did you mean 'benchmark'?); allowed: *",
    ),
    "wrong-type": (
        "server:\n  model: m\nbenchmark:\n  num_prompts: many\n",
        "bench_bad.yaml:4: benchmark.num_prompts: Input should be a valid integer*",
    ),
    "unknown-engine-argument": (
        "server:\n  model: m\n  max_num_seq: 4\n",
        "bench_bad.yaml:3: server.max_num_seq: unknown engine argument of vLLM 0.33.0 "
        "(did you mean 'max_num_seqs'?)",
    ),
    "bad-engine-argument-value": (
        "server:\n  model: m\n  dtype: [half, fp9]\n",
        "bench_bad.yaml:3: server.dtype[1]: takes one of 'auto', 'bfloat16', 'float', "
        "'float16', 'float32', 'half' (got 'fp9')",
    ),
    "unknown-metric": (
        "server:\n  model: m\nthresholds:\n  median_ttft: {max: 5}\n",
        "bench_bad.yaml:4: unknown metric 'thresholds.median_ttft' "
        "(did you mean 'median_ttft_ms'?); allowed: *",
    ),
}


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
@pytest.mark.parametrize("kind", list(BAD_SUITES))
def test_bad_suite_fails_its_collection_and_others_run(
    pytester: pytest.Pytester, ports: str, kind: str, xdist: list[str]
) -> None:
    text, message = BAD_SUITES[kind]
    pytester.makefile(".yaml", bench_bad=text)
    pytester.makefile(".yaml", bench_good="server:\n  model: Qwen/Qwen3-8B\n" + SMALL_WORKLOAD)
    result = run_suites(pytester, ports, *xdist)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*ERROR collecting bench_bad.yaml*", message])
    result.stdout.no_fnmatch_line("*Traceback*")
    result.assert_outcomes(passed=1, errors=1)
    assert [r["case_id"] for r in run_records(pytester)] == ["bench_good.yaml::qwen3-8b::random"]


def test_server_that_dies_at_start_fails_its_cases(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(
        ".yaml",
        bench_dead="server:\n  model: ./no-such-model\nbenchmark:\n  num_prompts: [2, 3]\n",
    )
    result = run_suites(pytester, ports)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*server no-such-model (sim, port *) exited with code 1 during start-up "
            "(likely cause: model not found)*",
            "*--- last 50 log lines ---*",
            "*model path ./no-such-model does not exist*",
            "*(see the first case)*",
        ]
    )
    written = run_records(pytester)
    assert [r["status"] for r in written] == ["error", "error"]
    assert all("exited with code 1" in r["message"] for r in written)
    # Nothing of it is left: the checks after stop found no survivor, and no process of the
    # run serves this test's ports (the `ports` fixture) or names the model.
    assert [r["runtime"]["server_stop_problems"] for r in written] == [[], []]
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "./no-such-model" in (p.info["cmdline"] or [])
    ]
    assert not left, [p.info["cmdline"] for p in left]


def test_marker_form_gives_the_result_to_the_test(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makepyfile(
        test_marked="""
        import pytest

        MATRIX = dict(
            server={"model": "Qwen/Qwen3-8B", "max_num_seqs": [4, 8]},
            benchmark={"num_prompts": 4, "random_input_len": 16, "random_output_len": 4},
        )

        @pytest.mark.profllm(**MATRIX)
        def test_counts(profllm_result):
            assert profllm_result.results["completed"] == 4
            assert profllm_result.results["total_output_tokens"] == 16

        @pytest.mark.profllm(**MATRIX, thresholds={"completed": {"min": 5}})
        def test_gate(profllm_result):
            pass
        """
    )
    result = run_suites(pytester, ports, "-v")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_marked.py::test_counts[[]qwen3-8b-seqs4/random[]] PASSED*",
            "*completed = 4 < min 5 (threshold missed)*",
        ]
    )
    written = run_records(pytester)
    assert sorted(r["status"] for r in written) == ["failed", "failed", "passed", "passed"]
    assert {r["suite"] for r in written} == {
        "test_marked.py::test_counts",
        "test_marked.py::test_gate",
    }


def test_engine_vllm_without_vllm_is_a_usage_error(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_x="server:\n  model: m\n")
    result = run_suites(pytester, ports, "--profllm-engine=vllm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--profllm-engine vllm: vLLM is not installed*"])


def test_without_out_dir_nothing_is_written(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", bench_x="server:\n  model: Qwen/Qwen3-8B\n" + SMALL_WORKLOAD)
    result = pytester.runpytest_subprocess(f"--profllm-ports={ports}", timeout=300)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["profllm: engine sim (*); no --profllm-out: no files"])
    assert not list(pytester.path.rglob("*.db"))
    assert not list(pytester.path.rglob("*.json"))


def test_secrets_never_reach_files_we_write(pytester: pytest.Pytester, ports: str) -> None:
    # A key travels in VLLM_API_KEY, never in argv; watermark_config is secret to vLLM.
    pytester.makefile(
        ".yaml",
        bench_secret="""
server:
  model: Qwen/Qwen3-8B
  api_key: [sk-topsecret-1, [sk-topsecret-3]]
  hf_token: hf_topsecret_2
  watermark_config: {key: wm-topsecret-5}
benchmark:
  num_prompts: 3
  random_input_len: 16
  random_output_len: 4
""",
    )
    plan = subprocess.run(
        [sys.executable, "-m", "pytest_profllm.cli", "plan", "--json", "bench_secret.yaml"],
        cwd=pytester.path, capture_output=True, text=True, timeout=60, check=True,
    )
    assert "topsecret" not in plan.stdout + plan.stderr
    result = run_suites(pytester, ports)
    # The server got the key: the client's requests, which carry it, were accepted.
    result.assert_outcomes(passed=2)
    for record in run_records(pytester):
        assert record["config"]["server"]["api_key"] == "***"
        assert record["config"]["server"]["hf_token"] == "***"
        assert record["config"]["server"]["watermark_config"] == "***"
    written = [path for path in (pytester.path / "results").rglob("*") if path.is_file()]
    assert any(path.suffix == ".log" for path in written)
    for path in written:
        content = path.read_bytes()
        if path.name.endswith(".gz"):
            content = gzip.decompress(content)
        assert b"topsecret" not in content, path
    result.stdout.no_fnmatch_line("*topsecret*")


def test_several_keys_are_refused_and_an_inherited_key_is_not_half_applied(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several keys would go on the server's command line, readable by any local user.
    pytester.makefile(
        ".yaml",
        bench_keys="server:\n  model: Qwen/Qwen3-8B\n  api_key: [[sk-a, sk-b]]\n" + SMALL_WORKLOAD,
    )
    refused = run_suites(pytester, ports)
    assert (
        "bench_keys.yaml:3: server.api_key[0]: more than one value would go on the server's "
        "command line, which any local user reads (/proc/PID/cmdline); give one"
    ) in refused.stdout.str()
    assert "sk-a" not in refused.stdout.str()
    # A key in the user's shell is not enforced on requests that do not send it (before:
    # every request got 401 while the record said api_key: null).
    (pytester.path / "bench_keys.yaml").unlink()
    pytester.makefile(".yaml", bench_open="server:\n  model: Qwen/Qwen3-8B\n" + SMALL_WORKLOAD)
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-the-shell")
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1)


def test_case_needing_more_gpus_than_the_pool_is_skipped(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_big="server:\n  model: Qwen/Qwen3-8B\n  tensor_parallel_size: [1, 8]\n"
        + SMALL_WORKLOAD,
    )
    result = run_suites(pytester, ports, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([
        "SKIPPED *needs 8 GPUs (tensor x pipeline x data parallel size) but the pool has 4*"
    ])
    assert [r["case_id"] for r in run_records(pytester)] == ["bench_big.yaml::qwen3-8b-tp1::random"]


def test_profiled_suite_writes_a_trace_and_the_record_says_where(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_prof="""
server:
  model: Qwen/Qwen3-8B
  max_num_seqs: 4
  num_gpu_blocks_override: 64
profile: true
benchmark:
  num_prompts: 12
  random_input_len: 48
  random_output_len: 48
  random_prefix_len: 32
""",
    )
    result = run_suites(pytester, ports)
    result.assert_outcomes(passed=1)
    (record,) = run_records(pytester)
    profiling = record["profiling"]
    assert profiling["profiler"] == "torch"
    assert profiling["num_prompts"] == 8
    (trace,) = profiling["traces"]
    path = Path(trace["path"])
    assert path.parent == pytester.path / "results" / "profiles" / (
        f"prof-qwen3-8b-{record['runtime']['server_key']}"
    )
    assert path.name.startswith(record["run_id"]) and path.name.endswith(".pt.trace.json.gz")
    assert trace["size_bytes"] == path.stat().st_size == profiling["trace_bytes"] > 0
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = [e for e in events if e["name"] == "execute_model"]
    # The profiled run: 8 prompts of 48 tokens, so at least 48 scheduler steps, each timed.
    assert len(steps) >= 48 and all(e["ph"] == "X" and e["dur"] > 0 for e in steps)
    system = record["system"]
    assert system["telemetry_samples"] >= 1
    assert system["peak_server_rss_mib"] > 0 and system["peak_client_rss_mib"] > 0
    assert system["peak_gpu_memory_mib"] is None  # no NVML here: null, never 0
    # The run lasts over a second (3 waves of 48 steps): samples fall inside it.
    assert system["peak_kv_cache_usage"] > 0
    # Every prompt shares a 32-token prefix; the 8 admitted after a first one finished (at
    # most 4 run at once) find its two blocks cached.
    assert system["server_prefix_cache_queries"] == 12 * (32 + 48)
    assert system["server_prefix_cache_hits"] >= 8 * 32
    assert system["server_num_preemptions"] is not None
    # The KV cache the server said it had (its cache_config_info): the suite's 64 blocks.
    assert (system["server_num_gpu_blocks"], system["server_kv_block_size"]) == (64, 16)
    assert system["server_kv_cache_tokens"] == 64 * 16
    columns = db_rows(
        pytester,
        "select system_peak_server_rss_mib, system_server_prefix_cache_hit_rate, "
        "system_peak_gpu_memory_mib, json_extract(profiling, '$.trace_bytes') "
        "from benchmark_runs",
    )
    assert columns == [
        (
            system["peak_server_rss_mib"],
            system["server_prefix_cache_hit_rate"],
            None,
            trace["size_bytes"],
        )
    ]


def test_a_client_later_than_the_lag_limit_makes_its_case_invalid(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_paced="server:\n  model: Qwen/Qwen3-8B\n"
        "benchmark:\n  num_prompts: 6\n  random_input_len: 16\n  random_output_len: 4\n"
        "  request_rate: 50\n",
    )
    # As on a busy host, the achieved rate also falls short, and is named first.
    pytester.makeconftest(BUSY_HOST)
    # No client sends within a microsecond of its schedule: the limit is the option's.
    result = run_suites(
        pytester, ports, "--profllm-max-schedule-lag=0.001", "--profllm-remeasure=0"
    )
    assert_invalid(result, 1)
    # Invalid, for the client's lateness: named among its reasons, wherever it stands.
    result.stdout.fnmatch_lines(
        ["*invalid measurement: client fell behind:*p99 schedule lag * ms is over 0.001 ms*"]
    )
    [record] = run_records(pytester)
    assert record["status"] == "invalid"
    assert record["message"].startswith("client fell behind: ")
    assert "p99 schedule lag" in record["message"]


@pytest.mark.parametrize("with_profile", [False, True], ids=["log", "profile-copy"])
def test_a_logs_folder_that_cannot_be_written_errors_each_case_in_one_line(
    pytester: pytest.Pytester, ports: str, with_profile: bool
) -> None:
    # A file where the logs' folder goes stands for any folder the disk refuses (full, read
    # only): neither the server's log nor the session's copy of its profile can be written.
    # (On a full 256 KiB tmpfs both read "No space left on device" the same way.)
    pytester.makefile(
        ".yaml",
        bench_logs="server:\n  model: Qwen/Qwen3-8B\n"
        "benchmark:\n  num_prompts: 2\n  random_input_len: 16\n  random_output_len: 4\n"
        "  request_rate: [4, 8]\n",
    )
    (pytester.path / "results").mkdir()
    (pytester.path / "results" / "logs").write_text("not a folder\n")
    extra: list[str] = []
    if with_profile:
        profile = pytester.path / "host.toml"
        profile.write_bytes((PROFILE_DIR / "h100-sxm.toml").read_bytes())
        extra = ["--profllm-sim-profile", str(profile)]
    result = run_suites(pytester, ports, *extra)
    result.assert_outcomes(failed=2)
    text = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in text and "FileExistsError" not in text
    written = run_records(pytester)
    assert [r["status"] for r in written] == ["error", "error"]
    folder = pytester.path / "results" / "logs"
    first, second = sorted(r["message"] for r in written)
    if with_profile:  # each case tries again, and says the same
        assert first == second == (
            f"cannot write the session's copy of host.toml in {folder}: File exists")
    else:  # the second case of the same server points at the first
        assert first.startswith(f"qwen3-8b: not started: cannot write its log {folder}/")
        assert first.endswith(": File exists") and second == f"{first} (see the first case)"
