"""``kvpushd bench sweep --kv-shape qwen3-32b-tp8``: the published shape's layout, its check, one real cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
from kvpushd_lab.bench.sweep.shape import StampedHooks, describe, extra_regions, model_config
from kvpushd_lab.refengine import KVEvents, PagedKV

SHAPE = "qwen3-32b-tp8"


def test_published_shape_is_one_qwen3_32b_tp8_rank() -> None:
    cfg = model_config(SHAPE, 2, 1, 4096)
    d = describe(SHAPE, cfg)
    assert d["regions"] == 128 and d["bytes_per_token"] == 32 * 1024 and d["block_len"] == 4096
    assert d["model_regions"] == 4 and d["extra_regions"] == 124 and d["block_tokens"] == 16
    assert d["published"]["layers"] == 64 and d["published"]["head_dim"] == 128  # one bf16 KV head per rank
    kv = PagedKV.shared(cfg, 8, "kvpushd-test-shape", extra_regions=extra_regions(SHAPE, cfg))
    try:
        regions = kv.regions()
        assert len(regions) == 128 and {r.block_len for r in regions} == {4096}
        assert [r.offset for r in regions] == [i * 8 * 4096 for i in range(128)]  # contiguous, region after region
        assert kv.nbytes == 128 * 8 * 4096
        assert kv.block_len == 4096 and kv.k[0].nbytes == 8 * 4096  # the model's K of layer 0 is region 0
        assert kv.extra_words().shape == (124, 8, 1024)
    finally:
        kv.close()
    assert describe("tiny", model_config("tiny", 2, 1, 4096))["regions"] == 4


def test_spread_lists_each_layers_share_of_the_extra_regions_before_its_k_and_v() -> None:
    """Progressive push's layer group l (128 / layers regions in list order) is layer l's K and V and its
    share of the extra regions: the same regions on both sides, only listed in another order."""
    for layers in (2, 4):
        cfg = model_config(SHAPE, layers, 1, 4096)
        kv = PagedKV.shared(cfg, 2, "kvpushd-test-spread", extra_regions=extra_regions(SHAPE, cfg))
        try:
            assert kv.spreads_extra
            order = kv.region_order(spread=True)
            assert sorted(order) == list(range(128)) and kv.region_order() == list(range(128))
            per = 128 // layers
            for lay in range(layers):
                group = order[lay * per:(lay + 1) * per]
                assert group[-2:] == [2 * lay, 2 * lay + 1] and min(group[:-2]) >= 2 * layers
            offsets = [r.offset for r in kv.regions(spread=True)]
            assert offsets == [i * 2 * 4096 for i in order]
        finally:
            kv.close()
    odd = model_config(SHAPE, 3, 1, 4096)  # 122 extra regions do not divide among 3 layers
    kv = PagedKV.shared(odd, 2, "kvpushd-test-spread", extra_regions=extra_regions(SHAPE, odd))
    try:
        assert not kv.spreads_extra and kv.region_order(spread=False) == list(range(128))
    finally:
        kv.close()


class _Spans:
    """Inner hooks of a progressive push with the extra regions in 2 spans: records what was stamped
    when each layer was rung."""

    extra_spans = 2

    def __init__(self, kv: PagedKV) -> None:
        self.kv, self.rung = kv, {}

    def on_prefill_start(self, req_id: str, block_ids: Any) -> None:
        self.blocks = list(block_ids)

    def on_layer_done(self, n: int) -> None:
        w = self.kv.extra_words()
        self.rung[n] = [bool((w[r, self.blocks, 0] & 1).all()) for r in range(w.shape[0])]  # stamped words are odd

    def on_prefill_done(self, req_id: str, block_ids: Any) -> dict[str, Any]:
        w = self.kv.extra_words()
        self.rung["done"] = [bool((w[r, self.blocks, 0] & 1).all()) for r in range(w.shape[0])]
        return {}


def test_each_layers_share_of_the_extra_regions_is_stamped_before_the_layer_is_rung() -> None:
    cfg = model_config(SHAPE, 2, 1, 4096)
    kv = PagedKV.shared(cfg, 8, "kvpushd-test-spans", extra_regions=extra_regions(SHAPE, cfg))
    inner = _Spans(kv)
    hooks = StampedHooks(inner, kv)
    try:
        hooks.words[:] = 0x5A5A5A5A  # poison (even)
        hooks.on_prefill_start("r", [1, 2, 3])
        hooks.on_layer_done(1)
        hooks.on_layer_done(2)
        hooks.on_prefill_done("r", [1, 2, 3])
        assert inner.rung[1] == [True] * 62 + [False] * 62  # layer 0's share, before layer 0 is rung
        assert inner.rung[2] == [True] * 124 and inner.rung["done"] == [True] * 124
        assert hooks.stats["stamped_requests"] == 1
    finally:
        hooks.words = None
        kv.close()


class _Copier:
    """Inner hooks standing in for a transfer: the decode side copies the prefill cache's regions."""

    def __init__(self, src: PagedKV, dst: PagedKV, skip_region: int | None) -> None:
        self.src, self.dst, self.skip = src, dst, skip_region
        self.done: set[str] = set()

    def on_prefill_done(self, req_id: str, block_ids: Any) -> dict[str, Any]:
        self.blocks = list(block_ids)
        return {}

    def on_blocks_allocated(self, req_id: str, block_ids: Any, kv_params: Any) -> None:
        assert self.src.shm and self.dst.shm
        s = np.frombuffer(self.src.shm.mmap, np.uint8).reshape(128, self.src.num_blocks, -1)
        d = np.frombuffer(self.dst.shm.mmap, np.uint8).reshape(128, self.dst.num_blocks, -1)
        for r in range(128):
            if r != self.skip:
                d[r, list(block_ids)] = s[r, self.blocks]
        del s, d
        self.done.add(req_id)

    def poll(self) -> KVEvents:
        ev = KVEvents(set(), set(self.done), {})
        self.done = set()
        return ev

    def close(self) -> None:
        pass


