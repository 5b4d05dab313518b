"""What the daemon's metrics cost the event loop per transfer: ``Metrics.write_done`` (per WRITE
result, prefill side), ``Metrics._on_event`` (per transfer that ends, both sides) and
``Metrics.rendezvous_waited`` (per rendezvous, prefill side), each called N times in a row.

Run from the repository root: ``python scripts/bench_observer.py [N]``; prints one JSON object (us per
call). For an A/B, run it from each tree's own directory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())
from kvpushd.events import Event, EventKind
from kvpushd.metrics import Metrics
from kvpushd.transfer.records import LegKey, WriteResult


class _Events:
    def add_listener(self, fn: Callable[[Event], None]) -> None:
        pass


class _View:
    version, node_id, instance_id = "bench", "bench-node", "bench-instance"
    events = _Events()


def per_call_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(1000):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t) / n * 1e6, 3)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 50_000
    m = Metrics(_View())  # type: ignore[arg-type]
    r = WriteResult(LegKey("e", "t", 0, 1), True, "", 4096, 1e-4, 2e-4, 128, 128)
    ev = Event(1, 0.0, EventKind.TRANSFER_FINISHED, side="send", peer="127.0.0.1:1", nbytes=4096, duration_s=0.003)
    out = {
        "write_done_us": per_call_us(lambda: m.write_done(r, "127.0.0.1:1"), n),
        "transfer_event_us": per_call_us(lambda: m._on_event(ev), n),
        "rendezvous_waited_us": per_call_us(lambda: m.rendezvous_waited(0.001), n),
        "calls": n, "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
