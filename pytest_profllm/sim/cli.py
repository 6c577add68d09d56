"""The simulated engine's command line: `vllm serve`'s arguments parsed as vLLM parses them, the
engine model they choose, and the server started on them (`python -m pytest_profllm.sim`).

It reads the `vllm serve` arguments that shape serving (batch limits, context length, parallel
sizes, memory utilisation, served names, API key) and accepts every other engine argument
without effect, listing them at start-up, as a stand-in must: a suite runs unchanged on vLLM
and on the simulator. Its own flags: `--sim-device NAME` (the GPU it models, `sim/hardware.py`),
`--sim-profile PATH` (a profile file in its place, as `profllm calibrate` writes,
`sim/profile_file.py`), `--sim-fault SPEC` (faults on demand, `sim/faults.py`) and
`--sim-spec-acceptance` (how often `--speculative-config`'s draft tokens are accepted,
`sim/speculation.py`).

It serves below the client's priority: its niceness goes up by 10 (`PROFLLM_SIM_NICE=N`: by N,
0 leaves it), as the GPU it stands for would take none of the load generator's CPU. With
`VLLM_SERVER_DEV_MODE=1` it serves vLLM's development routes (`sim/instruments.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from pytest_profllm.engine.human_int import human_int
from pytest_profllm.engine.secrets import redact_argv
from pytest_profllm.sim.batching import Scheduler
from pytest_profllm.sim.config import SimSetup, build_setup
from pytest_profllm.sim.faults import (
    FAULTS_ENV,
    DriftingCost,
    Faults,
    FaultSpecError,
    parse_faults,
)
from pytest_profllm.sim.hardware import DEFAULT_DEVICE, GIB, DeviceProfile, profiles
from pytest_profllm.sim.lora import (
    VLLM_DEFAULT_MAX_LORA_RANK,
    VLLM_DEFAULT_MAX_LORAS,
    LoraCost,
    LoraSlots,
    adapter_paths,
)
from pytest_profllm.sim.model_files import MODEL_DIR, SPECIAL_TOKENS
from pytest_profllm.sim.profile_file import load_profile_file
from pytest_profllm.sim.profiler_config import (
    ProfilerConfigError,
    ProfilerSettings,
    dev_mode_from_env,
)
from pytest_profllm.sim.spans import DEFAULT_DELAY_S, SpanExporter
from pytest_profllm.sim.speculation import (
    ACCEPTANCE_ENV,
    Speculation,
    SpeculationError,
    speculation_from,
)
from pytest_profllm.sim.stats import EngineStats

if TYPE_CHECKING:
    from pytest_profllm.sim.batching import Scheduler

log = logging.getLogger("profllm.sim")
NICE_ENV = "PROFLLM_SIM_NICE"
DEFAULT_NICE = 10
SPAN_DELAY_ENV = "OTEL_BSP_SCHEDULE_DELAY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profllm sim",
        description="Simulated vLLM engine: vLLM's OpenAI-compatible API over a step cost model.",
        epilog="Run by hand, it is not quite the server the plugin starts. It serves vLLM's "
        "development routes (POST /reset_prefix_cache, which emptying the prefix cache before "
        "a load needs, as profllm bench does) only with VLLM_SERVER_DEV_MODE=1, as vLLM does; "
        "the plugin sets it. And it serves below the client's priority, its niceness raised "
        "by 10 (PROFLLM_SIM_NICE=N: by N), where the plugin sets 0 and gives it a core of its "
        "own. As the plugin runs it: VLLM_SERVER_DEV_MODE=1 PROFLLM_SIM_NICE=0 profllm sim "
        "MODEL ...",
        # vLLM's options it ignores must not be taken for abbreviations of those it reads.
        allow_abbrev=False,
    )
    parser.add_argument("model_tag", nargs="?", help="model name or folder, as for `vllm serve`")
    parser.add_argument("--model", help="same as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer folder (default: the model folder if it has "
        "one, else the simulator's bundled tokenizer)",
    )
    parser.add_argument(
        "--max-num-seqs", type=_positive, help="default: vLLM's for the device (1024 or 256)"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=_positive, help="default: vLLM's for the device"
    )
    parser.add_argument("--max-model-len", type=_model_len)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--api-server-count", "-asc", type=_positive, default=1)
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=_positive, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=_positive, default=1)
    # vLLM takes several keys; all are read (so none is logged as an ignored argument), and
    # the first is required, the one profllm's client sends.
    parser.add_argument("--api-key", nargs="+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=_positive)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"),
        default="auto",
        help="as vLLM's: an FP8 cache holds twice the tokens and reads half the bytes",
    )
    parser.add_argument(
        "--quantization", "-q",
        help="as vLLM's: fp8 quantizes a 16-bit checkpoint's weights to FP8 (half the bytes "
        "to read, FP8 matmuls where the device has them); other methods need a checkpoint "
        "quantized so, whose config.json says it",
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=_positive,
        help="KV-cache blocks (default: what the device's memory holds after the weights)",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--runner",
        choices=["auto", "draft", "generate", "pooling"],
        default="auto",
        help="as vLLM's: pooling serves /v1/embeddings and rerank instead of completions and "
        "chat (auto: generate)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="as vLLM's: usage.prompt_tokens_details.cached_tokens says how many prompt "
        "tokens the prefix cache held",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="as vLLM's: GET /tokenizer_info answers the tokenizer's configuration",
    )
    parser.add_argument(
        "--profiler-config",
        help='JSON, as vLLM\'s: {"profiler": "torch", "torch_profiler_dir": DIR} enables '
        "/start_profile and /stop_profile, which write Chrome traces of the scheduler steps",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        help="as vLLM's: each finished request's llm_request span goes to this OTLP/HTTP "
        "endpoint (protobuf), in batches every OTEL_BSP_SCHEDULE_DELAY ms (default 200)",
    )
    parser.add_argument(
        "--speculative-config",
        help="JSON, as vLLM's: num_speculative_tokens draft tokens per decoding sequence per "
        "step, accepted as --sim-spec-acceptance says (sim/speculation.py)",
    )
    parser.add_argument(
        "--sim-spec-acceptance",
        metavar="P1,P2,...",
        help="with --speculative-config: the chance each position's draft token is accepted, "
        f"the ones before it accepted; the last repeats (also {ACCEPTANCE_ENV}; default: by "
        "method, ngram 0.6,0.5,0.4)",
    )
    parser.add_argument(
        "--sim-device",
        default=DEFAULT_DEVICE,
        help=f"the GPU the simulator models (default: {DEFAULT_DEVICE}; known: "
        f"{', '.join(sorted(profiles()))})",
    )
    # LoRA adapters (sim/lora.py): served by name, in max_loras slots, padded to max_lora_rank.
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--lora-modules", nargs="+")
    parser.add_argument("--max-loras", type=_positive, default=VLLM_DEFAULT_MAX_LORAS)
    parser.add_argument("--max-lora-rank", type=_positive, default=VLLM_DEFAULT_MAX_LORA_RANK)
    parser.add_argument(
        "--sim-profile",
        type=Path,
        metavar="PATH",
        help="a device profile file (a shipped profile's TOML shape, as profllm calibrate "
        "writes) that replaces --sim-device's (default: none)",
    )
    parser.add_argument(
        "--sim-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"fail on purpose (repeatable; also {FAULTS_ENV}): exit_at_start, slow_start=S, "
        "never_healthy, die_after=N, error_rate=F, stall_request=N, close_request=N, "
        "orphan_child, drift=F; SPEC@ARG=VALUE applies only where the argv has that argument value",
    )
    return parser


def _positive(text: str) -> int:
    # vLLM takes sizes like 4k (4000) and 2K (2048) for its token counts; so does the simulator.
    value = human_int(text.removeprefix("+"))
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _model_len(text: str) -> int | None:
    # auto (or -1): the longest the model allows, as when the flag is absent.
    if text.strip().lower() in ("auto", "-1"):
        return None
    return _positive(text)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [profllm sim] %(message)s"
    )
    args, ignored = build_parser().parse_known_args(argv)
    model = args.model or args.model_tag
    if not model:
        build_parser().error("a model is required: profllm sim MODEL [options]")
    if ignored:
        shown = " ".join(redact_argv(ignored))  # the log lands in --profllm-out/logs
        log.info("engine arguments without effect on the simulator: %s", shown)
    try:
        profiler = ProfilerSettings.from_json(args.profiler_config)
    except ProfilerConfigError as error:
        # As vLLM's parser says it (exit code 2), so the start failure names a bad argument.
        build_parser().error(f"argument --profiler-config: {error}")
    try:
        adapter_paths(args.lora_modules)
    except ValueError as error:  # as vLLM's parser says it (exit code 2)
        build_parser().error(str(error))
    try:
        speculation_of(args)
    except SpeculationError as error:
        build_parser().error(f"argument --speculative-config: {error}")
    argv_seen = list(sys.argv[1:] if argv is None else argv)
    try:
        faults = parse_faults([os.environ.get(FAULTS_ENV, ""), *args.sim_fault], argv_seen)
    except FaultSpecError as error:
        build_parser().error(f"argument --sim-fault: {error}")
    model_dir = model_dir_of(model, args.tokenizer)
    if model_dir is None:
        log.error("model path %s does not exist", model)
        return 1
    try:
        setup = setup_for(args, model)
        dev_mode = dev_mode_from_env()
        nice = nice_from_env()
    # An unknown model or device, no memory left for the KV cache, or an environment variable
    # that is no integer (vLLM does not start on an unreadable VLLM_SERVER_DEV_MODE either).
    except ValueError as error:
        log.error("%s", error)
        return 1
    api_key = args.api_key[0] if args.api_key else os.environ.get("VLLM_API_KEY")
    log.info(
        "CUDA_VISIBLE_DEVICES=%s VLLM_PORT=%s",
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        os.environ.get("VLLM_PORT", ""),
    )
    _log_setup(setup)
    if faults:
        log.warning("faults on demand: %s", faults)
        if faults.exit_at_start:
            return _exit_at_start(setup)
        if faults.orphan_child:
            _leave_orphan()
    lower_priority(nice)
    asyncio.run(_serve(args, model, model_dir, api_key, profiler, setup, faults, dev_mode))
    return 0


def span_delay_from_env() -> float:
    """The span batches' interval in seconds: OTEL_BSP_SCHEDULE_DELAY (ms), as vLLM's SDK
    reads it, else the simulator's 0.2 s; one that is no positive number is the default."""
    text = os.environ.get(SPAN_DELAY_ENV, "").strip()
    try:
        delay_ms = float(text)
    except ValueError:
        return DEFAULT_DELAY_S
    return delay_ms / 1000 if 0 < delay_ms <= 60_000 else DEFAULT_DELAY_S


