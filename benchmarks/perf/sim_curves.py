"""The simulated engine's shape where a benchmark can see vLLM's: five curves, printed.

    python benchmarks/perf/sim_curves.py [--model Qwen/Qwen3-8B] [--device H100-SXM]
    python benchmarks/perf/sim_curves.py --concurrency   # curve 0 alone, for four configurations

Each point is a whole benchmark run through the simulator's own scheduler and engine model on
a virtual clock (`pytest_profllm/sim/virtual.py`: no sleeping, seconds of CPU in all):

0. concurrency 1 to 1,024 (256 in / 128 out, 4 x concurrency requests): output throughput rises
   and flattens at the KV-cache or compute bound, TPOT rises slowly with the batch, TTFT jumps
   past saturation; beside it the roofline bound on the profile's own figures
   (`virtual.roofline_throughput`). For an 8B, a 70B at tp 4 and 8, and an MoE model.
1. max_num_seqs: output throughput rises until the KV cache is full, then preemptions rise.
2. request rate: median TTFT stays flat, then climbs steeply past the saturation rate.
3. prefix caching on a prefix_repetition workload: TTFT with and without it.
4. chunked prefill: long prompts arriving among running decodes; the decodes' worst
   inter-token gap with chunks of max_num_batched_tokens, and without chunking.
"""

from __future__ import annotations

import argparse
import math
import random

from pytest_profllm.sim.cost import EngineModel
from pytest_profllm.sim.hardware import device_profile
from pytest_profllm.sim.models import resolve_model
from pytest_profllm.sim.virtual import Request, ServerSettings, roofline_throughput, simulate

CONCURRENCY_CONFIGS = (
    ("Qwen/Qwen3-8B", "H100-SXM", 1),
    ("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", 4),
    ("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", 8),
    ("Qwen/Qwen3-30B-A3B", "H100-SXM", 1),
)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def concurrency_curve(engine: EngineModel) -> None:
    print(
        f"\n0. concurrency: {engine.model.name} on {engine.device.name} x "
        f"{engine.tensor_parallel_size} (256 in / 128 out)"
    )
    print(
        f"{'concurrency':>11} {'out tok/s':>10} {'roofline':>9} {'of bound':>9} "
        f"{'median TPOT ms':>15} {'median TTFT ms':>15} {'preemptions':>12}"
    )
    for concurrency in (1, 4, 16, 64, 128, 256, 512, 1024):
        count = max(4 * concurrency, 32)
        requests = [Request(256, 128) for _ in range(count)]
        s = simulate(engine, requests, max_concurrency=concurrency).summary()
        bound = roofline_throughput(engine, concurrency, 256, 128)
        print(
            f"{concurrency:11d} {s['output_throughput']:10.0f} {bound:9.0f} "
            f"{s['output_throughput'] / bound:9.2f} {s['median_tpot_ms']:15.1f} "
            f"{s['median_ttft_ms']:15.1f} {s['num_preemptions']:12.0f}"
        )


def max_num_seqs_curve(engine: EngineModel) -> None:
    # A cache of 40k tokens (num_gpu_blocks) so that saturation shows inside the sweep.
    requests = [Request(1024, 512) for _ in range(400)]
    print("\n1. max_num_seqs (400 x 1024/512 at rate inf, KV cache 40,000 tokens)")
    print(
        f"{'max_num_seqs':>12} {'out tok/s':>10} {'median TPOT ms':>15} {'preemptions':>12} "
        f"{'peak KV':>8}"
    )
    for seqs in (4, 8, 16, 24, 32, 48, 64, 128):
        settings = ServerSettings(max_num_seqs=seqs, num_gpu_blocks=2500)
        s = simulate(engine, requests, settings).summary()
        print(
            f"{seqs:12d} {s['output_throughput']:10.0f} {s['median_tpot_ms']:15.1f} "
            f"{s['num_preemptions']:12.0f} {s['peak_kv_cache_usage']:8.2f}"
        )


