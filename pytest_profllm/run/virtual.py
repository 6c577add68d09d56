"""Cases on the virtual clock (`--profllm-sim-clock virtual`): the simulated engine a server of
the case's configuration would run (the same argv through the simulator's own parser, so the
same device profile, model facts, batch limits and KV cache), stepped in this process without
sleeping (`sim/virtual.py`), with no server, port or HTTP.

The requests are those the real client would send (the workload's dataset, each prompt's
token ids as the simulator would count them), on the client's own arrival schedule; the
figures come from per-request times through the client's metric code (`load/bench.measure`).
A capacity case runs the same search (`load/capacity/`) with probes on the virtual clock.
What a virtual run cannot have (GPU and process telemetry, the client's CPU) stays null.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from typing import Any

from pytest_profllm.engine.command import serve_args
from pytest_profllm.engine.registry import registry_for
from pytest_profllm.load import metrics, stages
from pytest_profllm.load.bench import measure
from pytest_profllm.load.capacity import (
    Measured,
    ServerProbes,
    probe_samples,
    requests_per_probe,
    search,
    slos_of,
)
from pytest_profllm.load.conversation import Conversations, Workload, make_workload
from pytest_profllm.load.dataset import random_token_prompts
from pytest_profllm.load.lora_mix import by_adapter, with_models
from pytest_profllm.load.prompt import Codec, PromptRequest
from pytest_profllm.load.schedule import LoadResult, arrival_offsets
from pytest_profllm.load.server_view import missing
from pytest_profllm.load.spec_decode import FIGURES, NOT_SPECULATING_SIM, figures_of
from pytest_profllm.load.validity import LoadFacts, Rules, ServerWindow, judge
from pytest_profllm.plan.case import Case
from pytest_profllm.plan.suite import MEDIA_DATASETS, BenchmarkConfig, CapacityConfig
from pytest_profllm.run.capacity import keep_probe_at_capacity
from pytest_profllm.run.outcome import (
    CaseFailed,
    CaseOutcome,
    check_thresholds,
    dataset_refusals,
    request_row,
)
from pytest_profllm.run.serve import allowed_failures, check_served, codec_for, context_of
from pytest_profllm.sim.cli import build_parser, make_scheduler, setup_for
from pytest_profllm.sim.config import SimSetup
from pytest_profllm.sim.profile_file import ProfileSnapshot
from pytest_profllm.sim.virtual import Outcome, Request, Served, simulate

# What the record says of the prefix cache each virtual run began with.
FRESH_ENGINE = "a fresh engine (virtual clock)"
# The client's figures a virtual run has no measurement of.
_NOT_ON_THE_VIRTUAL_CLOCK = ("client_cpu_percent",)


def skip_reason(case: Case) -> str | None:
    """Why the virtual clock cannot run this case (one line), known before anything runs;
    None where it can."""
    bench = case.benchmark
    why = None
    if case.kind == "accuracy":
        why = "an accuracy case asks a server for answers; the engine model gives only times"
    elif case.kind not in ("serve", "capacity"):
        why = f"an offline case ({case.kind}) runs vLLM's own benchmark, not the engine model"
    elif not isinstance(bench, BenchmarkConfig):
        why = "not a serving workload"
    elif bench.dataset_name in MEDIA_DATASETS:
        why = f"dataset_name {bench.dataset_name!r} sends media, which it does not model"
    elif bench.is_pooling:
        why = f"backend {bench.backend!r} is a pooling workload, which it does not model"
    elif bench.dataset_name == "conversation":
        why = "conversations (each turn waits on the answer before it) are not modelled"
    elif bench.warm_cache:
        why = "warm_cache: true keeps a server's cache between loads; each run is a fresh engine"
    elif bench.until is not None:
        why = ("until: sends rounds to one server that lives through them; each load here is "
               "a fresh engine")
    elif case.profile:
        why = "profiling needs a server to trace"
    return None if why is None else f"--profllm-sim-clock virtual: {why}"


@dataclass(frozen=True)
class VirtualEngine:
    """The engine a simulated server of one configuration runs, ready to be stepped."""

    setup: SimSetup
    args: argparse.Namespace

    @classmethod
    def of(
        cls, case: Case, sim_device: str | None, sim_profile: ProfileSnapshot | None = None
    ) -> VirtualEngine:
        """As `profllm sim` would start on the case's engine arguments, on `sim_device` or the
        profile file the session read; CaseFailed where it would not start (an unknown model
        or device, no memory for the KV cache)."""
        argv = serve_args(case.server, registry_for("sim", None))
        if sim_device:
            argv += ["--sim-device", sim_device]
        args, _ = build_parser().parse_known_args(argv)
        profile = sim_profile.profile if sim_profile is not None else None
        try:
            setup = setup_for(args, str(args.model or args.model_tag), profile)
        except ValueError as error:
            raise CaseFailed(f"the simulated engine would not start: {error}") from None
        return cls(setup, args)

    def run(
        self, prompts: list[PromptRequest], bench: BenchmarkConfig, codec: Codec
    ) -> tuple[LoadResult, Outcome]:
        """The load as the client would have measured it against a fresh server, and the
        engine's run."""
        offsets = (
            [request.timestamp or 0.0 for request in prompts]
            if bench.is_self_timed
            else arrival_offsets(
                len(prompts), bench.request_rate, bench.burstiness, bench.seed,
                bench.ramp_up_strategy, bench.ramp_up_start_rps, bench.ramp_up_end_rps,
            )
        )
        chat = codec.encode("user:\n") if bench.backend == "openai-chat" else []
        limit = self.setup.max_model_len
        outcomes: list[metrics.RequestOutcome | None] = [None] * len(prompts)
        admitted: list[int] = []  # indexes of the requests the server would take
        requests: list[Request] = []
        for index, prompt in enumerate(prompts):
            ids = chat + (
                list(prompt.prompt_ids) if prompt.prompt_ids is not None
                else codec.encode(prompt.prompt)
            )
            if len(ids) >= limit or len(ids) + prompt.output_len > limit:
                # Refused as the simulator refuses it (sim/app.py `_too_long`): a 400.
                outcomes[index] = _refused(prompt, len(ids), offsets[index], limit)
                continue
            admitted.append(index)
            requests.append(Request(len(ids), prompt.output_len, tuple(ids), prompt.model))
        scheduler = make_scheduler(self.args, self.setup)
        outcome = simulate(
            self.setup.engine, requests, max_concurrency=bench.max_concurrency,
            arrivals=[offsets[index] for index in admitted], scheduler=scheduler,
        )
        for served in outcome.served:
            index = admitted[served.index]
            answered = _answered(served, prompts[index].output_len)
            answered.model = prompts[index].model
            outcomes[index] = answered
        for index in admitted:
            if outcomes[index] is None:  # it never ran: its prompt is larger than the cache
                outcomes[index] = metrics.RequestOutcome(
                    prompt_len=requests[admitted.index(index)].prompt_len,
                    intended_start=offsets[index], dispatch_time=offsets[index],
                    start_time=offsets[index], output_len=prompts[index].output_len,
                    model=prompts[index].model,
                    error="the simulated engine could not schedule it: the prompt needs more "
                    "KV-cache blocks than the engine has",
                )
        load = LoadResult(
            [o for o in outcomes if o is not None], outcome.duration, time.time(), 0.0,
            intended_offsets=list(offsets),
        )
        return load, outcome


