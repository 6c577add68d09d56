"""`python -m pytest_profllm.sim MODEL [vllm serve arguments]`: run the simulated engine.

It reads the `vllm serve` arguments that shape serving (batch limits, context length, parallel
sizes, served names, API key) and accepts every other engine argument without effect, listing
them at start-up, as a stand-in must: a suite runs unchanged on vLLM and on the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_profllm.engine import redact_argv
from pytest_profllm.engine_args import human_int
from pytest_profllm.sim.instruments import ProfilerConfigError, ProfilerSettings
from pytest_profllm.sim.model_files import MODEL_DIR, SPECIAL_TOKENS
from pytest_profllm.sim.scheduler import BLOCK_SIZE, DEFAULT_GPU_BLOCKS

if TYPE_CHECKING:
    from pytest_profllm.sim.scheduler import Scheduler

log = logging.getLogger("profllm.sim")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="profllm sim",
        description="Simulated vLLM engine: vLLM's OpenAI-compatible API over a step cost model.",
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
    parser.add_argument("--max-num-seqs", type=_positive, default=256)
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    parser.add_argument("--max-model-len", type=_model_len)
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=_positive, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=_positive, default=1)
    # vLLM takes several keys; all are read (so none is logged as an ignored argument), and
    # the first is required, the one profllm's client sends.
    parser.add_argument("--api-key", nargs="+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=_positive, default=BLOCK_SIZE)
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=_positive,
        help=f"KV-cache blocks (default: {DEFAULT_GPU_BLOCKS} per tensor-parallel GPU)",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--profiler-config",
        help='JSON, as vLLM\'s: {"profiler": "torch", "torch_profiler_dir": DIR} enables '
        "/start_profile and /stop_profile, which write Chrome traces of the scheduler steps",
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
    model_dir = model_dir_of(model, args.tokenizer)
    if model_dir is None:
        log.error("model path %s does not exist", model)
        return 1
    api_key = args.api_key[0] if args.api_key else os.environ.get("VLLM_API_KEY")
    log.info(
        "CUDA_VISIBLE_DEVICES=%s VLLM_PORT=%s",
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        os.environ.get("VLLM_PORT", ""),
    )
    asyncio.run(_serve(args, model, model_dir, api_key, profiler))
    return 0


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    """The simulated engine for parsed engine arguments: the server's, and the offline
    benchmarks' (`pytest_profllm.offline.sim`)."""
    from pytest_profllm.sim.scheduler import CostModel, Scheduler

    return Scheduler(
        cost=CostModel(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override
        or DEFAULT_GPU_BLOCKS * args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )


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
) -> None:
    from aiohttp import web
    from tokenizers import Tokenizer

    from pytest_profllm.sim.app import SimState, build_app

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = (
        json.loads((model_dir / "config.json").read_text())
        if (model_dir / "config.json").is_file()
        else {}
    )
    max_model_len = args.max_model_len or int(config.get("max_position_embeddings", 32768))
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
    )
    scheduler = make_scheduler(args)
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
        await site.start()
        log.info("Starting vLLM API server (simulated) on http://%s:%d", args.host, args.port)
        log.info(
            "serving %s as %s, max_num_seqs=%d, max_model_len=%d, tp=%d",
            model_dir,
            state.served_names,
            args.max_num_seqs,
            max_model_len,
            args.tensor_parallel_size,
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
