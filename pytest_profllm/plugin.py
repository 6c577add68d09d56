"""pytest-profllm's pytest hooks: options, collection of suites, fixtures, and the hand-over of
records from the process that ran a case to the one that writes it. The work lives elsewhere.
"""

from __future__ import annotations

import contextlib
import fnmatch
import shutil
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from pytest_profllm import options
from pytest_profllm.cluster.driver import ClusterSession, check_usage, planned_cases
from pytest_profllm.engine.choice import EngineUnavailable, choose_engine
from pytest_profllm.gates.config import GATE_CONFIG_KEY
from pytest_profllm.gates.controller import GATE_CONTROLLER_KEY, GateController
from pytest_profllm.gates.summary import junit_properties
from pytest_profllm.gates.worker import (
    baseline_of,
    baseline_problem,
    judge_case,
    regression_message,
)
from pytest_profllm.hosts import nvml
from pytest_profllm.plan.case import Case
from pytest_profllm.results import schema_version
from pytest_profllm.run.outcome import describe_missed
from pytest_profllm.session import (
    collect,
    identity,
    interrupt,
    invalid_cases,
    live_view,
    metrics_endpoint,
    resume,
    saturation,
    worker,
)
from pytest_profllm.session import xdist_scheduling as scheduler
from pytest_profllm.session.collect import CASE_FIXTURE, PROFLLM_MARKER, case_of
from pytest_profllm.session.controller import (
    CONTROLLER_KEY,
    ControllerReports,
    ControllerSession,
    check_writable,
)
from pytest_profllm.session.identity import IDENTITY_KEY, SETTINGS_KEY, RunIdentity
from pytest_profllm.session.report import summary_lines
from pytest_profllm.session.worker import OUTCOME_KEY, WORKER_KEY, worker_session

_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
_GATE_ASKED = pytest.StashKey[bool]()
_LEFTOVERS = pytest.StashKey[list[str]]()  # what killed sessions left, ended at the start
_RESTORE_SIGTERM = pytest.StashKey[Callable[[], None]]()
_METRICS = pytest.StashKey[metrics_endpoint.MetricsEndpoint]()
_LIVE = pytest.StashKey[live_view.LiveSession]()
_FAILURES = pytest.StashKey[invalid_cases.FailureCount]()  # where the reports arrive
METRICS_HOST = "127.0.0.1"  # the numbers name suites and cases: not for other hosts


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{PROFLLM_MARKER}(server, benchmark, thresholds=None, repeat=1, regression=None): run "
        "the test against "
        "each case of this benchmark matrix; the profllm_result fixture holds the case's result",
    )
    settings = options.Settings.from_config(config)
    config.stash[SETTINGS_KEY] = settings
    gate = options.gate_config(config, settings.out_dir)
    config.stash[GATE_CONFIG_KEY] = gate
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        run_identity = RunIdentity.from_workerinput(workerinput["profllm"])
        if resume.WORKERINPUT in workerinput:
            index = resume.ResumeIndex.from_input(workerinput[resume.WORKERINPUT])
            config.stash[resume.RESUME_INDEX_KEY] = index
    else:
        try:
            gpu_count = len(nvml.discover().gpus)
            engine = choose_engine(
                settings.engine, gpu_count, settings.vllm_python, settings.sim_clock
            )
        except EngineUnavailable as error:
            raise pytest.UsageError(str(error)) from None
        try:
            # Checked here, once, so a wrong device list is a usage error, not a failure per case.
            identity.host_pool(settings, engine)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None
        # A folder we cannot write would otherwise be found after the first case ran.
        problem = check_writable(settings)
        if problem is not None:
            raise pytest.UsageError(problem)
        if settings.db_path is not None:
            # Refused before any case runs, not at the load after the last.
            try:
                schema_version.refuse_newer_file(settings.db_path)
            except schema_version.NewerSchema as error:
                raise pytest.UsageError(str(error)) from None
        if settings.ray is not None:
            check_usage(config)
        config.stash[_LEFTOVERS] = identity.claim_session(settings)
        run_identity = RunIdentity(identity.new_session_id(), engine)
        earlier = None
        if settings.resume and settings.out_dir is not None:
            earlier = resume.read_index(
                settings.out_dir,
                lambda record: saturation.record_saturated(record, settings.saturation_margin),
            )
            config.stash[resume.RESUME_INDEX_KEY] = earlier
        port = options.value_of(config, options.Table.metrics_port)
        if port is not None:  # before xdist starts its workers, which inherit the folder
            config.stash[_METRICS] = metrics_endpoint.start(METRICS_HOST, port)
        config.stash[CONTROLLER_KEY] = ControllerSession(settings, run_identity, resume=earlier)
        # Only here: on an xdist worker it would take records out before they are sent.
        config.pluginmanager.register(ControllerReports(config), "profllm-reports")
        gates = GateController(config, gate, settings.db_path, engine.name)
        if (problem := baseline_problem(config)) is not None:
            raise pytest.UsageError(problem)
        config.stash[GATE_CONTROLLER_KEY] = gates
        config.pluginmanager.register(gates, "profllm-gates")
        failures = invalid_cases.FailureCount()  # where every report arrives
        config.stash[_FAILURES] = failures
        config.pluginmanager.register(failures, "profllm-failures")
    config.stash[IDENTITY_KEY] = run_identity
    restore = interrupt.install(
        lambda: _on_sigterm(config), lambda: config.pluginmanager.has_plugin("dsession")
    )
    if restore is not None:
        config.stash[_RESTORE_SIGTERM] = restore


