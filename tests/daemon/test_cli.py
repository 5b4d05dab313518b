"""kvpushctl against a live daemon pair (the demo as a user runs it: tests/lab/test_demo_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpushd_client.types import Expect
from support import attach_pair


def test_kvpushctl_status(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    _pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("pending-one", (1, 2, 3), p.peer_address, "prefill", 1))
    out = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", d.sock, "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["node_id"] == "dnode"
    assert [w["engine_id"] for w in st["workers"]] == ["decode"]
    assert st["workers"][0]["role"] == "ROLE_CONSUMER"
    (t,) = st["transfers"]
    assert t["transfer_id"] == "pending-one" and t["side"] == "recv" and t["num_blocks"] == 3
    assert "WRITE notification" in t["waiting_for"] or "accept" in t["waiting_for"]
    table = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", d.sock, "status"],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "pending-one" in table.stdout and "transfers in flight" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", "/nonexistent.sock", "status"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "cannot reach kvpushd" in bad.stderr
