"""A block's first WRITE vs its next ones, with and without the host KV populated in the two NIXL
processes' page tables (``ShmMapping.populate``, what a daemon does after attach with
``worker_api.populate_host_kv``): raw NIXL over UCX, 16 MiB per WRITE (512 tokens of the Qwen3-32B
rank layout, one descriptor per region and block), each WRITE into blocks no WRITE used before, then
twice more into the same ones. Both memories are touched by their owners first, as an engine's KV is.

Run from the repository root: ``python scripts/bench_first_write.py [GROUPS]``; prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np

if __name__ == "__main__":
    from kvpushd_lab.bench.common import POISON, KVMemory, Layout
    from kvpushd_lab.bench.rawnixl import Initiator, Target, preload

    groups = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    preload()
    n = Layout(layers=64).blocks_for(512)
    lay = Layout(layers=64, num_blocks=groups * n)
    out: dict[str, object] = {"bytes_per_write": lay.regions * n * lay.block_len, "groups": groups,
                              "loadavg_1m": os.getloadavg()[0]}
    for populate in (False, True, False, True):  # alternating
        src, dst = KVMemory("kvpushd-firstw-src", lay, seed=0), KVMemory("kvpushd-firstw-dst", lay, fill=POISON)
        target = Target(dst, 200e-6, populate=populate).wait_ready()
        init = Initiator(src, target, populate=populate)
        first, again = [], []
        for k in range(groups):
            b = np.arange(k * n, (k + 1) * n, dtype=np.int64)
            li, ri = init.block_indices(b, b)
            for rep in range(3):
                t0, _, t1 = init.write(init.local_blocks, li, init.remote_blocks, ri, f"{k}-{rep}".encode())
                (first if rep == 0 else again).append((t1 - t0) / 1e6)
        init.close()
        target.close()
        src.close()
        dst.close()
        key = "populated" if populate else "not_populated"
        runs = out.setdefault(key, [])
        assert isinstance(runs, list)
        runs.append({"first_write_ms_p50": round(statistics.median(first[1:]), 2),  # the very first: connection
                     "next_writes_ms_p50": round(statistics.median(again), 2)})
    out["loadavg_1m_after"] = os.getloadavg()[0]
    print(json.dumps(out))