def nice_from_env() -> int:
    """The niceness increment of `PROFLLM_SIM_NICE` (default 10); ValueError if not an integer."""
    text = os.environ.get(NICE_ENV, "").strip()
    if not text:
        return DEFAULT_NICE
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{NICE_ENV}={text!r}: expected an integer (0: leave it)") from None


def lower_priority(increment: int) -> None:
    """Raise this process's niceness by `increment`: the simulator stands in for a GPU, which
    takes none of the load generator's CPU, so on a shared host the client goes first."""
    if not increment:
        return
    try:
        niceness = os.nice(increment)
    except OSError as error:  # a negative increment without the privilege: run as it is
        log.info("niceness left as it is (%s=%d): %s", NICE_ENV, increment, error)
        return
    log.info("niceness %d (%s=%d)", niceness, NICE_ENV, increment)


def _log_setup(setup: SimSetup) -> None:
    engine = setup.engine
    model, device = engine.model, engine.device
    gpus = engine.tensor_parallel_size * engine.pipeline_parallel_size
    log.info(
        "simulating %s (%.2fB parameters, %s, facts from %s) on %d x %s (%s)",
        model.name,
        model.params / 1e9,
        "fp8" if model.quantization == "fp8" else model.dtype,
        model.source,
        gpus,
        device.name,
        device.source,
    )
    log.info(
        "Model loading took %.2f GiB per GPU; GPU KV cache size: %d tokens (%d blocks of %d); "
        "max_num_seqs=%d, max_num_batched_tokens=%d",
        model.weight_bytes / gpus / GIB,
        setup.num_gpu_blocks * setup.block_size,
        setup.num_gpu_blocks,
        setup.block_size,
        setup.max_num_seqs,
        setup.max_num_batched_tokens,
    )


