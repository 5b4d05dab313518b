"""The demo as a user runs it (`kvpushd demo`, from kvpushd-lab through the kvpushd.commands entry point)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_json() -> None:
    r = subprocess.run([sys.executable, "-m", "kvpushd", "demo", "--mode", "bytes", "--requests", "12",
                        "--prompt-tokens", "256", "--layers", "4", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["mode"] == "bytes"
    assert out["requests"] == out["completed"] == 12
    assert out["failed"] == 0 and out["mismatched_bytes"] == 0
    assert out["bytes_verified"] == out["bytes_moved"] == 12 * 16 * 8 * 8192
    assert set(out["arrival_orders"]) == {"expect_first", "publish_first"}


def test_engine_demo_keeps_engine_logs_beside_the_daemons() -> None:
    """Engine mode: the log folder the demo names holds each engine's output too, and an engine
    that sent its final stats and exited is a clean end of the drain, not a crash."""
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "kvpushd", "demo", "--requests", "4", "--prompt-tokens", "48",
                        "--layers", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["tokens_match"] and out["completed"] == 4
    logs = {p.name for p in Path(out["workdir"]).iterdir()}
    assert {"prefill-engine.log", "decode-engine.log", "prefill-node.log", "decode-node.log"} <= logs, logs
