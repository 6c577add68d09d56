"""Command-line and ini options of the `profllm` group, and the settings built from them.

Each option is declared once, in `table.Table`: its flag, ini key, parser (`parsers`), default
and help. From that entry come its `addoption` and `addini` (`declare.register`), its value in
a session (`declare.value_of`: the command line, else the ini file, else the default), the
`Settings` (`settings`) and the table of docs/options.md (`docs_table`)."""

from __future__ import annotations

from pytest_profllm.options.declare import value_of
from pytest_profllm.options.parsers import (
    DEFAULT_PORTS,
    parse_confidence,
    parse_cpus,
    parse_gpu_hour_price,
    parse_gpus,
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
)
from pytest_profllm.options.settings import Settings, gate_config
from pytest_profllm.options.table import (
    DEFAULT_LEASE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_SUITE_GLOB,
    LiveMode,
    Table,
    add_options,
)

__all__ = [
    "DEFAULT_LEASE_TIMEOUT",
    "DEFAULT_PORTS",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_SUITE_GLOB",
    "LiveMode",
    "Settings",
    "Table",
    "add_options",
    "gate_config",
    "parse_confidence",
    "parse_cpus",
    "parse_gpu_hour_price",
    "parse_gpus",
    "parse_max_cases",
    "parse_metrics_port",
    "parse_milliseconds",
    "parse_ports",
    "parse_python",
    "parse_remeasure",
    "parse_resamples",
    "parse_saturation_margin",
    "parse_seconds",
    "parse_share",
    "parse_sim_device",
    "parse_sim_profile",
    "value_of",
]
