"""SLO capacity search: the highest load a server carries while every SLO holds, as a
measurement with a bracket.

A probe runs the workload at one load (a request rate or a concurrency) and decides, for each
SLO, from a bootstrap interval of its statistic (scipy.stats.bootstrap, as the regression gate):
"meets" when the whole interval lies within the bound, "misses" when it lies wholly beyond,
"unsure" otherwise. An unsure probe is extended with more requests (pooled with the first) up
to `max_extension` times its first count; one still unsure counts as a miss, so the reported
capacity is a load shown to meet, never one that merely may. A probe whose requests failed or
whose client fell behind its schedule never meets.

The search bisects the bracket [meets, misses] on a log scale (a load's effect on latency is
multiplicative) from the middle of [low, high] until misses / meets <= 1 + precision, or the
probe or time budget is spent; an end of the range is probed only when the bisection reaches
it. A load meets only on the pooled samples of `confirm` independent runs. The search ends
with one more run at the capacity it found (the re-check): a server that changed while it was
searched (slowed as it served, or was shared with other load) misses there, and the answer is
then no measurement of the server. The probe is a
callable, so the same search drives a live server (run/capacity.py, `profllm bench`) and the
simulator's virtual clock (benchmarks/perf/capacity_search.py).

The package: `statistics` (SLOs, a run's samples, each SLO's reading), `search` (the bisection,
its probes and re-check as the record keeps them), `probes` (runs against a live server).
"""

from pytest_profllm.load.capacity.probes import (
    Measured,
    ServerProbes,
    ServerSearch,
    search_invalid_reason,
    search_server,
)
from pytest_profllm.load.capacity.search import (
    CapacityResult,
    Probe,
    ProbeRun,
    Recheck,
    describe_probe,
    search,
)
from pytest_profllm.load.capacity.statistics import (
    TAIL_SAMPLES,
    ProbeSamples,
    Slo,
    SloReading,
    decide,
    probe_samples,
    requests_per_probe,
    slos_of,
    steady_requests,
)

__all__ = [
    "TAIL_SAMPLES",
    "CapacityResult",
    "Measured",
    "Probe",
    "ProbeRun",
    "ProbeSamples",
    "Recheck",
    "ServerProbes",
    "ServerSearch",
    "Slo",
    "SloReading",
    "decide",
    "describe_probe",
    "probe_samples",
    "requests_per_probe",
    "search",
    "search_invalid_reason",
    "search_server",
    "slos_of",
    "steady_requests",
]
