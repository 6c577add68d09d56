"""Offline kinds (`benchmark: {kind: throughput | latency}`): suite validation, the command
lines, vLLM's JSON read into results, the simulator's stand-in, and whole runs mixing kinds."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    cases_of,
    needs_vllm_python,
    run_records,
    suite_error,
    vllm_parse,
    write_suite,
)

from pytest_profllm.cli.main import main as cli_main
from pytest_profllm.cli.plan_preview import plan_document, plan_lines
from pytest_profllm.gates.regression import GateSettings, judge_regression
from pytest_profllm.gates.samples import samples_of
from pytest_profllm.offline.commands import bench_args, engine_args, offline_command
from pytest_profllm.offline.results import OfflineResultError, read_results
from pytest_profllm.plan.case import Case, expand
from pytest_profllm.plan.regression import gated_metric
from pytest_profllm.plan.suite import (
    LatencyConfig,
    ThroughputConfig,
    validate_suite,
)
from pytest_profllm.results import gate_tables as tables

DATA = Path(__file__).parent / "data" / "offline"


def offline_cases(text: str, tmp_path: Path) -> list[Case]:
    return cases_of(write_suite(tmp_path, text, "bench_offline.yaml"))


def offline_error(text: str, tmp_path: Path) -> str:
    return suite_error(write_suite(tmp_path, text, "bench_offline.yaml"))


# --- the suite ---------------------------------------------------------------------------


def test_kinds_are_validated_with_vllms_option_names(tmp_path: Path) -> None:
    cases = offline_cases(
        "server: {model: m}\n"
        "benchmark: {kind: throughput, input_len: 64, output_len: 16, num_prompts: [5, 10]}\n",
        tmp_path,
    )
    assert [case.kind for case in cases] == ["throughput", "throughput"]
    assert [case.workload_label for case in cases] == [
        "throughput-random-n5",
        "throughput-random-n10",
    ]
    bench = cases[0].benchmark
    assert isinstance(bench, ThroughputConfig)
    assert (bench.input_len, bench.output_len, bench.backend) == (64, 16, "vllm")
    latency = offline_cases("server: {model: m}\nbenchmark: {kind: latency}\n", tmp_path)[0]
    assert isinstance(latency.benchmark, LatencyConfig)
    assert (latency.benchmark.batch_size, latency.benchmark.num_iters) == (8, 30)  # vLLM's


def test_offline_case_never_shares_a_serve_case_server(tmp_path: Path) -> None:
    serve = offline_cases("server: {model: m}\nbenchmark: {num_prompts: 5}\n", tmp_path)[0]
    offline = offline_cases("server: {model: m}\nbenchmark: {kind: latency}\n", tmp_path)[0]
    assert serve.kind == "serve"
    assert serve.server == offline.server
    assert serve.server_key != offline.server_key


def test_an_option_of_another_kind_is_one_line_with_the_allowed_ones(tmp_path: Path) -> None:
    message = offline_error(
        "server: {model: m}\nbenchmark:\n  kind: latency\n  num_prompts: 5\n", tmp_path
    )
    assert message.count("\n") == 0
    assert message.startswith(f"{tmp_path / 'bench_offline.yaml'}:4: unknown key ")
    assert "'benchmark.num_prompts'" in message
    assert "batch_size" in message and "num_iters_warmup" in message


def test_unknown_kind_and_bad_values_name_file_line_and_key(tmp_path: Path) -> None:
    where = tmp_path / "bench_offline.yaml"
    assert offline_error("server: {model: m}\nbenchmark:\n  kind: offline\n", tmp_path) == (
        f"{where}:3: benchmark.kind: 'offline' is not a benchmark kind; "
        "allowed: serve, capacity, throughput, latency, accuracy"
    )
    message = offline_error(
        "server: {model: m}\nbenchmark:\n  kind: throughput\n  backend: hf\n", tmp_path
    )
    assert message.startswith(f"{where}:4: benchmark.backend: Input should be 'vllm' or ")
    message = offline_error(
        "server: {model: m}\nbenchmark: {kind: throughput, dataset_name: prefix_repetition}\n",
        tmp_path,
    )
    assert "needs prefix_repetition_prefix_len, prefix_repetition_suffix_len" in message


def test_profile_is_for_serve_cases(tmp_path: Path) -> None:
    message = offline_error(
        "server: {model: m}\nbenchmark: {kind: throughput}\nprofile: true\n", tmp_path
    )
    assert message == (
        f"{tmp_path / 'bench_offline.yaml'}:3: profile: true profiles a server; a throughput "
        "case runs none (leave profile out of offline suites)"
    )


def test_thresholds_name_the_kinds_metrics(tmp_path: Path) -> None:
    message = offline_error(
        "server: {model: m}\nbenchmark: {kind: latency}\nthresholds:\n"
        "  p99_ttft_ms: {max: 10}\n",
        tmp_path,
    )
    assert message.startswith(f"{tmp_path / 'bench_offline.yaml'}:4: unknown metric ")
    assert "p99_latency_ms" in message and "avg_latency_ms" in message
    offline_cases(
        "server: {model: m}\nbenchmark: {kind: throughput}\nthresholds:\n"
        "  tokens_per_second: {min: 10}\n",
        tmp_path,
    )


# --- the regression gate -----------------------------------------------------------------


def test_offline_metrics_are_gated_and_the_error_lists_them(tmp_path: Path) -> None:
    latency = offline_cases(
        "server: {model: m}\nbenchmark: {kind: latency}\n"
        "regression: {avg_latency_ms: 5%, p50_latency_ms: null, p99_latency_ms: 20%}\n",
        tmp_path,
    )[0]
    assert latency.regression == {
        "avg_latency_ms": 0.05, "p50_latency_ms": 0.1, "p99_latency_ms": 0.2,
    }
    # Judged as per-request latencies: pooled iteration samples, lower is better.
    avg, p99 = gated_metric("avg_latency_ms", 0.1), gated_metric("p99_latency_ms", 0.1)
    assert (avg.latency, avg.statistic, avg.higher_is_better) == ("e2el", "mean", False)
    assert (p99.latency, p99.statistic, p99.per_repeat) == ("e2el", "99", False)
    throughput = offline_cases(
        "server: {model: m}\nbenchmark: {kind: throughput}\nrepeat: 2\n"
        "regression: [requests_per_second, tokens_per_second, elapsed_time]\n",
        tmp_path,
    )
    assert throughput[0].regression == {
        "requests_per_second": 0.05, "tokens_per_second": 0.05, "elapsed_time": 0.05,
    }
    assert gated_metric("tokens_per_second", 0.05).per_repeat
    assert gated_metric("tokens_per_second", 0.05).higher_is_better
    assert not gated_metric("elapsed_time", 0.05).higher_is_better
    # One value per repeat: one repeat cannot be judged, and the suite says so.
    assert "regression: tokens_per_second is compared on one value per repeat: set 'repeat: 2'" \
        in offline_error(
            "server: {model: m}\nbenchmark: {kind: throughput}\nregression: [tokens_per_second]\n",
            tmp_path,
        )
    assert "p100_latency_ms: a percentile lies strictly between 0 and 100" in offline_error(
        "server: {model: m}\nbenchmark: {kind: latency}\nregression: {p100_latency_ms: 5%}\n",
        tmp_path,
    )
    message = offline_error(
        "server: {model: m}\nbenchmark: {kind: latency}\nregression: {latency_ms: 5%}\n",
        tmp_path,
    )
    assert "cannot gate 'latency_ms'" in message
    assert "avg_latency_ms and pNN_latency_ms" in message
    assert "requests_per_second, tokens_per_second, elapsed_time, client_overhead_ttft_ms, " \
        "client_overhead_e2el_ms (per repeat)" in message


def test_latency_iterations_are_the_gates_samples() -> None:
    results, rows = read_results("latency", DATA / "latency.json")
    seconds = json.loads((DATA / "latency.json").read_text())["latencies"]
    record = {"run_id": "r", "results": results}
    pooled = samples_of(record, rows).latencies["e2el"]
    assert pooled.tolist() == pytest.approx([s * 1000 for s in seconds])
    stored = tables.sample_rows("r", rows)
    assert [(row[2], row[6]) for row in stored] == [(1, s * 1000) for s in seconds]
    # A file written before iterations said they succeeded is read the same.
    bare = [{"index": i, "latency_s": s} for i, s in enumerate(seconds)]
    assert samples_of(record, bare).latencies["e2el"].tolist() == pooled.tolist()
    assert tables.sample_rows("r", bare) == stored
    # The record's figures are the gate's statistics of those samples.
    avg = gated_metric("avg_latency_ms", 0.1)
    run = samples_of(record, rows)
    assert judge_regression(avg, [run], [run], GateSettings()).value == pytest.approx(
        results["avg_latency_ms"]
    )


OFFLINE_GATED = {
    "bench_latency": "server: {model: m}\n"
    "benchmark: {kind: latency, batch_size: 2, input_len: 16, output_len: 4,\n"
    "            num_iters_warmup: 1, num_iters: 20}\n"
    "regression: [avg_latency_ms, p90_latency_ms]\n",
    "bench_throughput": "server: {model: m}\n"
    "benchmark: {kind: throughput, input_len: 16, output_len: 4, num_prompts: 8}\n",
}


def gate_session(
    pytester: pytest.Pytester, ports: str, out: str, *args: str
) -> dict[str, dict[str, Any]]:
    """One session over pytester's suites into `out`; the gated metrics' verdicts, by case."""
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}", f"--profllm-out={out}", "--profllm-max-schedule-lag=1000",
        "--profllm-no-load-cores", "-p", "no:cacheprovider", *args, timeout=300,
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    return {
        record["case_id"].split("::")[-1]: {v["metric"]: v for v in record["regression"]}
        for record in run_records(pytester, out) if record.get("regression")
    }


def test_offline_cases_are_gated_on_iterations_and_repeats(
    pytester: pytest.Pytester, ports: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The baseline: each kind once, as a suite without a gate runs it.
    pytester.makefile(".yaml", **OFFLINE_GATED)
    first = gate_session(pytester, ports, "first")
    assert {metric: v["decision"] for metric, v in first["latency"].items()} == {
        "avg_latency_ms": "no-baseline", "p90_latency_ms": "no-baseline"}
    assert list(first) == ["latency"]
    with sqlite3.connect(pytester.path / "first" / "results.db") as db:
        (latency_run,) = db.execute(
            "SELECT run_id FROM benchmark_runs WHERE bench_kind = 'latency'").fetchone()
        stored = db.execute(
            "SELECT request_index, success, e2el_ms FROM request_samples WHERE run_id = ? "
            "ORDER BY request_index", (latency_run,)).fetchall()
    assert len(stored) == 20 and all(ok == 1 and ms > 0 for _, ok, ms in stored)
    # `profllm ingest` and `rebuild` of the records store the same samples.
    for command in (["ingest", "ingested.db", "first"],
                    ["rebuild", "first", "-o", "rebuilt.db"]):
        assert cli_main(command) == 0
        with sqlite3.connect(pytester.path / command[-1 if command[0] == "rebuild" else 1]) as db:
            assert db.execute(
                "SELECT request_index, success, e2el_ms FROM request_samples WHERE run_id = ? "
                "ORDER BY request_index", (latency_run,)).fetchall() == stored

    # The same engine: latencies unchanged; throughput gated over 3 repeats against 1.
    pytester.makefile(".yaml", bench_throughput=OFFLINE_GATED["bench_throughput"]
                      + "repeat: 3\nregression: [tokens_per_second, elapsed_time]\n")
    again = gate_session(pytester, ports, "second", "--profllm-baseline=first/results.db")
    assert {v["decision"] for v in again["latency"].values()} == {"unchanged"}
    assert again["latency"]["avg_latency_ms"]["samples"] == 20
    assert again["latency"]["avg_latency_ms"]["baseline_samples"] == 20
    throughput = again["throughput-random-r3"]
    assert {v["decision"] for v in throughput.values()} == {"not-judged"}
    assert throughput["tokens_per_second"]["reason"].startswith("fewer than two values")
    assert (throughput["tokens_per_second"]["samples"],
            throughput["tokens_per_second"]["baseline_samples"]) == (3, 1)

    # Twice as slow: the latencies regress; 3 repeats against 3 are judged.
    monkeypatch.setenv("PROFLLM_SIM_SLOWDOWN", "2")
    slow = gate_session(pytester, ports, "third", "--profllm-baseline=second/results.db")
    assert {v["decision"] for v in slow["latency"].values()} == {"regressed"}
    assert slow["latency"]["p90_latency_ms"]["change"] > 0.5
    judged = slow["throughput-random-r3"]
    assert judged["tokens_per_second"]["ci_low"] is not None
    assert judged["tokens_per_second"]["decision"] in ("regressed", "unchanged", "improved")
    assert judged["elapsed_time"]["baseline_samples"] == 3


# --- the command ------------------------------------------------------------------------


def test_throughput_command_is_vllm_bench_throughput_with_engine_args(tmp_path: Path) -> None:
    suite = validate_suite(
        {
            "server": {"model": "m", "max_num_seqs": 16, "api_key": "topsecret", "seed": 3},
            "benchmark": {"kind": "throughput", "input_len": 64, "output_len": 16},
        },
        "marker",
    )
    case = expand(suite, "marker")[0]
    argv = offline_command("vllm", case.benchmark, case.server, tmp_path / "out.json")  # type: ignore[arg-type]
    assert argv[1:4] == ["-P", str(Path(argv[2])), "throughput"]
    assert Path(argv[2]).name == "bench.py"
    tail = argv[4:]
    assert tail[:2] == ["--model", "m"]
    assert "--max-num-seqs" in tail and "--seed" in tail
    # `vllm bench` builds an engine, not a server: no frontend options, no key on the line.
    assert "--api-key" not in tail and "topsecret" not in argv
    assert tail[tail.index("--random-input-len") + 1] == "64"
    assert tail[tail.index("--random-output-len") + 1] == "16"
    assert tail[-2:] == ["--output-json", str(tmp_path / "out.json")]
    sim = offline_command("sim", case.benchmark, case.server, tmp_path / "out.json")  # type: ignore[arg-type]
    assert sim[:4] == [sys.executable, "-m", "pytest_profllm.sim.offline", "throughput"]
    assert sim[4:] == tail


def test_plan_shows_the_offline_commands(tmp_path: Path) -> None:
    path = write_suite(
        tmp_path, "server: {model: m}\nbenchmark:\n  kind: latency\n  batch_size: [1, 4]\n",
        "bench_mixed.yaml",
    )
    cases = [(f"{path.name}::{case.name}", case) for case in cases_of(path)]
    document = plan_document(cases, "sim", "--engine sim")
    assert document["servers"] == []
    assert [case["kind"] for case in document["cases"]] == ["latency", "latency"]
    lines = plan_lines(document)[1:]  # after the engine line
    assert lines[0].startswith("offline latency bench_mixed.yaml::m::latency-bs1 (1 GPU(s)): ")
    assert "CUDA_VISIBLE_DEVICES=" in lines[0]
    assert "pytest_profllm.sim.offline latency --model m --batch-size 1" in lines[0]
    assert "--output-json '<out>/logs/" in lines[0]


# --- vLLM's JSON -------------------------------------------------------------------------


def test_throughput_json_as_vllm_writes_it(tmp_path: Path) -> None:
    results, rows = read_results("throughput", DATA / "throughput.json")
    assert results == {
        "elapsed_time": 41.73268985800003,
        "num_requests": 1000,
        "total_num_tokens": 1152000,
        "requests_per_second": 23.962036584469423,
        "tokens_per_second": 27604.266145308775,
    }
    assert rows == []


def test_latency_json_as_vllm_writes_it_in_seconds_and_ms() -> None:
    results, rows = read_results("latency", DATA / "latency.json")
    assert results["avg_latency"] == 1.0513380288666664
    assert results["avg_latency_ms"] == pytest.approx(1051.3380288666664)
    assert results["p10_latency_ms"] == pytest.approx(1046.0902703999888)
    assert results["p50_latency_ms"] == pytest.approx(1049.7021479998967)
    assert results["p99_latency_ms"] == pytest.approx(1058.9361880408894)
    assert results["num_iters"] == 3
    assert sorted(results) == sorted(
        ["avg_latency", "avg_latency_ms", "num_iters"]
        + [f"p{p}_latency_ms" for p in (10, 25, 50, 75, 90, 99)]
    )
    assert [row["latency_s"] for row in rows] == json.loads(
        (DATA / "latency.json").read_text()
    )["latencies"]


def test_a_result_that_is_not_vllms_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text(json.dumps({"model_id": "m", "elapsed_time": 1.0}))
    with pytest.raises(OfflineResultError) as error:
        read_results("throughput", path)
    assert str(error.value) == (
        f"{path}: not a vllm bench throughput result: 'missing num_requests, "
        "total_num_tokens, requests_per_second, tokens_per_second'"
    )
    with pytest.raises(OfflineResultError, match="wrote no --output-json file"):
        read_results("latency", tmp_path / "absent.json")


# --- the simulator's stand-in ---------------------------------------------------------------


def test_simulator_writes_the_json_shapes_vllm_writes(tmp_path: Path) -> None:
    throughput = ThroughputConfig(kind="throughput", input_len=32, output_len=4, num_prompts=6)
    latency = LatencyConfig(
        kind="latency", batch_size=2, input_len=16, output_len=4, num_iters_warmup=1, num_iters=3
    )
    for bench, fixture in ((throughput, "throughput.json"), (latency, "latency.json")):
        out = tmp_path / f"{bench.kind}.json"
        argv = offline_command("sim", bench, {"model": "sim-model", "max_num_seqs": 4}, out)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        written = json.loads(out.read_text())
        vllms = json.loads((DATA / fixture).read_text())
        assert sorted(written) == sorted(vllms)
        if bench.kind == "latency":
            assert sorted(written["percentiles"]) == sorted(vllms["percentiles"])
            assert len(written["latencies"]) == 3
        else:
            # 6 prompts of 32 tokens, 4 output tokens each.
            assert (written["num_requests"], written["total_num_tokens"]) == (6, 6 * 36)
        read_results(bench.kind, out)


# --- whole runs ------------------------------------------------------------------------------

MIXED = {
    "bench_serve": "server: {model: m, max_num_seqs: 8}\n"
    "benchmark: {num_prompts: 4, random_input_len: 16, random_output_len: 4}\n",
    "bench_throughput": "server: {model: m, max_num_seqs: 8}\n"
    "benchmark: {kind: throughput, input_len: 16, output_len: 4, num_prompts: [4, 8]}\n"
    "thresholds:\n  tokens_per_second: {min: 1.0e12}\n",
    "bench_latency": "server: {model: m}\n"
    "benchmark: {kind: latency, batch_size: 2, input_len: 16, output_len: 4,\n"
    "            num_iters_warmup: 1, num_iters: 3}\n"
    "thresholds:\n  p99_latency_ms: {max: 0.001}\n",
}


def test_suite_mixing_kinds_under_two_workers(pytester: pytest.Pytester, ports: str) -> None:
    pytester.makefile(".yaml", **MIXED)
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}",
        "--profllm-out=results",
        "--profllm-gpus=4",
        "--profllm-max-schedule-lag=1000",
        "-n",
        "2",
        timeout=300,
    )
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines_random(
        [
            "tokens_per_second = * < min 1e+12 (threshold missed)",
            "p99_latency_ms = * > max 0.001 (threshold missed)",
            # The summary gives each kind's own figures, under `offline`: in its row, or on a
            # line of its own below where the terminal is narrow.
            "bench_latency.yaml::m::latency * failed*",
            "*latency: avg * ms, p99 * ms",
            "bench_throughput.yaml::m::throughput-random-n8 * failed*",
            "*throughput: * tok/s, * req/s",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    records = {record["case_id"]: record for record in run_records(pytester)}
    assert sorted(records) == [
        "bench_latency.yaml::m::latency",
        "bench_serve.yaml::m::random",
        "bench_throughput.yaml::m::throughput-random-n4",
        "bench_throughput.yaml::m::throughput-random-n8",
    ]
    kinds = {case_id: r["config"]["benchmark"]["kind"] for case_id, r in records.items()}
    assert sorted(kinds.values()) == ["latency", "serve", "throughput", "throughput"]
    throughput = records["bench_throughput.yaml::m::throughput-random-n8"]
    assert throughput["results"]["num_requests"] == 8
    assert throughput["results"]["total_num_tokens"] == 8 * 20
    assert throughput["results"]["tokens_per_second"] > 0
    assert throughput["runtime"]["gpus"] and throughput["runtime"]["server_stopped_at"]
    latency = records["bench_latency.yaml::m::latency"]
    assert latency["results"]["num_iters"] == 3
    assert 0 < latency["results"]["p10_latency_ms"] <= latency["results"]["p99_latency_ms"]
    assert latency["status"] == "failed"
    assert records["bench_serve.yaml::m::random"]["results"]["completed"] == 4
    with sqlite3.connect(pytester.path / "results" / "results.db") as db:
        rows = db.execute(
            "select case_id, bench_kind, tokens_per_second, p99_latency_ms, completed "
            "from benchmark_runs order by case_id"
        ).fetchall()
    assert [row[:2] for row in rows] == [
        ("bench_latency.yaml::m::latency", "latency"),
        ("bench_serve.yaml::m::random", "serve"),
        ("bench_throughput.yaml::m::throughput-random-n4", "throughput"),
        ("bench_throughput.yaml::m::throughput-random-n8", "throughput"),
    ]
    assert rows[0][3] == latency["results"]["p99_latency_ms"]
    assert rows[1][4] == 4
    assert rows[3][2] == throughput["results"]["tokens_per_second"]


def test_failed_command_fails_its_case_with_the_log_tail(
    pytester: pytest.Pytester, ports: str
) -> None:
    pytester.makefile(
        ".yaml",
        bench_missing="server: {model: ./no-such-model}\n"
        "benchmark: {kind: throughput, input_len: 8, output_len: 2, num_prompts: 2}\n",
    )
    result = pytester.runpytest_subprocess(
        f"--profllm-ports={ports}", "--profllm-out=results", "--profllm-gpus=2", timeout=300
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "vllm bench throughput no-such-model (sim, GPUs *) exited with code 1; log: *",
            "*'./no-such-model' is not in the simulator's catalog*",
        ]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    (record,) = run_records(pytester)
    assert record["status"] == "error"
    assert record["message"].startswith("vllm bench throughput no-such-model (sim, GPUs ")


# --- vLLM's own parsers ------------------------------------------------------------------------

# Builds `vllm bench KIND`'s parser as vLLM's CLI does and prints each parsed namespace.
_PARSE = """
import json, sys
from vllm.entrypoints.cli.benchmark.latency import BenchmarkLatencySubcommand
from vllm.entrypoints.cli.benchmark.throughput import BenchmarkThroughputSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
subcommands = {"throughput": BenchmarkThroughputSubcommand, "latency": BenchmarkLatencySubcommand}
out = []
for kind, argv in json.load(sys.stdin):
    parser = FlexibleArgumentParser(prog=f"vllm bench {kind}")
    subcommands[kind].add_cli_args(parser)
    try:
        namespace = parser.parse_args(argv)
    except SystemExit as exit:
        out.append({"error": f"exit {exit.code}"})
        continue
    plain = (int, float, str, bool, type(None))
    out.append({k: v for k, v in vars(namespace).items() if isinstance(v, plain)})
