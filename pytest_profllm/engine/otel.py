"""Whether a Python can export vLLM's request spans: vLLM imports OpenTelemetry's SDK and both
OTLP trace exporters at once (vllm/tracing/otel.py) and traces nothing where one is missing.
Asked once per interpreter, in that interpreter (a server's Python may be another environment's,
--profllm-vllm-python): `importlib.util.find_spec`, which loads no exporter."""

from __future__ import annotations

import functools
import subprocess

# What vLLM's tracing imports, as packages find_spec can look for.
OTEL_PACKAGES = (
    "opentelemetry.sdk",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.exporter.otlp.proto.grpc",
)
INSTALL_HINT = "pip install opentelemetry-sdk opentelemetry-exporter-otlp"
_CHECK = (
    "import importlib.util, sys\n"
    "def found(name):\n"
    "    try:\n"
    "        return importlib.util.find_spec(name) is not None\n"
    "    except (ImportError, ValueError):\n"
    "        return False\n"
    "print(' '.join(name for name in sys.argv[1:] if not found(name)))\n"
)
_CHECK_TIMEOUT_S = 60


@functools.cache
def otel_missing(python: str) -> str | None:
    """Why `python` cannot export spans, in one line ending in how to fix it; None where it
    can. Cached for the process: a session asks once per interpreter."""
    try:
        done = subprocess.run(
            [python, "-c", _CHECK, *OTEL_PACKAGES],
            capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"vLLM's Python {python} could not be asked for OpenTelemetry: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vLLM's Python {python} could not be asked for OpenTelemetry: {last}"
    missing = done.stdout.split()
    if not missing:
        return None
    return (
        f"vLLM's Python has no opentelemetry-exporter-otlp ({', '.join(missing)} missing in "
        f"{python}): {INSTALL_HINT}"
    )