def engine_figures(outcome: Outcome) -> dict[str, Any]:
    """The engine's own figures over a run, under the names a server's /metrics gives them
    in the record (`system`)."""
    queries = outcome.prefix_cache_queries
    spec = (figures_of(*outcome.spec_decode) if outcome.spec_decode is not None
            else {**dict.fromkeys(FIGURES), "server_spec_decode_problem": NOT_SPECULATING_SIM})
    return {
        **spec,
        "peak_kv_cache_usage": outcome.peak_kv_cache_usage,
        "server_num_gpu_blocks": outcome.num_gpu_blocks or None,
        "server_kv_block_size": outcome.block_size or None,
        "server_kv_cache_tokens": outcome.num_gpu_blocks * outcome.block_size or None,
        "server_num_preemptions": outcome.preemptions,
        "server_prefix_cache_queries": queries,
        "server_prefix_cache_hits": outcome.prefix_cache_hits,
        "server_prefix_cache_hit_rate": outcome.prefix_cache_hits / queries if queries else None,
        "sim_steps": outcome.steps,
    }


def _answered(served: Served, asked: int) -> metrics.RequestOutcome:
    gaps = list(served.gaps)
    return metrics.RequestOutcome(
        prompt_len=served.prompt_len,
        success=True,
        output_tokens=served.generated,
        ttft=served.first_token - served.sent,
        itl=gaps,
        latency=served.finished - served.sent,
        start_time=served.sent,
        intended_start=served.intended,
        dispatch_time=served.intended,  # the virtual client is never late
        end_time=served.finished,
        message_times=list(itertools.accumulate(gaps, initial=served.first_token)),
        status=200,
        output_len=asked,
    )


