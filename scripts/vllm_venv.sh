#!/usr/bin/env bash
# Build a CPU vLLM venv the connector's scheduler tests run in (tests/vllm/).
#
#   bash scripts/vllm_venv.sh [VENV] [VERSION]    # default .venv-vllm, 0.33.0
#   bash scripts/vllm_venv.sh .venv-vllm034 0.34.0
#
# Idempotent: a venv that already has that vllm version is kept; the kvpushd client (editable), pytest and
# pytest-timeout are (re)installed into it either way. vLLM goes in with --no-deps plus the runtime
# packages its scheduler and CPU worker code import (pip's "dependency conflicts" warning about
# anthropic, flashinfer, numba, ... is expected). 0.33.0 and 0.34.0 both pin torch 2.14.0 and take the
# same list here; their scheduler imports on the CPU torch 2.13.0 (vllm._C is missing, which the
# scheduler does not need). torch first: 2.13.0 resolves to the CPU wheel this
# machine keeps in PIP_FIND_LINKS, and nothing after it may pull a CUDA build.
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=${2:-0.33.0}

has_vllm() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm") == "$VLLM_VERSION" else 1)
EOF
}

if has_vllm; then
    echo "vllm_venv: $VENV already has vllm $VLLM_VERSION"
else
    echo "vllm_venv: building $VENV (a few minutes: about 1 GB of wheels)"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install -q)
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" torch==2.13.0
    "${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
    "${PIP[@]}" psutil msgspec cachetools pyzmq cbor2 pybase64 'transformers>=5.16.1,<5.21.0' \
        regex numpy pydantic pyyaml cloudpickle blake3 py-cpuinfo requests tqdm safetensors einops aiohttp \
        openai openai-harmony pillow uvloop prometheus_client 'fastapi>=0.133.0,<0.137.0' partial_json_parser
    "${PIP[@]}" 'apache-tvm-ffi==0.1.11'
    "${PIP[@]}" --no-deps 'xgrammar==0.2.8' 'llguidance>=1.7.0,<1.8.0'
    has_vllm || { echo "vllm_venv: vllm $VLLM_VERSION did not install into $VENV" >&2; exit 1; }
fi

# opentelemetry: tests/vllm/test_vllm_stats.py's OTLP receiver and engine side (the connector needs none)
"$VENV/bin/python" -m pip install -q grpcio protobuf pytest pytest-timeout opentelemetry-sdk \
    opentelemetry-exporter-otlp-proto-grpc opentelemetry-proto -e "$ROOT/client"
"$VENV/bin/python" -c "import kvpushd_client, pytest_timeout" && echo "vllm_venv: $VENV ready"