def request_rate_curve(engine: EngineModel) -> None:
    rng = random.Random(1)
    requests = [Request(rng.randint(256, 768), rng.randint(64, 256)) for _ in range(600)]
    print("\n2. request rate (600 requests, 256-768 in / 64-256 out, Poisson arrivals)")
    print(f"{'rate req/s':>10} {'out tok/s':>10} {'median TTFT ms':>15} {'p99 TTFT ms':>12}")
    for rate in (2, 8, 16, 32, 48, 64, 96, 128):
        outcome = simulate(engine, requests, ServerSettings(max_num_seqs=64), request_rate=rate)
        s = outcome.summary()
        print(
            f"{rate:10d} {s['output_throughput']:10.0f} {s['median_ttft_ms']:15.1f} "
            f"{_quantile(outcome.ttft, 0.99) * 1000:12.1f}"
        )


def prefix_caching_curve(engine: EngineModel) -> None:
    rng = random.Random(2)
    prefixes = [tuple(rng.randrange(8192) for _ in range(2048)) for _ in range(4)]
    requests = []
    for index in range(200):
        suffix = tuple(rng.randrange(8192) for _ in range(128))
        ids = prefixes[index % 4] + suffix
        requests.append(Request(len(ids), 64, ids))
    print(
        "\n3. prefix caching (prefix_repetition: 4 prefixes of 2048 tokens, suffix 128, "
        "200 requests at 8 req/s)"
    )
    print(f"{'prefix caching':>14} {'median TTFT ms':>15} {'hit rate':>9} {'out tok/s':>10}")
    for caching in (False, True):
        settings = ServerSettings(enable_prefix_caching=caching)
        s = simulate(engine, requests, settings, request_rate=8).summary()
        print(
            f"{'on' if caching else 'off':>14} {s['median_ttft_ms']:15.1f} "
            f"{s['prefix_cache_hit_rate']:9.2f} {s['output_throughput']:10.0f}"
        )


def chunked_prefill_curve(engine: EngineModel) -> None:
    # 32 chats decoding (short prompts, long answers), and 8 prompts of 16k tokens arriving.
    decoders = [Request(64, 1500) for _ in range(32)]
    long_prompts = [Request(16_000, 16) for _ in range(8)]
    print(
        "\n4. chunked prefill (40 requests at 16 req/s: 32 chats of 64 in / 1500 out, then 8 "
        "prompts of 16k tokens)"
    )
    print(
        f"{'chunk (max_num_batched_tokens)':>30} {'p99 ITL ms':>11} {'max ITL ms':>11} "
        f"{'long TTFT ms':>13}"
    )
    for chunk in (512, 2048, 8192, None):
        settings = ServerSettings(
            max_num_batched_tokens=chunk or 2048, enable_chunked_prefill=chunk is not None
        )
        decode_run = simulate(engine, decoders + long_prompts, settings, request_rate=16, seed=3)
        ttft_long = sorted(decode_run.ttft)[-8:]  # the long prompts wait longest for a token
        label = str(chunk) if chunk else "off (whole prompt)"
        print(
            f"{label:>30} {_quantile(decode_run.itl, 0.99) * 1000:11.1f} "
            f"{max(decode_run.itl) * 1000:11.1f} {sum(ttft_long) / 8 * 1000:13.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen/Qwen3-8B")
    parser.add_argument("--device", default="H100-SXM")
    parser.add_argument("--concurrency", action="store_true", help="curve 0 alone")
    args = parser.parse_args()
    for model, device, tp in CONCURRENCY_CONFIGS:
        concurrency_curve(EngineModel(resolve_model(model), device_profile(device), tp))
    if args.concurrency:
        return
    engine = EngineModel(resolve_model(args.model), device_profile(args.device))
    print(f"{args.model} on {engine.device.name}, engine model of pytest_profllm.sim")
    max_num_seqs_curve(engine)
    request_rate_curve(engine)
    prefix_caching_curve(engine)
    chunked_prefill_curve(engine)


if __name__ == "__main__":
    main()