def _refused(prompt: PromptRequest, length: int, at: float, limit: int) -> metrics.RequestOutcome:
    return metrics.RequestOutcome(
        prompt_len=length, intended_start=at, dispatch_time=at, start_time=at, end_time=at,
        status=400, output_len=prompt.output_len,
        error=f"400: this model's maximum context length is {limit} tokens; the request has "
        f"{length} prompt tokens and asks for {prompt.output_len} more",
    )


def virtual_prompts(bench: BenchmarkConfig, codec: Codec, context: int | None) -> Workload:
    """The workload's requests: the random dataset's as the token ids and lengths it draws
    (rendering 2,000 prompts as text costs more than simulating them), any other as the client
    makes it."""
    if bench.dataset_name == "random":
        return with_models(random_token_prompts(bench, codec), bench)
    return make_workload(bench, codec, context)


def _measured(
    engine: VirtualEngine, prompts: list[PromptRequest], bench: BenchmarkConfig, codec: Codec
) -> tuple[LoadResult, Outcome, dict[str, Any], dict[str, Any]]:
    """A virtual run's load, the engine's run, vLLM's metrics with the client's health, and
    the health alone."""
    load, run = engine.run(prompts, bench, codec)
    summary, health = measure(load, bench, codec)
    for key in _NOT_ON_THE_VIRTUAL_CLOCK:
        health[key] = None
    summary.update(health)
    return load, run, summary, health


# The virtual clock's client is the engine model's own: no server, no HTTP, nothing to add.
VIRTUAL_VIEW = "the virtual clock has no server: its client's figures are the engine model's"
# What the judge may hold a virtual run to: its token counts, never the host's timing.
VIRTUAL_RULES = Rules(virtual_clock=True)
NO_WINDOW: ServerWindow = (None, None)


def run_virtual_case(
    case: Case,
    outcome: CaseOutcome,
    sim_device: str | None,
    sim_profile: ProfileSnapshot | None = None,
) -> CaseOutcome:
    """A serve case on the virtual clock: the workload's requests through the engine model,
    vLLM's metrics and the verdicts, as `run/serve.run_case` without a server."""
    bench = case.benchmark
    assert isinstance(bench, BenchmarkConfig), "offline kinds are skipped (skip_reason)"
    engine = VirtualEngine.of(case, sim_device, sim_profile)
    stages.enter("loading", "virtual clock")
    codec = codec_for(case, "sim", "")  # the simulator's tokenizer is always a local one
    with dataset_refusals(case):
        prompts = virtual_prompts(bench, codec, context_of(case))
    assert not isinstance(prompts, Conversations), "conversations are skipped (skip_reason)"
    load, run, results, health = _measured(engine, prompts, bench, codec)
    outcome.invalid_reason = judge(
        LoadFacts(load, bench, health, results), NO_WINDOW, VIRTUAL_RULES
    ).line()
    outcome.prefix_cache = FRESH_ENGINE
    outcome.telemetry = dict(engine_figures(run))
    outcome.results = results
    outcome.server_view = missing(VIRTUAL_VIEW)
    outcome.threshold_results = check_thresholds(case, results)
    outcome.request_failures = metrics.request_failures(load.outcomes)
    outcome.by_adapter = by_adapter(load.outcomes, load.duration)
    outcome.requests = [request_row(i, o, load.clock_start) for i, o in enumerate(load.outcomes)]
    check_served(load.outcomes, results, allowed_failures(case))
    outcome.finished_at = time.time()
    return outcome


