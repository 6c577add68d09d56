"""Scripts that run inside vLLM's own Python (another interpreter, by file path): they import
nothing of pytest_profllm, only the standard library and vLLM."""

from pathlib import Path

HERE = Path(__file__).parent
PROBE_SCRIPT = HERE / "probe.py"  # what a Python's vLLM is (engine/install.py)
DUMP_ARGS_SCRIPT = HERE / "dump_args.py"  # every `vllm serve` option (engine/registry.py)
BENCH_SCRIPT = HERE / "bench.py"  # `vllm bench throughput|latency` (offline/commands.py)
