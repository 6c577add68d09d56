"""Running one capacity case: one server, the workload probed at loads the search chooses
(load/capacity/), and a record whose result is the capacity with its bracket and whose
figures are those of the probe at the capacity, over all its runs. A capacity that the
search's re-check missed (the server changed while it was searched) is an invalid measurement.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from pytest_profllm.hosts.cores import client_processes
from pytest_profllm.load import loops, metrics
from pytest_profllm.load.capacity import (
    CapacityResult,
    ServerProbes,
    requests_per_probe,
    search,
    search_invalid_reason,
    slos_of,
)
from pytest_profllm.load.dataset import make_prompts
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.server_view import missing
from pytest_profllm.load.validity import DEFAULT_RULES, Rules
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import CapacityConfig
from pytest_profllm.run.outcome import (
    CaseFailed,
    CaseOutcome,
    check_thresholds,
    dataset_refusals,
    request_row,
)
from pytest_profllm.run.serve import (
    api_key_of,
    codec_for,
    load_cores_of,
    load_while_alive,
    served_name,
)
from pytest_profllm.run.telemetry import Sampler
from pytest_profllm.server.workers import WorkerServers


def run_capacity(
    case: Case,
    servers: WorkerServers,
    outcome: CaseOutcome,
    rules: Rules = DEFAULT_RULES,
    remeasure: int = 0,
    budget: RemeasureBudget | None = None,
) -> CaseOutcome:
    """Start or reuse the server, search its capacity (every probe run from an emptied cache
    with prompts of its own, load/capacity/probes.py `ServerProbes`), and keep the probe at the
    capacity."""
    bench = case.benchmark
    assert isinstance(bench, CapacityConfig)
    slos = slos_of(bench.slo)
    with servers.serving(case) as server:
        outcome.server = server
        codec = codec_for(case, servers.engine, server.base_url)
        per_probe = requests_per_probe(slos, bench.num_prompts)
        with dataset_refusals(case):
            prompts = make_prompts(bench.model_copy(update={"num_prompts": per_probe}), codec)

        waited_s = [0.0]  # the search's waits for load cores, which its time budget leaves out

        @contextlib.contextmanager
        def holding_cores() -> Iterator[None]:
            # Each probe holds the host's load cores from drawing its prompts to its last run,
            # and only then: waiting comes before its loads, and other cases' loads run
            # between probes.
            with servers.load_cores(server, bench.client_processes) as outcome.load_cores:
                waited_s[0] += outcome.load_cores.wait_s
                yield

        probes = ServerProbes(
            bench, server.base_url, codec, prompts, served_name(case.server),
            api_key_of(case.server), rules,
            drive=lambda load: loops.run(load_while_alive(server, load)),
            remeasure=remeasure, holding=holding_cores, budget=budget,
            load_cores=lambda: load_cores_of(server, outcome.load_cores),
            client_processes=lambda: client_processes(bench.client_processes,
                                                      outcome.load_cores),
            receiver=servers.spans_of(server)[0],
        )
        gpu_ids = server.lease.gpus if server.device == "gpu" else ()
        with Sampler(server.pid, gpu_ids, f"{server.base_url}/metrics") as sampler:
            # `max_time_s` is the search's own time: on a busy host its probes waited minutes
            # for load cores, and the budget spent on waiting ended a search at a wide bracket.
            found = search(probes, slos, bench.search, bench.num_prompts, seed=bench.seed,
                           recheck=probes.recheck,
                           clock=lambda: time.monotonic() - waited_s[0])
        outcome.telemetry = sampler.record()
        outcome.series = sampler.series()
    keep_probe_at_capacity(outcome, found, probes)
    outcome.capacity = found.as_record()
    for probe in outcome.capacity["probes"]:
        # Why runs of this probe were measured again (the host made them invalid).
        probe["remeasured"] = probes.remeasured.get(probe["load"], [])
    if outcome.capacity["recheck"] is not None:
        outcome.capacity["recheck"]["remeasured"] = probes.recheck_remeasured
    outcome.capacity["requests_sent"] = probes.requests_sent
    outcome.prefix_cache = "; ".join(sorted(probes.cache_states)) or None
    # Each run of a probe has a /metrics window of its own, with the cache emptied between
    # them: the probe's pooled figures have no one window to set beside.
    outcome.server_view = missing("not taken for capacity searches (a probe's runs each have "
                                  "their own /metrics window)")
    outcome.results.update(found.results())
    outcome.threshold_results = check_thresholds(case, outcome.results)
    outcome.finished_at = time.time()
    return outcome


def keep_probe_at_capacity(
    outcome: CaseOutcome, found: CapacityResult, probes: ServerProbes
) -> None:
    """The figures, requests and validity of the probe at the capacity (else the first, which
    says why no load met), over all its runs. A search whose every request failed measured
    nothing. Where the capacity is no measurement of the server (a run of its probe was
    invalid, the server changed during the search, or the host bounded it), the number is
    kept in the record, as any invalid measurement's figures, for the run page; it counts for
    nothing (no gate, no baseline, no history)."""
    probe = found.kept()
    _, load, summary = probes.pooled(probe)
    if not summary.get("completed"):
        problem = metrics.served_problem(load.outcomes, summary, 0)
        raise CaseFailed(problem or "no request of the capacity search completed")
    outcome.results = dict(summary)
    # What the client added to each request of the probe's last run over its server span
    # (where the server is traced): the figures its tail was judged on.
    traced = probes.probe_runs(probe)[-1][2]
    outcome.results.update({key: value for key, value in traced.items()
                            if key.startswith("client_overhead_") and key not in summary})
    outcome.client_limit = load.client_limit
    outcome.requests = [
        request_row(index, o, load.clock_start) for index, o in enumerate(load.outcomes)
    ]
    outcome.invalid_reason = search_invalid_reason(found, probes)
    if found.capacity is not None:
        outcome.request_failures = metrics.request_failures(load.outcomes)