class VirtualProbes(ServerProbes):
    """A capacity search's probes on the virtual clock: each run a fresh engine of the case's
    configuration, with prompts of the run's own seed, as `ServerProbes` runs them against a
    server (whose bookkeeping it keeps: what each load measured, the re-check apart)."""

    def __init__(
        self, bench: CapacityConfig, engine: VirtualEngine, codec: Codec,
        prompts: list[PromptRequest],
    ) -> None:
        super().__init__(bench, "", codec, prompts, "", None, VIRTUAL_RULES)
        self.engine = engine

    def prompts_for(self, count: int, seed: int) -> list[PromptRequest]:
        if seed == self.bench.seed and count <= len(self.first_prompts):
            return self.first_prompts[:count]
        prompts = virtual_prompts(
            self.bench.model_copy(update={"num_prompts": count, "seed": seed}), self.codec, None
        )
        assert not isinstance(prompts, Conversations)
        return prompts

    def _run(
        self, load: float, count: int, seed: int
    ) -> tuple[Any, Measured, int, list[str]]:
        over = self.bench.search.over
        value: float | int = int(load) if over == "max_concurrency" else load
        config = self.bench.model_copy(update={over: value, "num_prompts": count, "seed": seed})
        result, _, summary, health = _measured(
            self.engine, self.prompts_for(count, seed), config, self.codec
        )
        self.cache_states.add(FRESH_ENGINE)
        judgement = judge(LoadFacts(result, config, health, summary), NO_WINDOW, VIRTUAL_RULES)
        samples = probe_samples(result.outcomes, summary, health, self.bench.goodput, None)
        return samples, (config, result, summary, NO_WINDOW, judgement), 0, []


def run_virtual_capacity(
    case: Case,
    outcome: CaseOutcome,
    sim_device: str | None,
    sim_profile: ProfileSnapshot | None = None,
) -> CaseOutcome:
    """A capacity case on the virtual clock: `run/capacity.run_capacity`'s search, each probe
    a run of the engine model."""
    bench = case.benchmark
    assert isinstance(bench, CapacityConfig)
    engine = VirtualEngine.of(case, sim_device, sim_profile)
    codec = codec_for(case, "sim", "")
    slos = slos_of(bench.slo)
    per_probe = requests_per_probe(slos, bench.num_prompts)
    with dataset_refusals(case):
        prompts = virtual_prompts(bench.model_copy(update={"num_prompts": per_probe}), codec,
                                  context_of(case))
    assert not isinstance(prompts, Conversations), "conversations are skipped (skip_reason)"
    probes = VirtualProbes(bench, engine, codec, prompts)
    found = search(probes, slos, bench.search, bench.num_prompts, seed=bench.seed,
                   recheck=probes.recheck, steady_engine=True)
    keep_probe_at_capacity(outcome, found, probes)
    outcome.capacity = found.as_record()
    for probe in outcome.capacity["probes"]:
        probe["remeasured"] = []
    if outcome.capacity["recheck"] is not None:
        outcome.capacity["recheck"]["remeasured"] = []
    outcome.prefix_cache = FRESH_ENGINE
    outcome.results.update(found.results())
    outcome.threshold_results = check_thresholds(case, outcome.results)
    outcome.finished_at = time.time()
    return outcome
