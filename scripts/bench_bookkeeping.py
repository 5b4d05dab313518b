"""What the daemon's bookkeeping costs the event loop: ``Node._on_writes`` per WRITE result (the
core event, then the counters, event hub, figures, peer book, metrics) and ``Node.run`` per
completion delivered (figures, counters, event hub and its listeners), each called N times in a row
with no NIXL and no peer.

Run from the repository root: ``python scripts/bench_bookkeeping.py [N]``; prints one JSON object (us
per call). For an A/B, run it from each tree's own directory, alternating.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

sys.path.insert(0, os.getcwd())
from kvpushd import config
from kvpushd.core.actions import Deliver
from kvpushd.core.types import Completion, CompletionKind
from kvpushd.metrics import Metrics
from kvpushd.runtime.node import Node
from kvpushd.transfer.records import LegKey, WriteResult


def per_call_us(fn: Callable[[int], Any], n: int) -> float:
    for i in range(1000):
        fn(i)
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return round((time.perf_counter() - t) / n * 1e6, 3)


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 20_000
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    node = Node(config.from_dict({"metrics": {"enabled": False}}))
    metrics = Metrics(node.view)
    if hasattr(node, "obs"):
        import inspect

        from kvpushd.app import observe

        observe(node, *([metrics] if "metrics" in inspect.signature(observe).parameters else []))
        ex: Any = getattr(node, "ex", node)  # a tree from before the node drove the core itself had an executor
    else:  # a tree from before the observation stream
        ex = node.executor  # type: ignore[attr-defined]
        ex.observer = metrics
    writes = [WriteResult(LegKey("e", f"t{i}", 0, 1), True, "", 4096, 1e-4, 2e-4, 3, 2) for i in range(n + 1000)]
    done = [[Deliver("w", Completion(CompletionKind.FINISHED_SENDING, f"t{i}"))] for i in range(n + 1000)]
    out = {
        "on_writes_us": per_call_us(lambda i: ex._on_writes([writes[i]]), n),  # an unknown leg: core drops it
        "deliver_us": per_call_us(lambda i: ex.run(done[i]), n),
        "calls": n, "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
