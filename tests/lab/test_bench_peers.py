"""``kvpushd bench peers`` at a small size: one JSON object with the figures, and every peer connected."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _logs(workdir: Path) -> str:
    """The ends of the daemon's and the load generators' logs, for a failure's message."""
    parts = []
    for f in sorted(workdir.glob("*.log")):
        parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
    return "\n".join(parts)


def test_bench_peers_small(tmp_path: Path) -> None:
    # --timeout bounds the peers' connecting (they retry until it), so a refusal ends the run with its
    # errors well within this test's own limit instead of retrying past it
    cmd = [sys.executable, "-m", "kvpushd", "bench", "peers", "--peers", "200", "--generators", "2",
           "--rounds", "1", "--timeout", "60", "--json", "--workdir", str(tmp_path)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"bench peers did not end in 240 s; stderr: {e.stderr!r}\n{_logs(tmp_path)}") from None
    assert r.returncode == 0, r.stderr[-3000:] + _logs(tmp_path)
    out = json.loads(r.stdout)
    assert out["suite"] == "peers" and out["method"]
    for k in ("rss_per_peer_kib", "status_bytes", "status_ms", "cpu_per_heartbeat_round_ms", "connect_all_s"):
        assert isinstance(out[k], int | float) and out[k] >= 0, (k, out[k])
    assert out["status_bytes"] > 0 and out["connect_all_s"] > 0
    assert out["peers"] == out["connected"] == 200, (out["errors"], out["failed_attempts"], _logs(tmp_path))
    assert out["transfers_in_status"] == out["peers_in_status"] == 200  # as the daemon counts them
    assert out["heartbeats_answered"] == 200
    assert out["connections"] == 14  # 100 peers per generator, 15 per connection: 7 each
