"""`profllm bench` against the simulated engine: vLLM's result keys, the chat backend, the
emission log that checks the client's clock, and loud failures."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import socket
from pathlib import Path
from typing import Any, get_args

import pytest
from helpers import simulator
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pytest_profllm.cli.errors import EXIT_INVALID
from pytest_profllm.cli.main import build_parser, main
from pytest_profllm.load import loops, metrics
from pytest_profllm.load.capacity import CapacityResult
from pytest_profllm.plan import metric_names
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.model_files import MODEL_DIR

# The keys `vllm bench serve --save-result` writes for these flags (0.33.0, without
# --save-detailed), read from a real run against the simulator.
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "rtfx", "latencies", "queue_times",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
}  # fmt: skip


def bench(
    url: str, tmp_path: Path, *flags: str, model: str = "sim"
) -> tuple[int, dict[str, Any] | None]:
    code = main(
        [
            "bench", "--base-url", url, "--model", model, "--num-prompts", "6",
            "--random-input-len", "16", "--random-output-len", "5", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "out.json",
            # What these tests check is not whether this host keeps a 10 ms schedule, nor how
            # little its client adds to the server's TTFT: a busy one made the plain runs exit
            # 3 (client fell behind; the client added 96 ms). A test may pass its own.
            "--max-schedule-lag", "1000", "--max-client-overhead", "100000",
            "--max-client-wait", "1", *flags,
        ]
    )  # fmt: skip
    path = tmp_path / "out.json"
    return code, json.loads(path.read_text()) if path.exists() else None


def test_result_has_vllm_keys_and_per_request_records(sim_url: str, tmp_path: Path) -> None:
    code, result = bench(sim_url, tmp_path, "--tokenizer", str(MODEL_DIR), "--goodput", "ttft:5000")
    assert code == 0
    assert result is not None
    assert set(result) >= VLLM_KEYS
    assert (result["completed"], result["total_input_tokens"]) == (6, 96)
    assert result["total_output_tokens"] == 30
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["validity"] == "valid"
    assert set(metric_names.CLIENT_HEALTH_KEYS) <= set(result)
    assert (result["client_processes"], result["client_loop"]) == (1, loops.name())
    assert "ttfts" not in result  # only with --save-detailed, as vLLM
    with gzip.open(tmp_path / "out.requests.jsonl.gz", "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert len(rows) == 6
    assert all(len(row["message_s"]) == 5 and row["status"] == 200 for row in rows)


def test_chat_backend_and_the_clock_agrees_with_the_server(sim_url: str, tmp_path: Path) -> None:
    # Prompts tokenized by the server (no --tokenizer): no local model needed.
    code, result = bench(sim_url, tmp_path, "--backend", "openai-chat", "--save-detailed")
    assert code == 0
    assert result is not None
    assert result["completed"] == 6
    assert result["total_output_tokens"] == 30
    log = tmp_path / "emissions.jsonl"
    emitted = {
        line["request_id"]: line["emitted"]
        for line in map(json.loads, log.read_text().split("\n")[:-1])
    }
    assert sorted(emitted) == [f"profllm-{i}" for i in range(6)]
    for index, (start, ttft, itls) in enumerate(
        zip(result["start_times"], result["ttfts"], result["itls"], strict=True)
    ):
        times = emitted[f"profllm-{index}"]
        assert len(times) == len(itls) + 1 == 5
        # One monotonic clock on both sides: a message is seen after it was sent, soon after.
        seen = start + ttft
        assert times[0] <= seen < times[0] + 1.0


def test_every_request_failing_is_an_error(
    sim_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = bench(sim_url, tmp_path, "--tokenizer", str(MODEL_DIR), model="nobody")
    assert code == 1  # nothing measured, as `profllm --help` lists it
    assert result is None
    assert capsys.readouterr().err == (
        "profllm bench: all 6 requests failed; first errors: HTTP 404 Not Found: "
        '{"error": {"message": "The model `nobody` does not exist. Valid aliases: sim.", '
        '"type": "NotFoundError", '
        '"param": "model", "code": 404}}\n'
    )


def test_client_that_fell_behind_exits_3(
    sim_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics, "MAX_CLIENT_CPU_PERCENT", 0.0)  # any CPU at all is too much
    code, result = bench(sim_url, tmp_path, "--tokenizer", str(MODEL_DIR))
    assert code == 3
    assert result is not None
    assert result["validity"] == "invalid"
    assert result["invalid_reason"].startswith("client fell behind: client CPU saturated")
    assert "invalid measurement: client fell behind" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ramp-up-strategy", "linear"], "ramp_up_strategy needs ramp_up_start_rps"),
        (["--burstiness", "0"], "--burstiness: Input should be greater than 0 (got 0.0)"),
        (["--goodput", "ttft=5"], "--goodput: 'ttft=5' is not KEY:MILLISECONDS"),
        (["--dataset-name", "custom"], "dataset_name 'custom' needs dataset_path"),
    ],
)
def test_bad_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _ = bench("http://127.0.0.1:9", tmp_path, *flags)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("profllm bench: ")
    assert message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", str(MODEL_DIR)]])
def test_a_server_that_is_down_is_one_line_and_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokenizer: list[str]
) -> None:
    # Port 9 (discard) has no listener on loopback: with or without a local tokenizer (the
    # server's /tokenize is asked first without one), the same line, no traceback.
    code, result = bench("http://127.0.0.1:9", tmp_path, *tokenizer)
    assert (code, result) == (4, None)
    assert capsys.readouterr().err == (
        "profllm bench: cannot connect to http://127.0.0.1:9: connection refused\n"
    )


def test_every_exit_status_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    from pytest_profllm.cli import errors

    codes = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert codes == {0, 1, 2, 3, 4}
    for code in codes:
        assert f"\n  {code}  " in out, f"exit status {code} is not in profllm --help"


def test_sim_routes_the_client_relies_on(sim_url: str) -> None:
    import requests

    out_of_range = requests.post(f"{sim_url}/detokenize", json={"tokens": [1, 99999]}, timeout=10)
    assert out_of_range.status_code == 400
    assert "out of vocabulary" in out_of_range.json()["error"]["message"]
    chat = requests.post(
        f"{sim_url}/v1/chat/completions",
        json={"model": "sim", "messages": [{"role": "user", "content": "ba be"}], "max_tokens": 3},
        timeout=10,
    )
    assert chat.status_code == 200
    body = chat.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["role"] == "assistant"
    bad = requests.post(f"{sim_url}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert bad.status_code == 400


def test_slos_turn_the_benchmark_into_a_capacity_search(
    sim_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result = bench(
        sim_url, tmp_path, "--tokenizer", str(MODEL_DIR), "--num-prompts", "40",
        "--slo", "median_ttft_ms=2000", "--slo", "p90_tpot_ms=1000", "--search-low", "20",
        "--search-high", "160", "--search-precision", "50%", "--search-confirm", "1",
        "--search-min-duration-s", "1",
        # The search's logic is under test, not this host: a busy CI host once made every
        # probe here "unsure" (client and simulator behind) and the search found nothing.
        "--max-schedule-lag", "1000", "--max-client-overhead", "100000",
        "--max-client-wait", "1",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and result is not None, out[-3000:]
    probes = [line for line in out.splitlines() if line.startswith("probe ")]
    assert probes and all("median_ttft_ms" in line and "p90_tpot_ms" in line for line in probes)
    search = result["capacity_search"]
    assert len(search["probes"]) == len(probes)
    assert result["capacity"] == search["capacity"] == search["bracket"][0]
    assert result["completed"] >= 200  # a p90 is estimated from at least 200 requests
    assert "capacity" in out.splitlines()[-2] or "capacity" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--search-low", "50", "--search-high", "10"],
         "search.low (50) must lie below search.high (10)"),
        (["--slo", "p99_ttfx_ms=5"], "slo.p99_ttfx_ms: unknown SLO metric"),
        (["--slo", "p99_ttft_ms=fast"], "--slo: 'p99_ttft_ms=fast' is not NAME=VALUE"),
    ],
)
def test_bad_search_settings_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _ = bench("http://127.0.0.1:9", tmp_path, "--slo", "p99_ttft_ms=500", *flags)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert message in err


def test_a_search_the_server_changed_under_exits_invalid(
    sim_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The re-check itself is tested against a drifting server in test_capacity_recheck.py;
    # here only what the command does with its answer: the invalid exit, as for any load.
    monkeypatch.setattr(
        CapacityResult, "changed", lambda self: "the server changed during the search: test"
    )
    code, _ = bench(
        sim_url, tmp_path, "--tokenizer", str(MODEL_DIR), "--num-prompts", "40",
        "--slo", "median_ttft_ms=2000", "--search-low", "20", "--search-high", "80",
        "--search-precision", "50%", "--search-confirm", "1", "--search-min-duration-s", "1",
    )  # fmt: skip
    assert code == EXIT_INVALID
    assert capsys.readouterr().err.strip().endswith(
        "profllm bench: invalid measurement: the server changed during the search: test"
    )


def test_bench_takes_every_dataset_and_backend_a_suite_takes() -> None:
    parser = build_parser()
    for field in ("dataset_name", "backend"):
        for value in get_args(BenchmarkConfig.model_fields[field].annotation):
            flag = "--" + field.replace("_", "-")
            args = parser.parse_args(["bench", "--model", "m", flag, value])
            assert getattr(args, field) == value


def test_images_and_rerank_through_vllms_flags(port_range: str, tmp_path: Path) -> None:
    first = int(port_range.split("-")[0]) + 60
    vision = "Qwen/Qwen2.5-VL-7B-Instruct"
    with simulator(first, tmp_path / "vl.log", vision) as url:
        code, result = bench(
            url, tmp_path, "--backend", "openai-chat", "--dataset-name", "random-mm",
            "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
            "--random-mm-bucket-config", "{(64, 64, 1): 1.0}", model=vision,
        )  # fmt: skip
        assert code == 0 and result is not None
        assert (result["completed"], result["failed"]) == (6, 0)
    pooling = "Qwen/Qwen3-Embedding-0.6B"
    with simulator(first + 5, tmp_path / "pool.log", pooling, "--runner", "pooling") as url:
        code, result = bench(
            url, tmp_path, "--backend", "vllm-rerank", "--dataset-name", "random-rerank",
            "--random-batch-size", "3", "--percentile-metrics", "e2el", model=pooling,
        )  # fmt: skip
        assert code == 0 and result is not None
        assert result["completed"] > 0 and result["failed"] == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--random-mm-bucket-config", "{(1, 2): 1.0}"],
         "--random-mm-bucket-config: bucket key '(1, 2)' is not \"(height, width, frames)\""),
        (["--random-mm-bucket-config", "[1, 2]"],
         "--random-mm-bucket-config: '[1, 2]' is not a dict"),
        (["--random-mm-limit-mm-per-prompt", "image=1"],
         "--random-mm-limit-mm-per-prompt: 'image=1' is not a JSON object"),
        (["--random-mm-limit-mm-per-prompt", '{"audio": 1}'], "unknown modality 'audio'"),
    ],
)
def test_bad_multimodal_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _ = bench(
        "http://127.0.0.1:9", tmp_path, "--backend", "openai-chat", "--dataset-name", "random-mm",
        *flags,
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("profllm bench: ") and message in err, err


_LITERALS = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.integers(0, 5000).map(str) | st.tuples(*[st.integers(-2, 3000)] * 3),
                      inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["image", "video", "audio"]) | st.text(max_size=5),
                      inner, max_size=3),
    max_leaves=12,
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@example(buckets="{(64, 64, 1): 1.0}", limits='{"image": 1}')  # a run: exit 4 here
@given(
    buckets=st.one_of(st.text(max_size=40), _LITERALS.map(repr)),
    limits=st.one_of(st.text(max_size=40), _JSON.map(json.dumps)),
)
def test_any_multimodal_flag_value_is_a_run_or_one_line(buckets: str, limits: str) -> None:
    # Against port 9 (nothing listens): a value the workload takes reaches the connection
    # (exit 4), any other is refused first (exit 2); one line either way, never a traceback.
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([
            "bench", "--base-url", "http://127.0.0.1:9", "--model", "sim", "--tokenizer",
            str(MODEL_DIR), "--backend", "openai-chat", "--dataset-name", "random-mm",
            "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "2",
            f"--random-mm-bucket-config={buckets}", f"--random-mm-limit-mm-per-prompt={limits}",
        ])  # fmt: skip
    text = err.getvalue()
    assert code in (2, 4), (code, text)
    assert text.startswith("profllm bench: ") and text.count("\n") == 1, text


def test_the_schedule_lag_limit_is_the_users(sim_url: str, tmp_path: Path) -> None:
    # A limit no client meets (a nanosecond): the same load is invalid, exit 3, and says why.
    code, result = bench(sim_url, tmp_path, "--tokenizer", str(MODEL_DIR), "--request-rate",
                         "50", "--max-schedule-lag", "0.000001")
    assert code == EXIT_INVALID and result is not None
    assert result["validity"] == "invalid"
    assert "is over 1e-06 ms" in result["invalid_reason"], result["invalid_reason"]


def test_spans_port_joins_each_requests_server_span(
    port_range: str, tmp_path: Path
) -> None:
    # The receiver on a port of the test's own range; the simulator exports to it as vLLM
    # would with --otlp-traces-endpoint.
    spans_port = int(port_range.split("-")[0]) + 60
    endpoint = f"http://127.0.0.1:{spans_port}/v1/traces"
    first = int(port_range.split("-")[0]) + 50
    with simulator(
        first, tmp_path / "sim.log", "sim", "--otlp-traces-endpoint", endpoint
    ) as url:
        code, result = bench(
            url, tmp_path, "--spans-port", str(spans_port), "--save-detailed",
            "--max-client-overhead-tail", "100000",
        )
    assert code == 0
    assert result is not None
    assert result["server_spans_joined_share"] == 1.0
    for phase in ("ttft", "e2el"):
        for name in ("p50", "p90", "p99"):
            assert isinstance(result[f"client_overhead_{phase}_{name}_ms"], float)
    # Joined, the client's tail is judged as a case's is.
    assert "client_overhead_tail" not in result["rules_not_applied"]
    assert result["server_view"]["spans_problem"] is None
    assert result["server_view"]["span_receiver"]["spans_kept"] == 6
    spans = result["server_spans"]  # --save-detailed: each request's span
    assert len(spans) == 6
    assert all(span["server_ttft_ms"] is not None for span in spans)
    with gzip.open(tmp_path / "out.requests.jsonl.gz", "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert all(row["server_e2el_ms"] is not None for row in rows)


def test_without_spans_port_the_tail_is_not_judged(sim_url: str, tmp_path: Path) -> None:
    code, result = bench(sim_url, tmp_path)
    assert code == 0
    assert result is not None
    assert "client_overhead_tail" in result["rules_not_applied"]
    assert "server_spans_joined_share" not in result


def test_a_spans_port_in_use_is_one_line(
    port_range: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = int(port_range.split("-")[0]) + 61
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        # No server is needed: the port is refused before the benchmark starts.
        code, result = bench("http://127.0.0.1:9", tmp_path, "--spans-port", str(taken))
    assert (code, result) == (2, None)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"profllm bench: --spans-port {taken}: cannot receive spans on ")
    assert "in use" in err and "\n" not in err