print(json.dumps(out))
"""


@pytest.mark.vllm_python
@needs_vllm_python
def test_rendered_commands_are_accepted_by_vllms_own_parsers(tmp_path: Path) -> None:
    server = {"model": "Qwen/Qwen3-8B", "max_num_seqs": 32, "enforce_eager": True, "api_key": "k"}
    workloads: list[ThroughputConfig | LatencyConfig] = [
        ThroughputConfig(
            kind="throughput", input_len=128, output_len=32, num_prompts=50, n=2,
            prefix_len=16, random_range_ratio=0.25, async_engine=True, disable_detokenize=True,
        ),
        ThroughputConfig(
            kind="throughput", backend="vllm-chat", dataset_name="sharegpt",
            dataset_path="/data/sharegpt.json", output_len=64,
        ),
        ThroughputConfig(
            kind="throughput", dataset_name="prefix_repetition", prefix_repetition_prefix_len=64,
            prefix_repetition_suffix_len=32, prefix_repetition_num_prefixes=4,
            prefix_repetition_output_len=16,
        ),
        LatencyConfig(
            kind="latency", batch_size=4, input_len=64, output_len=16, n=2, num_iters_warmup=2,
            num_iters=5, use_beam_search=True, disable_detokenize=True,
        ),
    ]
    argvs = [
        [bench.kind, engine_args(server) + bench_args(bench) + ["--output-json", "o.json"]]
        for bench in workloads
    ]
    parsed = vllm_parse(_PARSE, argvs)
    random, sharegpt, prefix, latency = parsed
    for namespace in parsed:
        assert namespace["model"] == "Qwen/Qwen3-8B"
        assert namespace["max_num_seqs"] == 32 and namespace["enforce_eager"] is True
        assert namespace["output_json"] == "o.json"
    assert (random["random_input_len"], random["random_output_len"]) == (128, 32)
    assert (random["random_prefix_len"], random["random_range_ratio"]) == (16, "0.25")
    assert (random["num_prompts"], random["n"], random["dataset_name"]) == (50, 2, "random")
    assert random["async_engine"] is True and random["disable_detokenize"] is True
    assert (sharegpt["backend"], sharegpt["dataset_name"]) == ("vllm-chat", "sharegpt")
    assert (sharegpt["dataset_path"], sharegpt["output_len"]) == ("/data/sharegpt.json", 64)
    assert (prefix["prefix_repetition_prefix_len"], prefix["prefix_repetition_num_prefixes"]) == (
        64,
        4,
    )
    assert (latency["batch_size"], latency["input_len"], latency["output_len"]) == (4, 64, 16)
    assert (latency["n"], latency["num_iters_warmup"], latency["num_iters"]) == (2, 2, 5)
    assert latency["use_beam_search"] is True and latency["disable_detokenize"] is True
