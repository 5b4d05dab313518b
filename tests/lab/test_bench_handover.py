"""kvpushd bench handover, small runs: the reference engine in all four modes, every request's blocks equal
on both engines; the same across two network namespaces on a shaped veth pair where namespaces can be made."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from kvpushd_lab.netns import available

pytestmark = pytest.mark.timeout(600)
MODES = {"kvpushd-progressive", "kvpushd-whole", "inengine-push", "inengine-pull"}


def _bench(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "handover", "--json", *args],
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["suite"] == "handover"
    return data


def test_handover_small_run_reports_every_mode() -> None:
    data = _bench("--prompt-lens", "256", "--requests", "2")
    assert {r["mode"] for r in data["rows"]} == MODES and data["fabric"] == "loopback"
    for r in data["rows"]:
        assert r["tokens"] == 256 and r["requests"] == 2 and r["handover_ms"]["n"] == 2
        assert r["ttft_ms"]["p50"] > 0 and "p99" in r["forward_start_to_told_ms"]
        assert r["told_to_first_token_ms"]["n"] == 2 and "p50" in r["token_after_told_ms"]
    assert data["requests_checked"] == 4 * 3  # warm-ups too: each request's blocks digested on both sides
    assert "handover_p50_progressive_over_inengine_push" in data["ratios"][0]
    assert data["load_before"]["cpus"] > 0


def test_handover_across_namespaces_on_a_shaped_veth() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"--fabric veth needs network namespaces: {why}")
    data = _bench("--prompt-lens", "64", "--requests", "1", "--fabric", "veth:10gbit")
    assert {r["mode"] for r in data["rows"]} == MODES and data["fabric"] == "veth:10gbit"
    assert data["requests_checked"] == 4 * 2
    per_request = 4 * 128 * 4096  # 4 blocks x 128 regions x 4 KiB
    assert data["veth_bytes"]["decode_rx_bytes"] >= 8 * per_request  # every KV byte crossed the pair


def test_handover_on_libfabric_across_namespaces() -> None:
    """--backend LIBFABRIC: the daemons and the in-engine agents on libfabric's tcp provider, on the veth."""
    from kvpushd_lab.backend import available as backend_available

    ok, why = available()
    if not ok:
        pytest.skip(f"--fabric veth needs network namespaces: {why}")
    if why := backend_available("LIBFABRIC"):
        pytest.skip(why)
    data = _bench("--prompt-lens", "64", "--requests", "1", "--fabric", "veth:10gbit", "--backend", "LIBFABRIC")
    assert {r["mode"] for r in data["rows"]} == MODES and data["backend"] == "LIBFABRIC"
    assert data["requests_checked"] == 4 * 2
    assert data["veth_bytes"]["decode_rx_bytes"] >= 8 * 4 * 128 * 4096  # every KV byte crossed the pair


def test_handover_refuses_an_unknown_fabric() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "handover", "--fabric", "infiniband"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "--fabric" in out.stderr


def test_handover_plot_from_saved_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TTFT and handover against the prompt length, per mode, drawn from a saved --json result."""
    pytest.importorskip("matplotlib")
    from kvpushd_lab.bench.plots import main as plots_main

    def stat(x: float) -> dict[str, float]:
        return {"p50": x, "p99": 2 * x, "mean": x, "max": 2 * x, "n": 4}

    rows = [{"tokens": t, "mode": m, "ttft_ms": stat(t / 10), "handover_ms": stat(k)}
            for t in (1024, 4096) for m, k in (("kvpushd-progressive", 2.0), ("kvpushd-whole", 30.0))]
    saved = tmp_path / "h.json"
    saved.write_text(json.dumps({"suite": "handover", "rows": rows, "fabric": "", "load_before": {"loadavg_1m": 1.0}}))
    assert plots_main([str(saved), str(tmp_path / "out"), "--stem", "h"]) == 0
    png = tmp_path / "out" / "h-handover.png"
    assert png.stat().st_size > 10_000
