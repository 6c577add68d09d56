"""Suite files: the typed form of `bench_*.yaml` and of the `profllm` marker's arguments.

A suite declares `server:` (vLLM engine arguments, snake_case) and `benchmark:` (the workload,
`vllm bench serve` flags in snake_case); a list value is an axis, except for an engine argument
that takes a list, whose axis is a list of lists. Every error of a suite is reported at once,
one line each, naming the file, the line, the key and what is allowed.

By job: the models of the whole suite (`model`) and of each benchmark kind (`serve`,
`capacity`, `offline`, `accuracy`; `kinds` names them), a YAML file read (`source`), the
checks across keys (`validate`, the `server:` block's in `server`, axes in `axes`) and the
problems they report (`problems`). Importers name this package, not its modules.
"""

from pytest_profllm.plan.suite.accuracy import AccuracyConfig
from pytest_profllm.plan.suite.axes import combinations, fold_dotted_keys
from pytest_profllm.plan.suite.capacity import (
    GOODPUT_SLO,
    CapacityConfig,
    CapacitySearch,
    slo_problem,
)
from pytest_profllm.plan.suite.kinds import (
    BENCHMARK_KINDS,
    OfflineConfig,
    WorkloadConfig,
    measures,
)
from pytest_profllm.plan.suite.model import Exclusion, Suite, Threshold
from pytest_profllm.plan.suite.offline import LatencyConfig, ThroughputConfig
from pytest_profllm.plan.suite.problems import (
    SuiteError,
    at_line,
    describe_error,
    describe_errors,
    did_you_mean,
)
from pytest_profllm.plan.suite.serve import (
    MEDIA_DATASETS,
    POOLING_BACKENDS,
    VLLM_DEFAULT_NUM_PROMPTS,
    BenchmarkConfig,
    bucket_shape,
)
from pytest_profllm.plan.suite.server import LEASED_SERVER_ARGS, cross_field_problem
from pytest_profllm.plan.suite.source import (
    MAX_SUITE_VALUES,
    SHIPPED_DATA,
    SHIPPED_PREFIX,
    load_suite_file,
)
from pytest_profllm.plan.suite.until import UNTIL_METRICS, Until
from pytest_profllm.plan.suite.validate import validate_suite

__all__ = [
    "BENCHMARK_KINDS",
    "GOODPUT_SLO",
    "LEASED_SERVER_ARGS",
    "MAX_SUITE_VALUES",
    "MEDIA_DATASETS",
    "POOLING_BACKENDS",
    "SHIPPED_DATA",
    "SHIPPED_PREFIX",
    "UNTIL_METRICS",
    "VLLM_DEFAULT_NUM_PROMPTS",
    "AccuracyConfig",
    "BenchmarkConfig",
    "CapacityConfig",
    "CapacitySearch",
    "Exclusion",
    "LatencyConfig",
    "OfflineConfig",
    "Suite",
    "SuiteError",
    "Threshold",
    "ThroughputConfig",
    "Until",
    "WorkloadConfig",
    "at_line",
    "bucket_shape",
    "combinations",
    "cross_field_problem",
    "describe_error",
    "describe_errors",
    "did_you_mean",
    "fold_dotted_keys",
    "load_suite_file",
    "measures",
    "slo_problem",
    "validate_suite",
]