def _on_sigterm(config: pytest.Config) -> None:
    controller = config.stash.get(CONTROLLER_KEY, None)
    if controller is None:
        return
    controller.interrupted_by = interrupt.SIGNAL_NAME
    _say(
        config,
        f"profllm: {interrupt.SIGNAL_NAME} received: stopping as on Ctrl-C "
        "(finished records are written and loaded, servers stopped, leases released)",
    )


def _say(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    # Also in the middle of a test (a signal), where pytest captures the output.
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        reporter.write("\n")  # off the progress line, which may not be ended yet
        reporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    _stop_live(config)
    endpoint = config.stash.get(_METRICS, None)
    if endpoint is not None:  # after the last record is written (pytest_sessionfinish)
        endpoint.stop()
    restore = config.stash.get(_RESTORE_SIGTERM, None)
    if restore is not None:
        restore()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    config = node.config
    node.workerinput["profllm"] = config.stash[IDENTITY_KEY].to_workerinput()
    if scheduler.SCOPE_DIR_KEY not in config.stash:
        config.stash[scheduler.SCOPE_DIR_KEY] = scheduler.make_scope_dir()
    node.workerinput[scheduler.SCOPE_DIR_INPUT] = str(config.stash[scheduler.SCOPE_DIR_KEY])
    index = config.stash.get(resume.RESUME_INDEX_KEY, None)
    if index is not None:
        node.workerinput[resume.WORKERINPUT] = index.to_input()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") in scheduler.TAKEN_OVER_MODES:
        return scheduler.server_scheduling(config, log)
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scheduler.group_by_server(items, case_of)
    saturation.order_rates(items, case_of)  # a sweep's lower rates first: see saturation.py
    worker.resume_cases(config, items, case_of)  # before the skipped cases are counted
    worker.note_wanting_spans(config, items, case_of)
    scope_dir = getattr(config, "workerinput", {}).get(scheduler.SCOPE_DIR_INPUT)
    if scope_dir is not None:
        scopes = {
            item.nodeid: scheduler.Scope(case.server_key, case.gpus_needed)
            for item in items
            if (case := case_of(item)) is not None
        }
        scheduler.write_scopes(Path(scope_dir), identity.worker_name(), scopes)
        skipped = {item.nodeid for item in items if item.get_closest_marker("skip")}
        nodeids = [item.nodeid for item in items]
        config.stash[scheduler.RANKS_KEY] = scheduler.server_ranks(nodeids, scopes, skipped)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.stash[SETTINGS_KEY].ray is None or config.option.collectonly:
        return
    # This process's case runner hands the server groups to the Ray cluster, all at once.
    cluster = ClusterSession(
        config.stash[SETTINGS_KEY],
        config.stash[IDENTITY_KEY],
        "ray",
        planned=planned_cases(session.items),
    )
    config.stash[WORKER_KEY] = cluster
    cluster.start()


def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = config.stash[SETTINGS_KEY]
    engine = config.stash[IDENTITY_KEY].engine
    out = f"records in {settings.out_dir}" if settings.out_dir else "no --profllm-out: no files"
    where = f"; server groups on the Ray cluster {settings.ray}" if settings.ray else ""
    lines = [f"profllm: engine {engine.name} ({engine.reason}); {out}{where}"]
    lines += [f"profllm: {line}" for line in config.stash.get(_LEFTOVERS, [])]
    if not hasattr(config, "workerinput"):
        baseline = baseline_of(config)
        if baseline is not None:
            lines.append(f"profllm: regression gate against {baseline.describe()}")
    return lines


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if fnmatch.fnmatch(file_path.name, parent.config.stash[SETTINGS_KEY].suite_glob):
        return collect.SuiteFile.for_path(parent, file_path)
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cases = collect.marker_cases(metafunc)
    if cases is None:
        return
    if CASE_FIXTURE not in metafunc.fixturenames:
        raise pytest.Collector.CollectError(
            f"{metafunc.definition.nodeid}: @pytest.mark.profllm needs the profllm_result "
            "(or profllm_case) fixture"
        )
    settings = metafunc.config.stash[SETTINGS_KEY]
    engine = metafunc.config.stash[IDENTITY_KEY].engine
    params = []
    for case in cases:
        reason = worker.skip_reason(case, settings, engine)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(case, marks=marks, id=case.name.replace("::", "/")))
    metafunc.parametrize(CASE_FIXTURE, params)


