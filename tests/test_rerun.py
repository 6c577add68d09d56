"""`profllm rerun`: the suite a record reproduces (re-validated, with the record's
configuration and seed), the differences from this host, its refusals in one line, and whole
re-runs on the simulated engine that keep the fingerprint and are gated `unchanged`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import run_records, run_suites, write_suite

from pytest_profllm.cli import reproduce
from pytest_profllm.cli.main import main
from pytest_profllm.engine.registry import bundled
from pytest_profllm.engine.secrets import redact
from pytest_profllm.plan.case import Case, expand
from pytest_profllm.plan.suite import load_suite_file
from pytest_profllm.results.fingerprint import digests

SUITES = {
    "serve": """
        name: smoke
        server: {model: sim-8b, max_num_seqs: 8, max_model_len: 4096}
        benchmark: {num_prompts: 12, random_input_len: 64, random_output_len: 8, request_rate: inf}
        thresholds: {completed: {min: 12}}
    """,
    "capacity": """
        server: {model: sim-8b, max_num_seqs: 4}
        benchmark:
          kind: capacity
          num_prompts: 40
          random_input_len: 1024
          random_output_len: 32
          slo: {median_ttft_ms: 100}
          search: {over: request_rate, low: 1, high: 512, precision: 20%}
        regression: {capacity: 10%}
    """,
    "trace": """
        server: {model: sim-8b, enable_prefix_caching: [true, false]}
        benchmark:
          dataset_name: timed_trace
          dataset_path: profllm:trace_example.jsonl
          timed_trace_sec_multiplier: 0.001
          trace_duration_s: 5
          trace_speedup: 4
    """,
    "throughput": """
        server: {model: sim-8b}
        benchmark: {kind: throughput, input_len: 64, output_len: 8, num_prompts: 10}
    """,
    "latency": """
        server: {model: sim-8b}
        benchmark: {kind: latency, batch_size: 2, num_iters: 3, num_iters_warmup: 1}
    """,
    "accuracy": """
        server: {model: sim-8b, enable_tokenizer_info_endpoint: true}
        benchmark: {kind: accuracy, task: profllm_arithmetic_mc, limit: 10}
    """,
}


def record_of(case: Case, engine: str = "sim", run_id: str = "20261128T000000-abcdef-0123456789",
              **extra: Any) -> dict[str, Any]:
    """A record as the plugin writes one for `case` (outcome.py's config block)."""
    return {
        "schema_version": 1, "run_id": run_id, "session_id": "s", "suite": case.suite,
        "source": case.source, "case_id": "x.yaml::a::b", "nodeid": "x", "timestamp": "t",
        "duration": 1.0, "status": "passed",
        "engine": {"name": engine, "reason": "test", "version": "0.1.0", "clock": "virtual"},
        "config": {
            "server": redact(bundled().complete(case.server)),
            "benchmark": case.benchmark.model_dump(mode="json"),
            "engine_args": bundled().describe(),
        },
        "system": {"host": "h", "platform": "p", "python": "3.11"},
        "runtime": {"worker": "w", "server_key": "k"},
        "thresholds": {
            name: threshold.model_dump() for name, threshold in case.thresholds.items()
        },
        **extra,
    }


def first_case(tmp_path: Path, text: str) -> Case:
    path = write_suite(tmp_path, text, "bench_original.yaml")
    suite, lines = load_suite_file(path)
    return expand(suite, str(path), lines)[0]


@pytest.mark.parametrize("kind", list(SUITES))
def test_the_suite_written_revalidates_and_reproduces_the_case(kind: str, tmp_path: Path) -> None:
    case = first_case(tmp_path, SUITES[kind])
    record = record_of(case)
    plan = reproduce.plan_rerun(record)
    written = reproduce.write_suite(plan, tmp_path / "out" / "bench_rerun.yaml")
    suite, lines = load_suite_file(written)
    (again,) = expand(suite, str(written), lines)
    # The same effective configuration and workload, seed included: the same fingerprint.
    assert record_of(again)["config"] == record["config"]
    assert digests(record_of(again)) == digests(record)
    assert again.benchmark.model_dump() == case.benchmark.model_dump()
    assert again.thresholds == case.thresholds
    assert "--profllm-sim-clock=virtual" in plan.pytest_options


def test_the_derived_seed_is_written_and_defaults_are_left_out(tmp_path: Path) -> None:
    case = first_case(tmp_path, SUITES["serve"])
    plan = reproduce.plan_rerun(record_of(case))
    assert plan.suite["benchmark"]["seed"] == case.benchmark.model_dump()["seed"]
    assert case.seed_derived
    assert plan.suite["server"] == {"model": "sim-8b", "max_num_seqs": 8, "max_model_len": 4096}
    # Not gated before: the per-request latencies a single run can judge.
    record = record_of(case, results={"median_ttft_ms": 5.0, "median_e2el_ms": 9.0})
    assert reproduce.plan_rerun(record).suite["regression"] == {
        "median_ttft_ms": "10%", "median_e2el_ms": "10%"
    }


def test_a_throughput_gated_over_repeats_becomes_the_latencies(tmp_path: Path) -> None:
    case = first_case(tmp_path, SUITES["serve"].rstrip() + "\n        repeat: 2\n")
    verdict = {"metric": "output_throughput", "decision": "unchanged", "tolerance": 0.05,
               "higher_is_better": True, "confidence": 0.99}
    record = record_of(case, regression=[verdict], results={"median_ttft_ms": 5.0})
    plan = reproduce.plan_rerun(record)
    assert plan.suite["regression"] == {"median_ttft_ms": "10%"}
    reproduce.write_suite(plan, tmp_path / "bench_again.yaml")  # one case: re-validates


def test_per_repeat_gates_follow_the_sessions_repeats(tmp_path: Path) -> None:
    case = first_case(tmp_path, SUITES["throughput"])
    results = {"tokens_per_second": 900.0, "requests_per_second": 10.0, "elapsed_time": 1.0}
    record = record_of(case, results=results)
    # Run once: nothing a single re-run can judge, and one line says why.
    once = reproduce.plan_rerun(record)
    assert "regression" not in once.suite and "repeat" not in once.suite
    assert once.notes == [
        "not gated: tokens_per_second, requests_per_second: judged on one value per repeat, "
        "and the record's session ran this case once (a verdict needs two repeats a side)"
    ]
    # Run three times: the suite repeats it as often and gates its throughputs.
    thrice = reproduce.plan_rerun(record, repeats=3)
    assert thrice.suite["repeat"] == 3 and not thrice.notes
    assert thrice.suite["regression"] == {"tokens_per_second": "5%", "requests_per_second": "5%"}
    reproduce.write_suite(thrice, tmp_path / "bench_thrice.yaml")  # re-validates
    # A latency run's iterations are judged from one run: gated by default.
    latency = record_of(first_case(tmp_path, SUITES["latency"]),
                        results={"avg_latency_ms": 30.0, "p50_latency_ms": 29.0})
    assert reproduce.plan_rerun(latency).suite["regression"] == {
        "p50_latency_ms": "10%", "avg_latency_ms": "10%"
    }


def test_the_sessions_repeats_are_read_from_its_runs_of_the_fingerprint(tmp_path: Path) -> None:
    case = first_case(tmp_path, SUITES["throughput"])
    runs = [record_of(case, run_id=f"20261128T000000-abcdef-00000000{i}{i}", repeat_index=i)
            for i in range(3)]
    other = record_of(case, run_id="20261128T000000-abcdef-0000000099", repeat_index=5,
                      session_id="another")
    for record in (*runs, other):
        (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    db = tmp_path / "results.db"
    assert main(["ingest", str(db), str(tmp_path)]) == 0
    assert reproduce.session_repeats(runs[0], db, tmp_path) == 3
    assert reproduce.session_repeats(runs[0], None, tmp_path) == 3
    assert reproduce.session_repeats(runs[1], None, None) == 2  # its own index, at least


def test_a_changed_profile_file_and_another_plugin_are_named(tmp_path: Path) -> None:
    profile = tmp_path / "mine.toml"
    profile.write_text("changed\n")
    case = first_case(tmp_path, SUITES["serve"])
    record = record_of(case)
    record["engine"].update(
        version="0.0.9", sim_profile={"name": "mine", "path": str(profile), "sha256": "ab" * 32}
    )
    record["system"].update(gpu_names=["NVIDIA H100 80GB HBM3"], driver_version="550.54")
    record["engine"]["name"] = "vllm"
    record["system"]["vllm_version"] = "0.11.0"
    vllm_plan = reproduce.plan_rerun(record)
    assert "vLLM: 0.0.9 in the record, none here" in vllm_plan.differences
    assert "GPU: NVIDIA H100 80GB HBM3 in the record, none here" in vllm_plan.differences
    assert "driver: 550.54 in the record, none here" in vllm_plan.differences
    record["engine"]["name"] = "sim"
    del record["system"]["vllm_version"]
    record["system"].update(gpu_names=[], driver_version=None)
    plan = reproduce.plan_rerun(record)
    assert f"--profllm-sim-profile={profile}" in plan.pytest_options
    assert any(line.startswith("pytest-profllm: 0.0.9 in the record") for line in plan.differences)
    assert any(line.startswith(f"profile file {profile}: sha256 abababababab in the record")
               for line in plan.differences)


# --- refusals, one line each ---------------------------------------------------------------


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["rerun", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("profllm rerun: ")
    return captured.err.strip()


def database(tmp_path: Path, record: dict[str, Any]) -> Path:
    (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    db = tmp_path / "results.db"
    assert main(["ingest", str(db), str(tmp_path / f"{record['run_id']}.json")]) == 0
    return db


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.db"
    assert refusal(capsys, "r1", "--db", str(missing)).endswith(f"{missing}: no such database")
    assert "is not a run id (a path or a file name?)" in refusal(
        capsys, "results/r1.json", "--db", str(missing)
    )
    case = first_case(tmp_path, SUITES["serve"])
    db = database(tmp_path, record_of(case))
    capsys.readouterr()
    assert refusal(capsys, "r404", "--db", str(db)).endswith(
        f"{db}: no run 'r404' in benchmark_runs"
    )
    (tmp_path / "bench" ).mkdir()
    bench = record_of(case, engine="unknown", run_id="bench-run")
    (tmp_path / "bench" / "bench-run.json").write_text(json.dumps(bench))
    assert "engine unknown): no suite reproduces it" in refusal(
        capsys, "bench-run", "--records", str(tmp_path / "bench")
    )


def test_a_redacted_secret_is_asked_for_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    case = first_case(tmp_path, SUITES["serve"] + "        \n")
    record = record_of(case)
    record["config"]["server"]["api_key"] = "***"
    (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    line = refusal(capsys, record["run_id"], "--records", str(tmp_path), "--no-run")
    assert line.endswith(
        "server.api_key was redacted (***) in the record and cannot be reproduced: supply it "
        "with --secret api_key=VALUE or the environment variable VLLM_API_KEY"
    )
    monkeypatch.setenv("VLLM_API_KEY", "k-1")
    suite = tmp_path / "bench_again.yaml"
    argv = ["rerun", record["run_id"], "--records", str(tmp_path), "--no-run",
            "--write-suite", str(suite)]
    assert main(argv) == 0
    assert "api_key: k-1" in suite.read_text()
    assert suite.stat().st_mode & 0o077 == 0  # the secret's file: its owner's alone


def test_an_existing_suite_file_is_refused_and_replaced_only_with_force_its_owners_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the user's 0644 file was overwritten without a word, and kept its mode, so the
    # suite's api_key was readable by everyone.
    monkeypatch.setenv("VLLM_API_KEY", "k-secret")
    case = first_case(tmp_path, SUITES["serve"])
    record = record_of(case)
    record["config"]["server"]["api_key"] = "***"
    (tmp_path / f"{record['run_id']}.json").write_text(json.dumps(record))
    suite = tmp_path / "mine.yaml"
    suite.write_text("# the user's own notes\n")
    suite.chmod(0o644)
    argv = [record["run_id"], "--records", str(tmp_path), "--no-run", "--write-suite",
            str(suite)]
    assert refusal(capsys, *argv) == (
        f"profllm rerun: --write-suite {suite}: exists; name a new file, or pass --force to "
        "replace it"
    )
    assert suite.read_text() == "# the user's own notes\n"
    assert main(["rerun", *argv, "--force"]) == 0
    assert "api_key: k-secret" in suite.read_text()
    assert suite.stat().st_mode & 0o777 == 0o600
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []


# --- whole re-runs on the simulated engine ----------------------------------------------------


def rerun_cli(pytester: pytest.Pytester, ports: str, run_id: str,
              *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_profllm.cli", "rerun", run_id,
         "--db", "results/results.db", "--out", "again",
         f"--pytest-option=--profllm-ports={ports}", "--pytest-option=--profllm-gpus=4",
         "--pytest-option=--profllm-max-schedule-lag=1000",
         "--pytest-option=--profllm-no-load-cores",
         *more],
        cwd=pytester.path, capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.mark.parametrize(("kind", "clock"), [("serve", "real"), ("capacity", "virtual"),
                                             ("trace", "virtual")])
def test_a_rerun_keeps_the_fingerprint_and_is_gated_unchanged(
    pytester: pytest.Pytester, ports: str, kind: str, clock: str
) -> None:
    pytester.makefile(".yaml", bench_original=SUITES[kind])
    result = run_suites(pytester, ports, f"--profllm-sim-clock={clock}", "--profllm-engine=sim",
                        gpus=None, cache=False)
    assert result.ret == 0, result.stdout.str()
    old = run_records(pytester)[0]
    done = rerun_cli(pytester, ports, old["run_id"])
    assert done.returncode == 0, done.stdout + done.stderr
    (new,) = run_records(pytester, "again")
    assert digests(new) == digests(old)
    assert new["regression"] and {v["decision"] for v in new["regression"]} == {"unchanged"}
    assert new["engine"]["clock"] == clock
    assert "this host: no difference from the record's environment" in done.stdout
    assert f"fingerprint {digests(old)[0]} (the same)" in done.stdout
    with sqlite3.connect(pytester.path / "again" / "results.db") as connection:
        (verdicts,) = connection.execute("SELECT regression FROM benchmark_runs").fetchone()
    assert "unchanged" in verdicts


def test_a_latency_rerun_is_gated_on_its_iterations(pytester: pytest.Pytester, ports: str) -> None:
    # 20 iterations of 8 output tokens: samples enough for the gate, each about 60 ms.
    pytester.makefile(".yaml", bench_original=SUITES["latency"].replace(
        "num_iters: 3", "num_iters: 20, input_len: 16, output_len: 8"))
    result = run_suites(pytester, ports, "--profllm-engine=sim", gpus=None, cache=False)
    assert result.ret == 0, result.stdout.str()
    (old,) = run_records(pytester)
    done = rerun_cli(pytester, ports, old["run_id"])
    assert done.returncode == 0, done.stdout + done.stderr
    (new,) = run_records(pytester, "again")
    assert digests(new) == digests(old)
    verdicts = {v["metric"]: v for v in new["regression"]}
    assert {m: v["decision"] for m, v in verdicts.items()} == {
        "p50_latency_ms": "unchanged", "avg_latency_ms": "unchanged"}
    assert verdicts["avg_latency_ms"]["samples"] == verdicts["avg_latency_ms"][
        "baseline_samples"] == 20
    assert "gate avg_latency_ms: unchanged (" in done.stdout


def test_a_throughput_run_of_three_repeats_reruns_three_and_is_judged(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_original=SUITES["throughput"].rstrip() + "\n"
                      "        repeat: 3\n")
    result = run_suites(pytester, ports, "--profllm-engine=sim", gpus=None, cache=False)
    assert result.ret == 0, result.stdout.str()
    old = run_records(pytester)[0]
    done = rerun_cli(pytester, ports, old["run_id"])
    assert "repeats: 3, as the record's session ran the case" in done.stdout
    again = run_records(pytester, "again")
    assert len(again) == 3 and all(digests(new) == digests(old) for new in again)
    (last,) = [new for new in again if new["repeat_index"] == 2]
    verdicts = {v["metric"]: v for v in last["regression"]}
    assert sorted(verdicts) == ["requests_per_second", "tokens_per_second"]
    for verdict in verdicts.values():
        assert verdict["decision"] in ("unchanged", "improved", "regressed")
        assert (verdict["samples"], verdict["baseline_samples"]) == (3, 3)
        assert f"gate {verdict['metric']}: {verdict['decision']} (" in done.stdout
    assert done.returncode == (0 if {v["decision"] for v in verdicts.values()} == {"unchanged"}
                               else 1), done.stdout + done.stderr


def test_a_throughput_run_once_reruns_ungated_and_says_why(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(".yaml", bench_original=SUITES["throughput"])
    result = run_suites(pytester, ports, "--profllm-engine=sim", gpus=None, cache=False)
    assert result.ret == 0, result.stdout.str()
    (old,) = run_records(pytester)
    done = rerun_cli(pytester, ports, old["run_id"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the record's session ran this case once" in done.stdout
    assert ("gate: nothing judged (not gated: tokens_per_second, requests_per_second: judged "
            "on one value per repeat") in done.stdout


def test_the_run_page_shows_the_rerun_command(tmp_path: Path) -> None:
    import asyncio

    from datasette.app import Datasette

    case = first_case(tmp_path, SUITES["serve"])
    record = record_of(case, results={"completed": 12, "failed": 0})
    db = database(tmp_path, record)

    async def page() -> str:
        datasette = Datasette([str(db)])
        await datasette.invoke_startup()
        response = await datasette.client.get(f"/results/-/run/{record['run_id']}")
        assert response.status_code == 200
        return str(response.text)

    html = asyncio.run(page())
    assert "<h2>Re-run this case</h2>" in html
    # From where pytest ran: the output folder and the file, as --profllm-out made them.
    assert f"profllm rerun {record['run_id']} --db {tmp_path.name}/results.db" in html
    assert str(tmp_path) not in html  # a page may be public: no folder of the server