def _exit_at_start(setup: SimSetup) -> int:
    # What vLLM 0.33.0 prints when its engine core fails to start (here: out of memory).
    device = setup.engine.device
    log.error(
        "EngineCore failed to start.\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of %.2f GiB of which 1.12 GiB is free. (simulated fault exit_at_start)",
        device.memory_gib,
    )
    log.error(
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {'EngineCore_DP0': 1}"
    )
    return 1


def _leave_orphan() -> None:
    # Its own session: out of the server's process group, as a leaked EngineCore can be.
    # Bounded (10 minutes) so that even a harness that misses it does not keep it forever.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)  # profllm sim orphan_child"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log.warning("orphan_child: left pid %d in its own session", child.pid)


def setup_for(
    args: argparse.Namespace, model: str, profile: DeviceProfile | None = None
) -> SimSetup:
    """The engine model for parsed engine arguments, on `profile` where one is given (a
    profile file already read). Raises ValueError (unknown model or device, a bad profile
    file, no memory left for the KV cache) with a one-line message."""
    device: DeviceProfile | str | None = profile
    if device is None:
        device = load_profile_file(args.sim_profile) if args.sim_profile else args.sim_device
    return build_setup(
        model,
        device,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_model_len=args.max_model_len,
        api_server_count=args.api_server_count,
        enable_chunked_prefill=args.enable_chunked_prefill,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )


