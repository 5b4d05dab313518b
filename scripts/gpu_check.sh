#!/usr/bin/env bash
# The GPU check in two halves (docs/gpu.md).
#
#   scripts/gpu_check.sh prepare [--dir .whl]   on a CPU machine with PyPI: gathers the wheels a GPU machine
#       without a package registry lacks into .whl/gpu (ignored), checks the repacked nixl-cu13 moves
#       bytes here, and prints ONE JSON line: bundle_dir, bundle_bytes, tree_bytes, command, carry.
#   scripts/gpu_check.sh run OUTDIR             on the GPU machine (the command above does the install):
#       nvidia-smi summary, `pytest -m gpu`, the GPU ceiling (kvpushd_lab.bench.gpu_ceiling); one JSON line
#       on stdout and in OUTDIR/gpu-check.json, logs beside it (at most 7 files). Without a GPU it says so,
#       runs the CPU-only parts (environment and the GPU tests' collection) and exits 0.
set -u -o pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    shift
    exec "${PYTHON:-python3}" scripts/gpu_bundle.py "$@"
    ;;
run)
    OUTDIR=${2:?usage: scripts/gpu_check.sh run OUTDIR}
    ;;
*)
    echo "usage: scripts/gpu_check.sh prepare [--dir DIR] | run OUTDIR" >&2
    exit 2
    ;;
esac

PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
START=$(date +%s)
# 8 minutes in all: tests at most 4.5, the ceiling at most 2.5, the rest for start-up and the summary.
TESTS_S=${GPU_CHECK_TESTS_S:-270}
CEILING_S=${GPU_CHECK_CEILING_S:-150}

"$PY" scripts/gpu_env.py >"$OUTDIR/env.json" 2>"$OUTDIR/env.log"
ENV_RC=$?
GPU=$("$PY" -c 'import json,sys; print(int(json.load(open(sys.argv[1])).get("gpus", 0) > 0))' "$OUTDIR/env.json" 2>/dev/null || echo 0)

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,clocks.sm \
        --format=csv >"$OUTDIR/nvidia-smi.txt" 2>&1
    nvidia-smi topo -m >>"$OUTDIR/nvidia-smi.txt" 2>&1
fi

if [ "$GPU" != 1 ]; then
    # CPU-only parts: the environment (above) and the GPU tests collect; nothing GPU runs.
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests/daemon >"$OUTDIR/pytest.log" 2>&1
    COLLECT_RC=$?
    MSG="no CUDA GPU visible (torch.cuda.is_available() is false or torch is missing): GPU tests and ceiling skipped"
    echo "gpu_check: $MSG" >&2
    "$PY" scripts/gpu_summary.py "$OUTDIR" --skipped "$MSG" --env-rc "$ENV_RC" --collect-rc "$COLLECT_RC" \
        --elapsed-s $(( $(date +%s) - START ))
    exit 0
fi

timeout -k 10 "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml "$OUTDIR/pytest.xml" \
    tests/daemon >"$OUTDIR/pytest.log" 2>&1
TESTS_RC=$?
timeout -k 10 "$CEILING_S" "$PY" -m kvpushd_lab.bench.gpu_ceiling --json "$OUTDIR/ceiling.json" \
    >"$OUTDIR/ceiling.log" 2>&1
CEILING_RC=$?
"$PY" scripts/gpu_summary.py "$OUTDIR" --env-rc "$ENV_RC" --tests-rc "$TESTS_RC" --ceiling-rc "$CEILING_RC" \
    --elapsed-s $(( $(date +%s) - START ))
