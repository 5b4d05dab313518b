"""``kvpushd bench peers`` at a small size: one JSON object with the figures, and every peer connected."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_peers_small() -> None:
    r = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "peers", "--peers", "200", "--generators", "2",
                        "--rounds", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["suite"] == "peers" and out["method"]
    for k in ("rss_per_peer_kib", "status_bytes", "status_ms", "cpu_per_heartbeat_round_ms", "connect_all_s"):
        assert isinstance(out[k], int | float) and out[k] >= 0, (k, out[k])
    assert out["status_bytes"] > 0 and out["connect_all_s"] > 0
    assert out["peers"] == out["connected"] == 200, out["errors"]
    assert out["transfers_in_status"] == out["peers_in_status"] == 200  # as the daemon counts them
    assert out["heartbeats_answered"] == 200
    assert out["connections"] == 14  # 100 peers per generator, 15 per connection: 7 each