def speculation_of(args: argparse.Namespace) -> Speculation | None:
    """The speculative decoding parsed engine arguments ask for (None: none); raises
    SpeculationError with a one-line message."""
    return speculation_from(
        getattr(args, "speculative_config", None),
        getattr(args, "sim_spec_acceptance", None),
        seed=getattr(args, "seed", 0) or 0,
    )


def make_scheduler(args: argparse.Namespace, setup: SimSetup) -> Scheduler:
    """The simulated engine for parsed engine arguments: the server's, and the offline
    benchmarks' (`pytest_profllm.sim.offline`)."""

    return Scheduler(
        lora=lora_slots(args, setup),
        cost=setup.engine,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        block_size=setup.block_size,
        num_gpu_blocks=setup.num_gpu_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        stats=EngineStats(max_model_len=setup.max_model_len),
        speculation=speculation_of(args),
    )


def lora_slots(args: argparse.Namespace, setup: SimSetup) -> LoraSlots | None:
    """The adapters and their slots, where the engine serves adapters (--enable-lora)."""
    if not args.enable_lora:
        return None
    return LoraSlots(
        adapters=adapter_paths(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        cost=LoraCost.of(setup.engine, args.max_lora_rank),
    )


def _tokenizer_info(model_dir: Path) -> dict[str, object]:
    """What vLLM's /tokenizer_info answers: the tokenizer's configuration file."""
    config = model_dir / "tokenizer_config.json"
    info: dict[str, object] = json.loads(config.read_text()) if config.is_file() else {}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    return info


def model_dir_of(model: str, tokenizer: str | None) -> Path | None:
    for candidate in (tokenizer, model):
        if candidate and Path(candidate, "tokenizer.json").is_file():
            return Path(candidate)
    # A local path that is missing is an error, as in vLLM; a hub name gets the bundled folder.
    if model.startswith(("/", "./", "../", "~")):
        return None
    return MODEL_DIR


async def _serve(
    args: argparse.Namespace,
    model: str,
    model_dir: Path,
    api_key: str | None,
    profiler: ProfilerSettings,
    setup: SimSetup,
    faults: Faults,
    dev_mode: bool = False,
) -> None:
    # Deferred: aiohttp (about 0.1 s) only when the simulator serves; `profllm plan`, the
    # virtual clock and the offline benchmarks import this module for its parser.
    from aiohttp import web

    from pytest_profllm.sim.app import SimState, build_app

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    max_model_len = setup.max_model_len
    vocab = tokenizer.get_vocab()
    words = [
        w for w, _ in sorted(vocab.items(), key=lambda item: item[1]) if w not in SPECIAL_TOKENS
    ]
    state = SimState(
        served_names=args.served_model_name or [model],
        root=model,
        max_model_len=max_model_len,
        tokenizer=tokenizer,
        words=words,
        api_key=api_key,
        request_delay_s=setup.engine.request_seconds(),
        faults=faults,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        vision=setup.engine.model.vision,
        audio=setup.engine.model.audio,
        runner="pooling" if args.runner == "pooling" else "generate",
        hidden_size=setup.engine.model.hidden_size,
        dev_mode=dev_mode,
        tokenizer_info=_tokenizer_info(model_dir) if args.enable_tokenizer_info_endpoint else None,
    )
    scheduler = make_scheduler(args, setup)
    if scheduler.lora is not None:
        state.adapters = dict(scheduler.lora.adapters)
    if args.otlp_traces_endpoint:
        state.spans = SpanExporter(
            args.otlp_traces_endpoint, scheduler.clock, span_delay_from_env()
        )
    if faults.drift:
        scheduler.cost = DriftingCost(scheduler.cost, faults.drift, lambda: state.requests_seen)
    if profiler.profiler:
        log.warning(
            "Profiler with mode '%s' is enabled in the API server (traces in %s)",
            profiler.profiler,
            profiler.torch_profiler_dir,
        )
    app = build_app(state, scheduler, profiler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        if faults.slow_start:
            log.info("slow_start: listening in %.1f s", faults.slow_start)
            await asyncio.sleep(faults.slow_start)
        await site.start()
        # The pid says which process bound the port (a test proves whose server was measured).
        log.info(
            "Starting vLLM API server (simulated) on http://%s:%d (pid %d)",
            args.host,
            args.port,
            os.getpid(),
        )
        log.info(
            "serving %s as %s, max_num_seqs=%d, max_model_len=%d, tp=%d",
            model_dir,
            state.served_names,
            setup.max_num_seqs,
            max_model_len,
            args.tensor_parallel_size,
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()
        if state.spans is not None:
            state.spans.close()


if __name__ == "__main__":
    sys.exit(main())
