"""Options of the `profllm` group: the `type=` parsers and `Settings.from_config`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from pytest_profllm.hosts.pool import PORT_BLOCK
from pytest_profllm.options import (
    DEFAULT_LEASE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_SUITE_GLOB,
    Settings,
    parse_cpus,
    parse_gpus,
    parse_milliseconds,
    parse_ports,
    parse_python,
    parse_seconds,
)

# --- parse_gpus ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_bounds_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # conftest.py lifts these bounds for the sessions the tests start (they oversubscribe the
    # host); the settings under test here are the defaults and the ini file's.
    for name in (
        "PROFLLM_MAX_SCHEDULE_LAG", "PROFLLM_MAX_CLIENT_WAIT", "PROFLLM_MAX_CLIENT_OVERHEAD_TAIL"
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4", 4),
        ("1", 1),
        (" 8 ", 8),  # surrounding blanks from an ini file are not an error
        ("0,1,3", ("0", "1", "3")),
        (" 0, 1 ", ("0", "1")),
        ("2,", ("2",)),  # a trailing comma names one device, not a count
    ],
)
def test_parse_gpus_accepts_counts_and_device_ids(text: str, expected: object) -> None:
    assert parse_gpus(text) == expected


def test_parse_gpus_keeps_ids_as_strings_in_order() -> None:
    # Ids go into CUDA_VISIBLE_DEVICES as written: order matters and they stay text.
    assert parse_gpus("3,0,2") == ("3", "0", "2")


@pytest.mark.parametrize(
    ("text", "expected_parts"),
    [
        ("0", ["--profllm-gpus", "at least 1"]),
        ("", ["--profllm-gpus", "a count like 4", "0,1,3", "''"]),
        ("two", ["--profllm-gpus", "a count like 4", "device ids like 0,1,3", "'two'"]),
        ("-1", ["--profllm-gpus", "a count like 4", "'-1'"]),
        ("1.5", ["--profllm-gpus", "'1.5'"]),
        ("0,a", ["--profllm-gpus", "device ids like 0,1,3", "'0,a'"]),
        (",", ["--profllm-gpus", "device ids like 0,1,3"]),
        ("0,1,0", ["--profllm-gpus", "repeat", "'0,1,0'"]),
        pytest.param(
            "\u00b2",  # superscript two: str.isdigit() is True, int() refuses it
            ["--profllm-gpus"],
        ),
    ],
)
def test_parse_gpus_rejects_bad_input(text: str, expected_parts: list[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse_gpus(text)
    for part in expected_parts:
        assert part in str(error.value)


# --- parse_ports --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20000-21999", range(20000, 22000)),
        ("1024-1033", range(1024, 1024 + PORT_BLOCK)),  # lowest allowed, exactly one block
        ("65526-65535", range(65526, 65536)),  # highest allowed, exactly one block
        (" 30000 - 30099 ", range(30000, 30100)),
    ],
)
def test_parse_ports_accepts_ranges(text: str, expected: range) -> None:
    assert parse_ports(text) == expected


@pytest.mark.parametrize(
    ("text", "expected_parts"),
    [
        ("20000", ["--profllm-ports", "START-END like 20000-21999", "'20000'"]),
        ("a-b", ["--profllm-ports", "START-END", "'a-b'"]),
        ("1-2-3", ["--profllm-ports", "START-END", "'1-2-3'"]),
        ("", ["--profllm-ports", "START-END"]),
        ("1023-2000", ["--profllm-ports", "'1023-2000'", "1024-65535", "START <= END"]),
        ("60000-65536", ["--profllm-ports", "1024-65535"]),
        ("30000-20000", ["--profllm-ports", "START <= END"]),
        ("30000-30008", ["--profllm-ports", f"fewer than {PORT_BLOCK} ports", "'30000-30008'"]),
    ],
)
def test_parse_ports_rejects_bad_input(text: str, expected_parts: list[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse_ports(text)
    for part in expected_parts:
        assert part in str(error.value)


# --- parse_milliseconds -------------------------------------------------------------------


@pytest.mark.parametrize("text", ["later", "0", "-1", "inf", "nan"])
def test_parse_milliseconds_rejects_bad_input(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="milliseconds"):
        parse_milliseconds(text)


def test_parse_milliseconds_accepts_positive_numbers() -> None:
    assert parse_milliseconds(" 12.5 ") == 12.5


def test_bad_busy_gpus_in_ini_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nprofllm_busy_gpus = maybe\n")
    with pytest.raises(pytest.UsageError, match="profllm_busy_gpus: 'maybe' is not one of"):
        Settings.from_config(pytester.parseconfig())


# --- parse_seconds ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("900", 900.0), ("0.5", 0.5), ("1e3", 1000.0), (" 30 ", 30.0)],
)
def test_parse_seconds_accepts_positive_numbers(text: str, expected: float) -> None:
    assert parse_seconds(text) == expected


@pytest.mark.parametrize(
    ("text", "expected_parts"),
    [
        ("soon", ["expected seconds", "'soon'"]),
        ("", ["expected seconds", "''"]),
        ("10s", ["expected seconds", "'10s'"]),
        ("0", ["positive number of seconds", "'0'"]),
        ("-5", ["positive number of seconds", "'-5'"]),
        pytest.param(
            "nan",
            ["positive number of seconds", "'nan'"],
        ),
    ],
)
def test_parse_seconds_rejects_bad_input(text: str, expected_parts: list[str]) -> None:
    # parse_seconds serves two options, so the option name is added by its caller (argparse
    # or Settings.from_config); the tests of those below check that the name appears.
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse_seconds(text)
    for part in expected_parts:
        assert part in str(error.value)


# --- Settings.from_config -----------------------------------------------------------------

_INI = """
[pytest]
profllm_ports = 30000-30099
profllm_engine = sim
profllm_out = ini-out
profllm_gpus = 0,2
profllm_startup_timeout = 120
profllm_lease_timeout = 60
profllm_suite_glob = perf_*.yaml
profllm_busy_gpus = fail
profllm_max_schedule_lag = 25
"""


def test_defaults_without_ini_or_options(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    settings = Settings.from_config(pytester.parseconfig())
    assert settings == Settings(
        out_dir=None,
        db_path=None,  # no out dir and no db: nothing is written
        engine="auto",
        gpus=None,
        ports=range(20000, 22000),
        startup_timeout=DEFAULT_STARTUP_TIMEOUT,
        lease_timeout=DEFAULT_LEASE_TIMEOUT,
        suite_glob=DEFAULT_SUITE_GLOB,
    )


def test_ini_values_are_parsed(pytester: pytest.Pytester) -> None:
    pytester.makeini(_INI)
    settings = Settings.from_config(pytester.parseconfig())
    assert settings.ports == range(30000, 30100)
    assert settings.engine == "sim"
    assert settings.out_dir == pytester.path / "ini-out"
    assert settings.db_path == pytester.path / "ini-out" / "results.db"
    assert settings.gpus == ("0", "2")
    assert settings.startup_timeout == 120.0
    assert settings.lease_timeout == 60.0
    assert settings.suite_glob == "perf_*.yaml"
    assert settings.wait_for_busy_gpus is False
    assert settings.max_schedule_lag_ms == 25.0


@pytest.mark.parametrize(
    ("args", "field", "expected"),
    [
        (["--profllm-ports", "40000-40009"], "ports", range(40000, 40010)),
        (["--profllm-engine", "auto"], "engine", "auto"),
        (["--profllm-gpus", "3"], "gpus", 3),
        (["--profllm-startup-timeout", "7.5"], "startup_timeout", 7.5),
        (["--profllm-lease-timeout", "9"], "lease_timeout", 9.0),
        (["--profllm-busy-gpus", "wait"], "wait_for_busy_gpus", True),
        (["--profllm-max-schedule-lag", "40"], "max_schedule_lag_ms", 40.0),
    ],
)
def test_command_line_overrides_ini(
    pytester: pytest.Pytester, args: list[str], field: str, expected: object
) -> None:
    pytester.makeini(_INI)
    settings = Settings.from_config(pytester.parseconfig(*args))
    assert getattr(settings, field) == expected


def test_command_line_out_and_db_override_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini(_INI + "profllm_db = ini.db\n")
    settings = Settings.from_config(
        pytester.parseconfig("--profllm-out", "cli-out", "--profllm-db", "cli.db")
    )
    assert settings.out_dir == pytester.path / "cli-out"
    assert settings.db_path == pytester.path / "cli.db"


def test_engine_option_overrides_ini_through_the_plugin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plugin's pytest_configure picks the engine from the settings: an ini asking for
    # vLLM where there is none would be a usage error, unless the command line wins.
    monkeypatch.setattr("pytest_profllm.engine.choice.find_vllm", lambda python: None)
    pytester.makeini("[pytest]\nprofllm_engine = vllm\n")
    with pytest.raises(pytest.UsageError, match="vLLM is not installed"):
        pytester.parseconfigure()
    config = pytester.parseconfigure("--profllm-engine", "sim")
    assert Settings.from_config(config).engine == "sim"


def test_relative_out_resolves_against_invocation_dir(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ini (and so the rootdir) is one level up: the path must still be from the cwd.
    pytester.makeini("[pytest]\n")
    invoked_in = pytester.mkdir("sub")
    monkeypatch.chdir(invoked_in)
    config = pytester.parseconfig("--profllm-out", "runs/today")
    assert config.rootpath == pytester.path
    settings = Settings.from_config(config)
    assert settings.out_dir == invoked_in / "runs" / "today"
    assert settings.db_path == invoked_in / "runs" / "today" / "results.db"


def test_absolute_out_is_kept(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makeini("[pytest]\n")
    out = tmp_path / "elsewhere"
    settings = Settings.from_config(pytester.parseconfig(f"--profllm-out={out}"))
    assert settings.out_dir == out
    assert settings.db_path == out / "results.db"


def test_db_without_out(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    settings = Settings.from_config(pytester.parseconfig("--profllm-db", "only.db"))
    assert settings.out_dir is None
    assert settings.db_path == pytester.path / "only.db"


@pytest.mark.parametrize(
    ("ini_line", "expected_parts"),
    [
        ("profllm_ports = 5-3", ["ini option profllm_ports:", "'5-3'", "1024-65535"]),
        ("profllm_ports = lots", ["ini option profllm_ports:", "START-END", "'lots'"]),
        ("profllm_gpus = 0,0", ["ini option profllm_gpus:", "repeat", "'0,0'"]),
        ("profllm_gpus = 0", ["ini option profllm_gpus:", "at least 1"]),
        (
            "profllm_startup_timeout = soon",
            ["ini option profllm_startup_timeout:", "expected seconds", "'soon'"],
        ),
        (
            "profllm_lease_timeout = -1",
            ["ini option profllm_lease_timeout:", "positive number of seconds", "'-1'"],
        ),
        (
            "profllm_engine = gpu",
            ["ini option profllm_engine:", "'gpu'", "auto, vllm, sim"],
        ),
    ],
)
def test_bad_ini_value_is_a_usage_error(
    pytester: pytest.Pytester, ini_line: str, expected_parts: list[str]
) -> None:
    pytester.makeini(f"[pytest]\n{ini_line}\n")
    with pytest.raises(pytest.UsageError) as error:
        Settings.from_config(pytester.parseconfig())
    for part in expected_parts:
        assert part in str(error.value)


def test_bad_ini_value_stops_a_run_with_usage_error(pytester: pytest.Pytester) -> None:
    # Through the plugin: pytest reports the ini option and exits with USAGE_ERROR.
    pytester.makeini("[pytest]\nprofllm_ports = 5-3\n")
    pytester.makepyfile("def test_nothing(): pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option profllm_ports: *'5-3'*"])


@pytest.mark.parametrize(
    ("args", "expected_parts"),
    [
        (["--profllm-ports", "1-2"], ["--profllm-ports", "1024-65535"]),
        (["--profllm-gpus", "x"], ["--profllm-gpus", "a count like 4"]),
        (["--profllm-startup-timeout", "0"], ["--profllm-startup-timeout", "positive"]),
        (["--profllm-lease-timeout", "x"], ["--profllm-lease-timeout", "expected seconds"]),
        (["--profllm-engine", "gpu"], ["--profllm-engine", "'gpu'", "'vllm'", "'sim'"]),
    ],
)
def test_bad_command_line_value_names_the_option(
    pytester: pytest.Pytester, args: list[str], expected_parts: list[str]
) -> None:
    pytester.makeini("[pytest]\n")
    with pytest.raises(pytest.UsageError) as error:
        pytester.parseconfig(*args)
    for part in expected_parts:
        assert part in str(error.value)



@pytest.mark.parametrize(
    ("text", "expected"),
    [("2", 2), ("0-3/4-7", ("0-3", "4-7")), (" 0,2 / 1 ", ("0,2", "1"))],
)
def test_parse_cpus(text: str, expected: object) -> None:
    assert parse_cpus(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "at least 1"),
        ("a-b", "is not a core list"),
        ("3-1", "runs backwards"),
        ("0-3/2-5", "overlap"),
        ("/", "expected a count or core sets"),
    ],
)
def test_parse_cpus_refuses(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_cpus(text)


def test_parse_python(tmp_path: Path) -> None:
    assert parse_python(sys.executable) == sys.executable
    with pytest.raises(argparse.ArgumentTypeError, match="is not a file"):
        parse_python(str(tmp_path / "nope"))


def test_vllm_python_and_cpus_from_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini(f"[pytest]\nprofllm_vllm_python = {sys.executable}\nprofllm_cpus = 0/1\n")
    settings = Settings.from_config(pytester.parseconfig())
    assert (settings.vllm_python, settings.cpus) == (sys.executable, ("0", "1"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("H100-SXM", "H100-SXM"), ("h200", "H200"), ("a100", "A100-80GB"), ("L40S", "L40S")],
)
def test_parse_sim_device_takes_names_and_aliases(text: str, expected: str) -> None:
    from pytest_profllm.options import parse_sim_device

    assert parse_sim_device(text) == expected


def test_parse_sim_device_lists_the_known_devices() -> None:
    from pytest_profllm.options import parse_sim_device

    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse_sim_device("B300")
    assert "--profllm-sim-device: unknown simulator device 'B300'" in str(error.value)
    assert "A100-40GB" in str(error.value) and "H100-SXM" in str(error.value)


def test_sim_device_from_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nprofllm_sim_device = a100-40gb\n")
    assert Settings.from_config(pytester.parseconfig()).sim_device == "A100-40GB"
