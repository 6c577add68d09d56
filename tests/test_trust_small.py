"""A relative dataset_path is read beside its suite, and two sessions writing into one folder
keep both Markdown summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_profllm.gates.summary import write_markdown
from pytest_profllm.plan.case import expand
from pytest_profllm.plan.suite import BenchmarkConfig, load_suite_file


def test_a_relative_dataset_path_is_beside_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    path = suites / "bench_custom.yaml"
    path.write_text(
        "server:\n  model: m\nbenchmark:\n  dataset_name: custom\n"
        "  dataset_path: prompts.jsonl\n  num_prompts: 1\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # before: read as elsewhere/prompts.jsonl
    suite, lines = load_suite_file(path)
    (case,) = expand(suite, str(path), lines)
    assert isinstance(case.benchmark, BenchmarkConfig)
    assert case.benchmark.dataset_path == str(suites / "prompts.jsonl")
    assert Path(case.benchmark.dataset_path).is_file()


def test_two_sessions_in_one_folder_keep_both_summaries(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    write_markdown("first\n", summary, "20260101T000000-aaaaaa")
    write_markdown("second\n", summary, "20260102T000000-bbbbbb")
    assert (tmp_path / "summary-20260101T000000-aaaaaa.md").read_text() == "first\n"
    assert (tmp_path / "summary-20260102T000000-bbbbbb.md").read_text() == "second\n"
    assert summary.read_text() == "second\n"  # the latest session's


def test_profllm_bench_records_the_engine_the_server_says(sim_url: str, tmp_path: Path) -> None:
    import sqlite3

    from pytest_profllm.cli.main import main

    out = tmp_path / "results"
    code = main([
        "bench", "--base-url", sim_url, "--model", "sim", "--num-prompts", "4",
        "--random-input-len", "16", "--random-output-len", "4", "--save-result",
        # The engine, not the host, is under test.
        "--result-dir", str(out), "--max-schedule-lag", "1000", "--max-client-overhead", "1e5",
        "--max-client-wait", "1",
    ])
    assert code == 0
    (saved,) = out.glob("*.json")
    assert json.loads(saved.read_text())["engine"] == {"name": "sim", "version": "0.1.0"}
    db = tmp_path / "results.db"
    assert main(["ingest", str(db), str(out)]) == 0
    with sqlite3.connect(db) as connection:
        row = connection.execute("SELECT engine, device FROM benchmark_runs").fetchone()
    assert row == ("sim", "virtual")  # before: ('vllm', 'cpu')


def test_a_server_that_does_not_say_is_unknown() -> None:
    from pytest_profllm.load.bench import server_engine

    # Nothing listens there: no guess either way.
    assert server_engine("http://127.0.0.1:9") == {"name": "unknown", "version": None}


def test_a_database_that_is_no_database_is_not_the_hint(tmp_path: Path) -> None:
    from pytest_profllm.options import Settings
    from pytest_profllm.session.controller import ControllerSession

    out = tmp_path / "results"
    settings = Settings(out_dir=out, db_path=out / "results.db", engine="sim", gpus=None,
                        ports=range(40000, 40020), startup_timeout=1.0, lease_timeout=1.0,
                        suite_glob="bench_*.yaml")
    controller = ControllerSession(settings, None)  # type: ignore[arg-type]
    hint = controller._load_failed(out / "results.db", ValueError("file is not a database"))
    # Before: "profllm ingest results.db ...", into the file that could not be read.
    assert hint.endswith(f"load them with: profllm ingest {out / 'results-recovered.db'} {out}")
