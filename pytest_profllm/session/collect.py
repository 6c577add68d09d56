"""Suite files as pytest collectors: `bench_x.yaml` -> one collector per server -> one item per
workload, so node ids read `benchmarks/bench_x.yaml::qwen3-8b-tp1::random-rate4` and every
case of one server shares a parent (which is what groups them on one xdist worker).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_profllm.engine.registry import Registry, registry_for
from pytest_profllm.plan.case import Case, expand, printable
from pytest_profllm.plan.suite import SuiteError, load_suite_file, validate_suite
from pytest_profllm.session.identity import IDENTITY_KEY, SETTINGS_KEY
from pytest_profllm.session.worker import CASE_ERRORS, skip_reason, worker_session

if TYPE_CHECKING:
    from pytest_profllm.engine.choice import EngineChoice
    from pytest_profllm.engine.registry import Registry

PROFLLM_MARKER = "profllm"
CASE_FIXTURE = "profllm_case"


class SuiteFile(pytest.File):
    @classmethod
    def for_path(cls, parent: pytest.Collector, path: Path) -> SuiteFile:
        """The collector of one suite file, its node id always naming the file. Outside the
        rootdir pytest names it from the argument it came under, so a file given by its own
        path gets the id "" and its cases read "::server::workload".

        The id's control characters are escaped (`\\x1b`): pytest writes node ids to the
        terminal as they are, and the id is also the file part of each case id (the live
        view, the summary, the records). A file named with an escape sequence cleared the
        screen at every line that named it, and one with a newline forged summary lines."""
        node = cls.from_parent(parent, path=path)
        if path.is_relative_to(parent.config.rootpath):
            nodeid = node.nodeid  # pytest's own id, rootdir-relative
        else:
            try:  # from the current directory when under it, as the user typed it
                nodeid = path.resolve().relative_to(Path.cwd().resolve()).as_posix()
            except (ValueError, OSError):
                nodeid = node.nodeid or path.name  # from the folder given, else the file name
        if nodeid == node.nodeid and printable(nodeid) == nodeid:
            return node
        return cls.from_parent(parent, path=path, nodeid=printable(nodeid))

    def collect(self) -> Iterator[pytest.Collector]:
        where = self.nodeid or self.path.name
        try:
            suite, lines = load_suite_file(self.path, _registry(self.config))
            cases = expand(suite, where, lines, self.config.stash[SETTINGS_KEY].max_cases)
        except SuiteError as error:
            # The rootdir-relative path reads better than the absolute one the loader knows.
            raise self.CollectError(str(error).replace(str(self.path), where)) from None
        by_server: dict[str, list[Case]] = {}
        for case in cases:
            by_server.setdefault(case.server_label, []).append(case)
        for label, server_cases in by_server.items():
            yield ServerCollector.from_parent(self, name=label, cases=server_cases)


class ServerCollector(pytest.Collector):
    def __init__(self, *, cases: list[Case], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cases = cases

    def collect(self) -> Iterator[pytest.Item]:
        settings = self.config.stash[SETTINGS_KEY]
        engine = self.config.stash[IDENTITY_KEY].engine
        for case in self.cases:
            item = BenchItem.from_parent(self, name=case.workload_label, case=case)
            reason = skip_reason(case, settings, engine)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
            yield item


class BenchItem(pytest.Item):
    """One case of a YAML suite."""

    def __init__(self, *, case: Case, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = case

    def runtest(self) -> None:
        # Thresholds are checked after the call, for both forms, by plugin.pytest_runtest_call.
        worker_session(self.config).run(self.case, self.nodeid, self.stash)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (pytest.fail.Exception, *CASE_ERRORS)):
            # The message alone: the report already names the case, and pytest's short
            # summary shows the first line, which must say what failed (metric and bound).
            # Its lines as they are, any other control character escaped (it may quote a
            # suite's own text).
            return printable(str(excinfo.value), keep="\n")
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Any, int, str]:
        # A line is required for skip reports; a case comes from the whole file (line 0).
        return self.path, 0, printable(f"{self.case.suite}: {self.case.name}")


def _registry(config: pytest.Config) -> Registry:
    """The engine arguments suites are checked against: those of the engine this run uses."""

    engine = config.stash[IDENTITY_KEY].engine
    return registry_for(engine.name, engine.vllm)


def case_of(item: pytest.Item | None) -> Case | None:
    """The benchmark case an item runs, in either form (YAML item or marked test)."""
    if isinstance(item, BenchItem):
        return item.case
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        case = callspec.params.get(CASE_FIXTURE)
        if isinstance(case, Case):
            return case
    return None


def marker_cases(metafunc: pytest.Metafunc) -> list[Case] | None:
    """The cases of a test marked `@pytest.mark.profllm(server=..., benchmark=...)`."""
    marker = metafunc.definition.get_closest_marker(PROFLLM_MARKER)
    if marker is None:
        return None
    if marker.args:
        raise pytest.Collector.CollectError(
            f"{metafunc.definition.nodeid}: @pytest.mark.profllm takes keyword arguments only "
            "(server=..., benchmark=..., thresholds=..., repeat=...)"
        )
    where = metafunc.definition.nodeid
    try:
        suite = validate_suite(dict(marker.kwargs), where, None, _registry(metafunc.config))
        return expand(suite, where, None, metafunc.config.stash[SETTINGS_KEY].max_cases)
    except SuiteError as error:
        # A collection error of this module alone, shown as the one line, not a traceback.
        raise pytest.Collector.CollectError(str(error)) from None


class CollectionFailed(Exception):
    """pytest could not collect (a usage error, say); the message is what it printed."""


@dataclass(eq=False)  # hashable: pluggy keeps plugins in sets (a conftest's hooks need it)
class CollectedCases:
    """The benchmark cases of a collection, as (node id, case), in the order a run takes."""

    engine: EngineChoice | None = None
    cases: list[tuple[str, Case]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    suite_files: set[str] = field(default_factory=set)  # file names collected as suites
    suite_glob: str = ""
    paths: dict[str, Path] = field(default_factory=dict)  # node id -> its file

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(report.longreprtext.strip())
        elif isinstance(report.nodeid, str) and "::" not in report.nodeid:
            self.suite_files.add(report.nodeid.replace("\\", "/").split("/")[-1])

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.engine = session.config.stash[IDENTITY_KEY].engine
        self.suite_glob = session.config.stash[SETTINGS_KEY].suite_glob
        self.cases = [
            (item.nodeid, case) for item in session.items if (case := case_of(item)) is not None
        ]
        self.paths = {item.nodeid: item.path for item in session.items}


def collect_cases(args: list[str]) -> CollectedCases:
    """The cases `pytest ARGS` would run: pytest's own collection, in this process, with this
    plugin (suite files, conftests and marked tests alike); it starts no server."""
    collected = CollectedCases()
    options = [
        "--collect-only",
        "--capture=no",
        "-p",
        "no:cacheprovider",  # a plan writes nothing
        "-p",
        "no:terminal",  # what the plan shows, the plan prints
        "-n",
        "0",  # collect here, not in xdist workers (an ini's addopts may ask for them)
    ]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = pytest.main([*options, *args], plugins=[collected])
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):
        printed = [line.removeprefix("ERROR: ") for line in stderr.getvalue().splitlines()]
        raise CollectionFailed("; ".join(line for line in printed if line.strip()) or str(code))
    return collected
