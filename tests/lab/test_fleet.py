"""``kvpushd bench fleet``: 2 prefill x 2 decode nodes, each daemon in a network namespace of its own, one
decode node's daemon SIGKILLed and restarted under load. Every request ends, nothing is held, the bytes
that arrived are the bytes sent. Skipped, saying why, where namespaces cannot be made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from kvpushd_lab.netns import available

pytestmark = pytest.mark.timeout(240)


def test_fleet_2x2_with_a_daemon_killed_mid_load() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"kvpushd bench fleet needs network namespaces: {why}")
    r = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "fleet", "--json", "--prefill-nodes", "2",
                        "--decode-nodes", "2", "--faults", "kill-decode", "--phase-s", "3", "--rate", "15",
                        "--recovery-bound-s", "60"], capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["suite"] == "fleet" and out["nodes"] == {"prefill": 2, "decode": 2}
    assert out["tp"] == {"p0": 2, "p1": 1, "d0": 1, "d1": 2}  # TP 2 -> 1, 1 -> 2, 2 -> 2 and 1 -> 1 pairs
    assert out["never_ended"] == 0, out["never_ended_examples"]
    assert out["blocks_held_after"] == 0 and out["transfers_pending_after"] == 0, out["held_after"]
    assert out["finished"] > 0 and out["finished"] + out["failed"] == out["requests"]
    assert out["mismatched_bytes"] == 0 and out["bytes_verified"] > 0
    assert out["unexpected_completions"] == 0
    (fault,) = out["faults"]
    assert fault["fault"] == "sigkill+restart" and fault["node"].startswith("d")
    assert fault["recovery_s"] is not None  # every pair carried a transfer again after the restart
    assert out["restarts"] == {fault["node"]: 1}
    assert out["storm_recovery_s"] is None and out["handshakes_in_flight_peak"] is None
    assert set(out["transfer_modes"]) == {"push", "pull"}
    # the KV crossed each decode namespace's veth
    assert all(out["veth_bytes"][d]["rx"] > 0 for d in ("d0", "d1"))


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not found")
def test_fleet_without_namespaces_says_why() -> None:
    """Without the capabilities to make namespaces (every capability dropped) it exits 1 with a message."""
    r = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable, "-m", "kvpushd",
                        "bench", "fleet", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "needs network namespaces" in r.stderr and r.stdout == ""
