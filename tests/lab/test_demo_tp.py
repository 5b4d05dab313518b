"""``kvpushd demo`` in engine mode, as a user runs it: reference engines, real daemons, TP sizes equal and not.

Each run starts two daemons and two engine processes (most of its time); the requests are few and
short, with a prompt that ends inside a block.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

REQUESTS = 6
PROMPT = 37     # not a multiple of the block size (16): the last of its 3 blocks is partly filled
NEW = 5
PAIRS = [(1, 1), (2, 1), (1, 2)]


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpushd", "demo", *args]


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS, ids=[f"tp{p}-tp{d}" for p, d in PAIRS])
def test_demo_engine_mode(p_tp: int, d_tp: int) -> None:
    r = subprocess.run(_demo("--json", "--requests", str(REQUESTS), "--prompt-tokens", str(PROMPT),
                             "--max-new-tokens", str(NEW), "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
                             "--concurrency", "4"), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["mode"] == "engine" and (out["prefill_tp"], out["decode_tp"]) == (p_tp, d_tp)
    assert out["completed"] == out["requests"] == REQUESTS and out["failed"] == 0
    assert out["tokens_match"] is True and out["tokens_mismatched"] == 0
    assert out["tokens_generated"] == REQUESTS * NEW
    assert out["mismatched_bytes"] == 0 and out["bytes_outside_requests"] == 0 and out["kv_unverified"] == 0
    # every prompt block of every layer's K and V, all 4 KV heads x 16 tokens x 16 dims of float32:
    # written once by prefill (over all its ranks), compared once on decode
    kv_bytes = REQUESTS * 3 * (2 * out["layers"]) * 4 * 16 * 16 * 4
    assert out["bytes_verified"] == out["bytes_moved"] == kv_bytes
    # each decode rank counts one notification per producer rank that writes to it
    assert out["notifications_received"] == REQUESTS * max(p_tp, d_tp)
    assert out["arrival_orders"] == {"decode_first": REQUESTS // 2, "prefill_first": REQUESTS // 2}
    assert out["transfers_left"] == {"prefill": 0, "decode": 0} and out["send_failures"] == 0


SIZES = [(2, 1, 16, 32), (1, 2, 32, 16)]


@pytest.mark.parametrize(("p_tp", "d_tp", "p_bs", "d_bs"), SIZES,
                         ids=[f"tp{p}-tp{d}-bs{a}-bs{b}" for p, d, a, b in SIZES])
def test_demo_different_block_sizes(p_tp: int, d_tp: int, p_bs: int, d_bs: int) -> None:
    """Prefill and decode page the prompt in blocks of different sizes: tokens still match the monolithic run."""
    r = subprocess.run(_demo("--json", "--requests", str(REQUESTS), "--prompt-tokens", str(PROMPT),
                             "--max-new-tokens", str(NEW), "--prefill-tp", str(p_tp), "--decode-tp", str(d_tp),
                             "--prefill-block-size", str(p_bs), "--decode-block-size", str(d_bs),
                             "--concurrency", "4"), capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert (out["prefill_block_size"], out["decode_block_size"]) == (p_bs, d_bs)
    assert out["completed"] == out["requests"] == REQUESTS and out["failed"] == 0
    assert out["tokens_match"] is True and out["tokens_mismatched"] == 0
    assert out["mismatched_bytes"] == 0 and out["bytes_outside_requests"] == 0 and out["kv_unverified"] == 0
    # 37 tokens: 3 blocks of 16 (48 token slots) on one side, 2 of 32 (64) on the other: 48 tokens move
    assert out["tokens_moved_per_request"] == 48
    kv_bytes = REQUESTS * 48 * (2 * out["layers"]) * 4 * 16 * 4
    assert out["bytes_verified"] == out["bytes_moved"] == kv_bytes
    assert out["notifications_received"] == REQUESTS * max(p_tp, d_tp)
    assert out["transfers_left"] == {"prefill": 0, "decode": 0} and out["send_failures"] == 0


def test_demo_bytes_mode_refuses_different_block_sizes() -> None:
    r = subprocess.run(_demo("--mode", "bytes", "--prefill-block-size", "16", "--decode-block-size", "32"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "--mode engine for different block sizes" in r.stderr
    # equal sizes are accepted (here the TP size is refused next, before anything starts)
    r = subprocess.run(_demo("--prefill-block-size", "8", "--decode-block-size", "8", "--prefill-tp", "3"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "block sizes" not in r.stderr and "4 KV heads" in r.stderr