@pytest.fixture
def profllm_case(request: pytest.FixtureRequest) -> Case:
    """The benchmark case of this test, from its `@pytest.mark.profllm` matrix."""
    if not hasattr(request, "param"):
        pytest.fail(
            f"{request.node.nodeid}: profllm_case and profllm_result need "
            "@pytest.mark.profllm(server=..., benchmark=...) on the test",
            pytrace=False,
        )
    case: Case = request.param
    return case


@pytest.fixture
def profllm_result(request: pytest.FixtureRequest, profllm_case: Case) -> Any:
    """Runs this test's benchmark case and returns its outcome (`.results` holds the metrics)."""
    return worker_session(request.config).run(
        profllm_case, request.node.nodeid, request.node.stash
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # The record this case gets if it never ends (a crashed worker) leaves with its setup
    # report: the controller must have it before the case can crash.
    case = case_of(item) if call.when == "setup" else None
    started = None
    if case is not None:
        record = worker_session(item.config).started_record(case, item.nodeid)
        started = (worker.STARTED_PROPERTY, record)
        item.user_properties.append(started)
    try:
        report = yield
    finally:
        if started is not None:
            item.user_properties.remove(started)
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    invalid_cases.mark_report(item, report)
    return report


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    # An invalid case is counted as `invalid` in pytest's last line, apart from `failed`.
    return invalid_cases.teststatus(report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    # After the case ran (a suite item) or the test's own asserts passed (a marked test), the
    # matrix's thresholds decide. A failure in the call itself stands as it is.
    yield
    outcome = item.stash.get(OUTCOME_KEY, None)
    if outcome is not None and outcome.invalid_reason:
        invalid_cases.end_invalid(
            item, item.config.stash[SETTINGS_KEY].invalid, outcome.invalid_reason
        )
    problems = []
    if outcome is not None and outcome.missed:
        problems.append(describe_missed(outcome.missed))
    if outcome is not None and outcome.case.regression:
        outcome.regression = judge_case(item.config, outcome)
        case = outcome.case
        item.stash[_GATE_ASKED] = bool(outcome.results) and (
            case.repeat_index == case.repeat_count - 1
        )
        require = item.config.stash[GATE_CONFIG_KEY].require_baseline
        problems.append(regression_message(outcome.regression, require) or "")
    if any(problems):
        pytest.fail("; ".join(problem for problem in problems if problem), pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    outcome = item.stash.get(OUTCOME_KEY, None)
    if outcome is None:
        return
    case_runner = item.config.stash.get(WORKER_KEY, None)
    if case_runner is not None:
        case_runner.after_case(case_of(nextitem))
    status, message = worker.status_of(item.stash.get(_REPORTS, {}), outcome)
    record = outcome.record(status, message)
    item.user_properties.append((worker.RECORD_PROPERTY, record))
    item.user_properties.extend(junit_properties(record))
    item.user_properties.append((worker.REQUESTS_PROPERTY, outcome.requests))
    if item.stash.get(_GATE_ASKED, False):
        item.user_properties.append((worker.GATE_ASKED_PROPERTY, True))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    # The terminal reporter exists by now; xdist starts its workers later (its hook is
    # trylast), and they inherit the live folder.
    if hasattr(config, "workerinput") or config.option.collectonly:
        return
    live = live_view.start(config, options.value_of(config, options.Table.live),
                           config.stash[SETTINGS_KEY].db_path)
    if live is not None:
        config.stash[_LIVE] = live


def _stop_live(config: pytest.Config) -> None:
    live = config.stash.get(_LIVE, None)
    if live is not None:
        live.stop()
        del config.stash[_LIVE]


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_live(session.config)  # before the summary: nothing runs any more
    case_runner = session.config.stash.get(WORKER_KEY, None)
    if case_runner is not None:
        case_runner.close()
    controller = session.config.stash.get(CONTROLLER_KEY, None)
    if controller is not None:
        controller.finish(lambda line: _say(session.config, line))
        controller.forget_turns()
        gates = session.config.stash.get(GATE_CONTROLLER_KEY, None)
        if gates is not None:
            gates.finish()
            if gates.gated_nothing() is not None:
                # A gate that gated nothing is an error, never green.
                session.exitstatus = pytest.ExitCode.USAGE_ERROR
    failures = session.config.stash.get(_FAILURES, None)
    if failures is not None:
        session.exitstatus = failures.exit_status(
            session.config.stash[SETTINGS_KEY].invalid, session.exitstatus
        )
    scope_dir = session.config.stash.get(scheduler.SCOPE_DIR_KEY, None)
    if scope_dir is not None:
        shutil.rmtree(scope_dir, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    # pytest's own sections list failed cases; an invalid one is listed here, with its reason.
    invalid = terminalreporter.stats.get(invalid_cases.CATEGORY, [])
    if invalid:
        terminalreporter.write_sep("=", "invalid: not measurements of the server", yellow=True)
    for report in invalid:
        terminalreporter.write_line(
            f"INVALID {report.nodeid} - {invalid_cases.reason_of(report)}", yellow=True
        )
    controller = config.stash.get(CONTROLLER_KEY, None)
    if controller is None or not controller.records:
        return
    terminalreporter.write_sep("=", "profllm benchmark results")
    # As wide as pytest's own lines: the terminal's width, or 80 where output is not one.
    for line in summary_lines(controller, config.get_terminal_writer().fullwidth):
        terminalreporter.write_line(line)
    if controller.load_problem is not None:
        terminalreporter.write_line(f"profllm: {controller.load_problem}", red=True, bold=True)
