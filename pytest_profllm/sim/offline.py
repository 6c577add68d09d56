"""`python -m pytest_profllm.sim.offline throughput|latency --model M [engine and benchmark
options] --output-json FILE`: the simulated engine's answer to `vllm bench throughput|latency`.

The engine is the serving simulator's (`sim.__main__.make_scheduler`: its batching limits, KV
cache and cost model), run in real time with no HTTP in between: throughput submits every
prompt at once, as vLLM's `LLM.generate` does, and latency submits one batch per iteration.
It writes the JSON vLLM 0.33.0 writes, with the same keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pytest_profllm.load.dataset import TokenizerCodec, make_prompts
from pytest_profllm.plan.suite import BenchmarkConfig
from pytest_profllm.sim.cli import build_parser as engine_parser
from pytest_profllm.sim.cli import make_scheduler, model_dir_of, setup_for

if TYPE_CHECKING:
    from pytest_profllm.sim.config import SimSetup

log = logging.getLogger("profllm.sim")


def build_parser(kind: str) -> argparse.ArgumentParser:
    parser = engine_parser()
    parser.prog = f"profllm sim bench {kind}"
    parser.add_argument("--output-json", required=True)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--disable-detokenize", action="store_true")
    if kind == "throughput":
        parser.add_argument("--backend", default="vllm", choices=["vllm", "vllm-chat"])
        parser.add_argument(
            "--dataset-name", default="random", choices=["random", "sharegpt", "prefix_repetition"]
        )
        parser.add_argument("--dataset-path")
        parser.add_argument("--input-len", type=int)
        parser.add_argument("--output-len", type=int)
        parser.add_argument("--prefix-len", type=int, default=0)
        parser.add_argument("--random-input-len", type=int, default=1024)
        parser.add_argument("--random-output-len", type=int, default=128)
        parser.add_argument("--random-prefix-len", type=int, default=0)
        parser.add_argument("--random-range-ratio", type=float, default=0.0)
        for name in ("prefix-len", "suffix-len", "num-prefixes", "output-len"):
            parser.add_argument(f"--prefix-repetition-{name}", type=int)
        parser.add_argument("--num-prompts", type=int, default=1000)
        parser.add_argument("--async-engine", action="store_true")
    else:
        parser.add_argument("--batch-size", type=int, default=8)
        parser.add_argument("--input-len", type=int, default=32)
        parser.add_argument("--output-len", type=int, default=128)
        parser.add_argument("--num-iters-warmup", type=int, default=10)
        parser.add_argument("--num-iters", type=int, default=30)
        parser.add_argument("--use-beam-search", action="store_true")
        # As vLLM's latency benchmark: prefix caching off unless asked for.
        parser.set_defaults(enable_prefix_caching=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s [profllm sim] %(message)s"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("throughput", "latency"):
        print("usage: profllm sim bench {throughput,latency} [options]", file=sys.stderr)
        return 2
    kind = argv[0]
    parser = build_parser(kind)
    args, ignored = parser.parse_known_args(argv[1:])
    model = args.model or args.model_tag
    if not model:
        parser.error("--model is required")
    if ignored:
        log.info("engine arguments without effect on the simulator: %s", " ".join(ignored))

    try:
        setup = setup_for(args, model)
    except ValueError as error:  # unknown model or device, no memory left for the KV cache
        log.error("%s", error)
        return 1
    if kind == "throughput":
        result = asyncio.run(_throughput(args, model, setup))
    else:
        result = asyncio.run(_latency(args, model, setup))
    with open(args.output_json, "w") as out:
        json.dump(result, out, indent=4)
    return 0


# (prompt length, output length, prompt token ids) of one request.
_Request = tuple[int, int, list[int] | None]


async def _generate(scheduler: Any, requests: list[_Request], n: int) -> float:
    """Submit every request (`n` sequences each) at once; seconds until the last token."""
    start = time.perf_counter()
    sequences = [
        scheduler.submit(prompt_len, output_len, ids)
        for prompt_len, output_len, ids in requests
        for _ in range(n)
    ]
    for sequence in sequences:
        while await sequence.tokens.get() is not None:
            pass
    return time.perf_counter() - start


async def _with_engine(args: argparse.Namespace, setup: SimSetup, work: Any) -> Any:
    scheduler = make_scheduler(args, setup)
    steps = asyncio.create_task(scheduler.run())
    try:
        return await work(scheduler)
    finally:
        steps.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await steps


async def _throughput(
    args: argparse.Namespace, model: str, setup: SimSetup
) -> dict[str, Any]:
    requests = _dataset(args, model)
    elapsed = await _with_engine(
        args, setup, lambda scheduler: _generate(scheduler, requests, args.n)
    )
    total_prompt = sum(prompt_len for prompt_len, _, _ in requests)
    total_output = sum(output_len * args.n for _, output_len, _ in requests)
    total = total_prompt + total_output
    print(
        f"Throughput: {len(requests) / elapsed:.2f} requests/s, "
        f"{total / elapsed:.2f} total tokens/s, {total_output / elapsed:.2f} output tokens/s"
    )
    return {
        "model_id": model,
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
    }


def _dataset(args: argparse.Namespace, model: str) -> list[_Request]:
    """The requests vLLM would sample, through our own dataset code (exact token lengths)."""

    folder = model_dir_of(model, args.tokenizer)
    if folder is None:
        raise SystemExit(f"model path {model} does not exist")
    codec = TokenizerCodec.load(str(folder))
    output_len = args.output_len
    fields: dict[str, Any] = {
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_prefix_len": args.random_prefix_len,
        "random_range_ratio": args.random_range_ratio,
        "sharegpt_output_len": output_len,
    }
    if args.dataset_name == "prefix_repetition":
        for name in ("prefix_len", "suffix_len", "num_prefixes", "output_len"):
            fields[f"prefix_repetition_{name}"] = getattr(args, f"prefix_repetition_{name}")
    prompts = make_prompts(BenchmarkConfig.model_validate(fields), codec)
    return [(p.prompt_len, p.output_len, codec.encode(p.prompt)) for p in prompts]


async def _latency(
    args: argparse.Namespace, model: str, setup: SimSetup
) -> dict[str, Any]:

    rng = random.Random(args.seed)
    batch: list[_Request] = [
        (args.input_len, args.output_len, [rng.randrange(10000) for _ in range(args.input_len)])
        for _ in range(args.batch_size)
    ]
    width = args.n  # beam search keeps `n` beams per prompt, as parallel sampling does

    async def iterations(scheduler: Any) -> list[float]:
        for _ in range(args.num_iters_warmup):
            await _generate(scheduler, batch, width)
        return [await _generate(scheduler, batch, width) for _ in range(args.num_iters)]

    latencies = np.array(await _with_engine(args, setup, iterations))
    percentages = [10, 25, 50, 75, 90, 99]
    percentiles = np.percentile(latencies, percentages)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    return {
        "model_id": model,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(percentages, percentiles.tolist(), strict=True)),
    }


if __name__ == "__main__":
    sys.exit(main())
