"""Engine-thread cost of progressive push's doorbell: what vLLM's ``save_kv_layer`` costs per layer.

Times KVPushdConnectorWorker.layer_done (the connector's save_kv_layer: find the layer's regions, count
the leading complete layer groups, store the doorbell word when they grew) on a real shared-memory
Doorbell, for a 64-layer model with K and V in separate regions (Qwen3-32B's 128 regions) and a
16-layer one, and the step's begin and seal. Prints ns per layer (p50, p99 over the steps) and per step.

    .venv/bin/python scripts/bench_doorbell_cost.py [--steps 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from kvpushd_client.doorbell import Doorbell  # noqa: E402
from kvpushd_client.vllm.progress import LayerProgress  # noqa: E402
from kvpushd_client.vllm.worker import KVPushdConnectorWorker  # noqa: E402


def _worker(layers: int, bell: Doorbell) -> tuple[KVPushdConnectorWorker, list[str]]:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    owners = [[n] for n in names for _kv in ("k", "v")]  # K and V of each layer: two regions
    w = KVPushdConnectorWorker.__new__(KVPushdConnectorWorker)  # the engine thread's state only
    w._bell, w._progress, w._ringing, w._step_rings = bell, LayerProgress(owners), True, 0
    return w, names


def measure(layers: int, steps: int) -> dict[str, float]:
    bell = Doorbell()
    try:
        w, names = _worker(layers, bell)
        prog = w._progress
        assert prog is not None
        per_layer: list[float] = []
        per_step: list[float] = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            bell.step()
            prog.reset()
            t1 = time.perf_counter_ns()
            for n in names:
                w.layer_done(n)
            t2 = time.perf_counter_ns()
            bell.seal()
            t3 = time.perf_counter_ns()
            per_layer.append((t2 - t1) / layers)
            per_step.append(t3 - t0)
        assert prog.groups_done == prog.layers
        q = statistics.quantiles(per_layer, n=100)
        qs = statistics.quantiles(per_step, n=100)
        return {"layers": layers, "regions": 2 * layers, "steps": steps, "ns_per_layer_p50": round(q[49], 1),
                "ns_per_layer_p99": round(q[98], 1), "us_per_step_p50": round(qs[49] / 1e3, 2),
                "us_per_step_p99": round(qs[98] / 1e3, 2)}
    finally:
        bell.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [measure(n, a.steps) for n in (64, 16)]
    out = {"rows": rows, "loadavg": os.getloadavg(), "target_ns_per_layer": 2000}
    if a.json:
        print(json.dumps(out))
    else:
        for r in rows:
            print(f"{r['layers']} layers ({r['regions']} regions): {r['ns_per_layer_p50']:.0f} ns per layer p50, "
                  f"{r['ns_per_layer_p99']:.0f} p99; {r['us_per_step_p50']:.1f} us per step p50, "
                  f"{r['us_per_step_p99']:.1f} p99 (target <= 2 us per layer)")
        print(f"load {out['loadavg']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
