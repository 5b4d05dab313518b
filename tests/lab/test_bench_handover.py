"""kvpushd bench handover, one small run: both modes move exact bytes, progressive declared before the forward."""

from __future__ import annotations

import json
import subprocess
import sys


def test_handover_small_run_reports_both_modes() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "handover", "--prompt-lens", "256",
                          "--requests", "2", "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["suite"] == "handover"
    modes = {r["mode"]: r for r in data["rows"]}
    assert set(modes) == {"kvpushd-progressive", "kvpushd-whole"}
    for r in data["rows"]:
        assert r["tokens"] == 256 and r["handover_ms"]["n"] == 2 and r["ttft_ms"]["p50"] > 0
    assert data["ratios"][0]["tokens"] == 256