def test_check_catches_a_region_not_moved() -> None:
    cfg = model_config(SHAPE, 2, 1, 4096)
    n = extra_regions(SHAPE, cfg)
    for skip, ok in ((None, True), (100, False)):
        src = PagedKV.shared(cfg, 8, "kvpushd-test-shape-p", extra_regions=n)
        dst = PagedKV.shared(cfg, 8, "kvpushd-test-shape-d", extra_regions=n)
        inner = _Copier(src, dst, skip)
        p, d = StampedHooks(inner, src), StampedHooks(inner, dst)
        try:
            p.on_prefill_done("r", [1, 2, 3])
            d.on_blocks_allocated("r", [7, 5, 6], {"transfer_id": "r"})
            ev = d.poll()
            assert (ev.finished_recving == {"r"}) is ok, ev
            assert ("r" in ev.failed) is not ok and d.stats["checked_requests"] == 1
            assert d.stats["bytes_moved_checked"] == 3 * 128 * 4096
        finally:
            p.words = d.words = None
            src.close()
            dst.close()


def test_sweep_cell_with_the_published_shape_moves_and_checks_every_block() -> None:
    """Two requests of 40 tokens (3 blocks) through real daemons and real NIXL (progressive push: declared
    before the forward, two layer groups of 64 regions, each with its share of the extra regions), and
    in-engine NIXL push."""
    r = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "sweep", "--kv-shape", SHAPE, "--modes",
                        "kvpushd-push,inengine-push", "--prompt-lens", "40", "--qps", "8", "--requests", "2",
                        "--warmup", "0", "--max-new-tokens", "4", "--json"],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["kv_shape"]["regions"] == 128 and out["kv_shape"]["bytes_per_token"] == 32768
    per_request = 3 * 128 * 4096
    for c in out["cells"]:
        assert c["tokens_match"] and c["failed"] == 0 and c["completed"] == 2, c
        assert c["kv_bytes_per_request"] == per_request and c["descriptors_per_request"] == 3 * 128
    for mode in ("kvpushd-push", "inengine-push"):  # kvpushd-push: declared, a layer group per model layer
        chk = out["kv_checked"][mode]
        assert chk["checked_requests"] == 2 and chk["mismatched_words"] == 0 and chk["failed_checks"] == 0, chk
        assert chk["bytes_moved_checked"] == 2 * per_request
    for mode in ("kvpushd-push", "inengine-push"):  # what the decode engine's steps cost (allocator faults)
        stats = out["modes"][mode]["engine_stats"]["decode"]
        assert stats["decode_step_ms"]["n"] > 0 and stats["minor_faults"] > 0, stats
    counters = out["modes"]["kvpushd-push"]["daemon_counters"]
    assert counters["prefill_daemon_bytes_written"] == 2 * per_request  # the daemon moved every byte
    assert counters["prefill_daemon_descriptors_requested"] == 2 * 3 * 128


def test_engine_processes_keep_the_heap_steady() -> None:
    """Every reference engine process sets glibc's mmap and trim thresholds (engine_proc.steady_malloc), so
    a step's temporaries (here four of ~1 MiB, taken and freed 50 times) reuse heap pages instead of
    faulting fresh ones in. glibc's defaults fault ~1,000 pages a step here (its dynamic thresholds trim
    the heap after each step)."""
    code = (
        "import resource, sys, numpy as np\n"
        "from kvpushd_lab.demo.engine_proc import steady_malloc\n"
        "if sys.argv[1] == 'steady': assert steady_malloc()\n"
        "def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "def step(): return sum(float(x[0]) for x in [np.ones((1 << 18) + 1000 * i, np.float32) for i in range(4)])\n"
        "for _ in range(3): step()\n"
        "f0 = flt()\n"
        "for _ in range(50): step()\n"
        "print(flt() - f0)\n")
    faults = {}
    for how in ("plain", "steady"):
        r = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        faults[how] = int(r.stdout.strip())
    assert faults["steady"] < 100 and faults["plain"] > 10 * 50, faults
