"""``kvpushd demo --hosts netns``: prefill daemon + engine and decode daemon + engine in two network
namespaces joined by a veth pair, UCX over TCP on it. Skipped, saying why, where namespaces cannot be made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from kvpushd_lab.netns import available

pytestmark = pytest.mark.timeout(900)


def test_demo_across_two_namespaces() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"kvpushd demo --hosts netns needs network namespaces: {why}")
    r = subprocess.run([sys.executable, "-m", "kvpushd", "demo", "--hosts", "netns", "--json", "--requests", "4",
                        "--concurrency", "2"], capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["hosts"] == "netns" and out["link"] == "veth pair"
    assert out["completed"] == 4 and out["failed"] == 0 and out["tokens_match"]
    assert out["mismatched_bytes"] == 0 and out["bytes_verified"] == out["bytes_moved"] > 0
    assert all(out["in_namespace"].values()), out["in_namespace"]
    # every KV byte crossed the veth pair (plus gRPC and UCX framing)
    assert out["veth_bytes"]["decode_rx"] >= out["bytes_moved"]
    assert out["ucx"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "kvp0"}


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv not found")
def test_demo_without_namespaces_says_why() -> None:
    """Without the capabilities to make namespaces (here: every capability dropped) it exits 2 with a message."""
    r = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable, "-m", "kvpushd",
                        "demo", "--hosts", "netns"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--hosts netns needs root and iproute2" in r.stderr and "--hosts local" in r.stderr


def test_bytes_mode_refuses_netns() -> None:
    r = subprocess.run([sys.executable, "-m", "kvpushd", "demo", "--mode", "bytes", "--hosts", "netns"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "engine mode" in r.stderr
