"""Probes against a running server: each run from an emptied cache with prompts of its own,
judged (load/validity.py) and run again as any load (load/attempts.py); and `profllm bench`'s
search against a server."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pytest_profllm.hosts.foreign_cpu import ForeignCpu
from pytest_profllm.load import loops, stages
from pytest_profllm.load.attempts import Attempts
from pytest_profllm.load.bench import (
    bench_rules,
    check_reachable,
    load_settings,
    measure,
    prompts_of_its_own,
    run_load,
    server_engine,
    workload_own_hits,
)
from pytest_profllm.load.bench_result import DETAILED_KEYS, result_json
from pytest_profllm.load.capacity.search import (
    CapacityResult,
    Probe,
    load_text,
    search,
    unit_of,
)
from pytest_profllm.load.capacity.statistics import (
    ProbeSamples,
    probe_samples,
    requests_per_probe,
    slos_of,
)
from pytest_profllm.load.dataset import (
    Codec,
    PromptRequest,
    ServerCodec,
    TokenizerCodec,
    make_prompts,
)
from pytest_profllm.load.metrics import MAX_CLIENT_RUNQUEUE_WAIT_SHARE
from pytest_profllm.load.prometheus_counters import REQUEST_TOTALS
from pytest_profllm.load.remeasure_budget import RemeasureBudget
from pytest_profllm.load.schedule import LoadResult, back_to_back
from pytest_profllm.load.server_state import empty_caches, scrape_metrics
from pytest_profllm.load.server_view import DEFAULT_MAX_CLIENT_OVERHEAD_MS
from pytest_profllm.load.span_receiver import SpanReceiver
from pytest_profllm.load.trace_join import JOINED_SHARE, take_spans
from pytest_profllm.load.validity import (
    DEFAULT_RULES,
    Judgement,
    LoadFacts,
    Rules,
    ServerWindow,
    judge,
    texts,
)
from pytest_profllm.plan.metric_names import CLIENT_HEALTH_KEYS
from pytest_profllm.plan.suite import CapacityConfig

Measured = tuple[CapacityConfig, LoadResult, dict[str, Any], ServerWindow, Judgement]


class ServerProbes:
    """Probes against one running server. Every run of every probe is independent: it starts
    from an emptied prefix cache, with prompts no earlier run sent (drawn from the run's own
    seed), so no probe is answered from what the one before it left. A run the host made
    invalid (the client or the simulated engine fell behind) runs again, up to `remeasure`
    more times. Keeps what each load measured last, and the search's re-check apart
    (`recheck`: its run must not stand for the probe at the capacity); `drive` runs a load to
    its end (the case's also watches that the server lives)."""

    def __init__(
        self,
        bench: CapacityConfig,
        base_url: str,
        codec: Codec,
        prompts: list[PromptRequest],
        model: str,
        api_key: str | None,
        rules: Rules = DEFAULT_RULES,
        drive: Callable[[Coroutine[Any, Any, LoadResult]], LoadResult] = loops.run,
        endpoint: str | None = None,
        remeasure: int = 0,
        holding: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        budget: RemeasureBudget | None = None,
        load_cores: Callable[[], frozenset[int]] = frozenset,
        client_processes: Callable[[], int] | None = None,
        receiver: SpanReceiver | None = None,
    ) -> None:
        self.bench = bench
        # Where the server's trace spans arrive (None: not traced): each run's requests are
        # joined to theirs, and the run is judged for the client's tail as a case's load is.
        self.receiver = receiver
        self.base_url = base_url
        self.drive = drive
        self.endpoint = endpoint
        self.codec = codec
        self.first_prompts = prompts  # drawn from the workload's own seed: the first run's
        self.model = model
        self.api_key = api_key
        self.rules = rules  # what counts as a measurement (load/validity.py)
        self.remeasure = remeasure
        self.budget = budget or RemeasureBudget()  # the session's time for runs again
        self.holding = holding  # held from drawing a probe's prompts to its last run
        # The cores a run's load runs on while `holding` (none: not watched: others' use of
        # them is judged by `rules`, hosts/foreign_cpu.py).
        self.load_cores = load_cores
        # How many client processes a run's load takes while `holding` (`auto`: by the cores
        # held); None: the config's.
        self.client_processes = client_processes
        # load -> (config, load result, summary with health, /metrics around it) of its last run
        self.measured: dict[float, Measured] = {}
        # load -> why each of its runs that the host made invalid was run again
        self.remeasured: dict[float, list[str]] = {}
        self.cache_states: set[str] = set()  # how the runs found the prefix cache
        # load -> what its last run's prompts could find of each other in a cold cache
        self.own_hits: dict[float, int] = {}
        # The re-check's run after the search, and why it was run again (as `measured`).
        self.rechecked: Measured | None = None
        self.recheck_remeasured: list[str] = []
        # load -> every run at it, in order: a probe's figures are those of all its runs
        self.runs: dict[float, list[Measured]] = {}
        # What every run sent, kept or run again (the record's `capacity.requests_sent`): the
        # client's Prometheus counters count each run, and these add up to them.
        self.requests_sent: dict[str, int] = dict.fromkeys(REQUEST_TOTALS, 0)

    def probe_runs(
        self, probe: Probe
    ) -> list[Measured]:
        """The runs that made `probe`: the last runs at its load, as many as its requests
        (each run sends its config's num_prompts)."""
        runs: list[Measured] = []
        for run in reversed(self.runs.get(probe.load, [])):
            if sum(run[0].num_prompts for run in runs) >= probe.requests:
                break
            runs.insert(0, run)
        return runs

    def pooled(self, probe: Probe) -> tuple[CapacityConfig, LoadResult, dict[str, Any]]:
        """The probe's figures as its table shows them: vLLM's metrics and the client's
        health over the requests of all its runs, laid back to back (the last run alone was
        kept before: half a confirmed probe's requests, its figures not the probe's)."""
        runs = self.probe_runs(probe)
        config = runs[-1][0]
        load = back_to_back([run[1] for run in runs])
        summary, health = measure(load, config, self.codec)
        summary.update(health)
        return config, load, summary

    def prompts_for(self, count: int, seed: int) -> list[PromptRequest]:
        if seed == self.bench.seed and count <= len(self.first_prompts):
            return self.first_prompts[:count]
        return make_prompts(
            self.bench.model_copy(update={"num_prompts": count, "seed": seed}), self.codec
        )

    def __call__(self, load: float, count: int, seed: int) -> ProbeSamples:
        probe = len(self.runs) + (load not in self.runs)  # its runs after the first count once
        over = unit_of(self.bench.search.over)
        stages.enter("searching", f"probe {probe} at {load_text(load)} {over}")
        with self.holding():
            samples, measured, own_hits, again = self._run(load, count, seed)
        self.measured[load], self.own_hits[load] = measured, own_hits
        self.runs.setdefault(load, []).append(measured)
        if again:
            self.remeasured.setdefault(load, []).extend(again)
        return samples

    def recheck(self, load: float, count: int, seed: int) -> ProbeSamples:
        """The search's re-check at the capacity: a run as any other, kept apart."""
        over = unit_of(self.bench.search.over)
        stages.enter("searching", f"re-check at {load_text(load)} {over}")
        with self.holding():
            samples, self.rechecked, _, self.recheck_remeasured = self._run(load, count, seed)
        return samples

    def _run(
        self, load: float, count: int, seed: int
    ) -> tuple[ProbeSamples, Measured, int, list[str]]:
        """One run (and its runs again, as any load's: `Attempts`): its samples, what it
        measured, what its prompts find of each other in a cold cache, and why it was run
        again."""
        over = self.bench.search.over
        value: float | int = int(load) if over == "max_concurrency" else load
        config = self.bench.model_copy(update={over: value, "num_prompts": count, "seed": seed})
        chosen = self.prompts_for(count, seed)
        settings = load_settings(
            config, self.base_url, self.model, api_key=self.api_key, endpoint=self.endpoint,
            client_processes=self.client_processes() if self.client_processes else None,
        )
        metrics_url = f"{self.base_url.rstrip('/')}/metrics"
        own_hits = workload_own_hits(chosen, config, self.codec)
        attempts = Attempts(self.remeasure, self.budget)
        while True:
            started = time.time()
            cache = empty_caches(self.base_url, config, self.api_key).describe()
            self.cache_states.add(cache)
            before = scrape_metrics(metrics_url)
            foreign = ForeignCpu(self.load_cores())
            key = self.receiver.expect() if self.receiver is not None else ""
            result = self.drive(run_load(dataclasses.replace(settings, trace_key=key), chosen))
            share = foreign.share()
            window = (before, scrape_metrics(metrics_url))
            summary, health = measure(result, config, self.codec)
            summary.update(health)
            for key_name in REQUEST_TOTALS:
                self.requests_sent[key_name] += int(summary.get(key_name) or 0)
            spans = take_spans(self.receiver, key, result.outcomes) if self.receiver else None
            figures = dict(spans.figures) if spans is not None else {}
            joined_share = figures.pop(JOINED_SHARE, None)
            summary.update({k: v for k, v in figures.items() if v is not None})
            judgement = judge(
                LoadFacts(result, config, health, summary, own_hits, share, joined_share,
                          spans.problem if spans is not None else None,
                          spans.server_ttft_p99_ms if spans is not None else None),
                window, self.rules,
            )
            reasons = judgement.reasons
            attempts.add(started, reasons, summary, {}, cache)
            if not attempts.again(reasons):
                break
            stages.enter("remeasuring", f"{load_text(load)} {unit_of(self.bench.search.over)}, "
                         f"attempt {len(attempts.kept) + 1}")
        host = texts(attempts.host_reasons(reasons))
        again = ["; ".join(kept["reasons"]) for kept in attempts.kept[:-1]]
        samples = probe_samples(
            result.outcomes, summary, health, self.bench.goodput, "; ".join(host) or None
        )
        return samples, (config, result, summary, window, judgement), own_hits, again


def search_invalid_reason(found: CapacityResult, probes: ServerProbes) -> str | None:
    """Why a search's capacity is no measurement of the server: each run of the probe kept
    at the capacity as the judge found it (each run judged on its own: between runs the caches
    were emptied, so a /metrics window over all of them would count that too), then the
    search's own reasons (the server changed, or the host bounded it)."""
    reasons: list[str] = []
    if found.capacity is not None:
        for run in probes.probe_runs(found.kept()):
            reasons.extend(texts(run[4].reasons))
    kept = "; ".join(dict.fromkeys(reasons)) or None
    return "; ".join(filter(None, (kept, found.invalid_reason()))) or None


@dataclass
class ServerSearch:
    """A capacity search against a running server: its result, and the figures (vLLM's result
    keys) and load of the probe at the capacity (else of the first probe)."""

    found: CapacityResult
    result: dict[str, Any]
    load: LoadResult


def search_server(
    config: CapacityConfig,
    base_url: str,
    model: str,
    *,
    served_model_name: str | None = None,
    tokenizer: str | None = None,
    api_key: str | None = None,
    endpoint: str | None = None,
    label: str | None = None,
    on_probe: Callable[[Probe], None] | None = None,
    max_schedule_lag_ms: float | None = None,
    max_client_overhead_ms: float | None = DEFAULT_MAX_CLIENT_OVERHEAD_MS,
    max_client_wait: float | None = MAX_CLIENT_RUNQUEUE_WAIT_SHARE,
) -> ServerSearch:
    """`profllm bench` with SLOs: the search against the server at `base_url`."""
    check_reachable(base_url)
    name = served_model_name or model
    codec: Codec = (
        TokenizerCodec.load(tokenizer) if tokenizer else ServerCodec(base_url, name, api_key)
    )
    slos = slos_of(config.slo)
    per_probe = requests_per_probe(slos, config.num_prompts)
    config = prompts_of_its_own(config, empty_caches(base_url, config, api_key))
    prompts = make_prompts(config.model_copy(update={"num_prompts": per_probe}), codec)
    rules = bench_rules(base_url, max_schedule_lag_ms, max_client_overhead_ms, max_client_wait)
    probes = ServerProbes(config, base_url, codec, prompts, name, api_key, rules,
                          endpoint=endpoint)
    found = search(probes, slos, config.search, config.num_prompts, seed=config.seed,
                   on_probe=on_probe, recheck=probes.recheck)
    probe_config, load, summary = probes.pooled(found.kept())
    health = {key: value for key, value in summary.items() if key in CLIENT_HEALTH_KEYS}
    result = result_json(probe_config, model, tokenizer, label, load, summary, health, codec)
    result["engine"] = server_engine(base_url, api_key)
    result.update(found.results())
    result["capacity_search"] = found.as_record()
    result["prefix_cache"] = "; ".join(sorted(probes.cache_states))
    result["prompt_seed"] = config.seed
    # As a capacity case is judged (run/capacity.py): ingested, invalid where it is not one.
    invalid = search_invalid_reason(found, probes)
    result["validity"] = "invalid" if invalid else "valid"
    result["invalid_reason"] = invalid
    # What the judge could not apply here, each with why (the last run of the kept probe).
    result["rules_not_applied"] = probes.probe_runs(found.kept())[-1][4].not_applied
    for key in DETAILED_KEYS:
        result.pop(key, None)
    return ServerSearch(found, result, load)


