"""``--kv-shape``: the KV a sweep request moves, and its cheap check.

* ``tiny`` (the default): the tiny model's own cache, ``--layers`` x (K, V) regions of fp32 blocks.
* ``qwen3-32b-tp8``: one TP8 rank of Qwen3-32B, the layout ``kvpushd bench ceiling`` uses
  (``common.Layout()``: 64 layers x (K, V) = 128 regions, 1 KV head x 128 head dim, bf16, blocks of
  16 tokens: 4 KiB per block and region, 32 KiB per token). The tiny model still does the compute:
  with one KV head of head_dim 64 in fp32 its blocks are 4 KiB as well, so its 2 x layers regions are
  the first of the 128 and the other regions (``PagedKV(extra_regions=...)``) are moved with them,
  block for block, but never read by the model. So every request moves the bytes and the descriptors
  (one per region and block, before merging) of the published benchmark.

The extra regions are checked cheaply but every byte of them moves: on the prefill side the engine
thread stamps, in each of the request's blocks of every extra region, guard words at the block's
head and tail, and one sampled block of the request whole, with a pattern of the transfer id, the
region and the block's position in the request; the decode side poisons the same words when it
allocates the blocks and compares them once the transfer is reported finished. A request whose words
differ fails ("KV check"), so it shows as failed and its tokens as not matching; the model's own
regions are checked by the tokens (every request against a monolithic run).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..common import BenchError, Layout

KV_SHAPES = ("tiny", "qwen3-32b-tp8")
POISON_WORD = 0x5A5A5A5A  # even; every stamped word is odd
FP32 = 4


def published_layout() -> Layout:
    """One TP8 rank of Qwen3-32B (the ceiling suite's layout)."""
    return Layout()


def model_config(shape: str, layers: int, heads: int, max_positions: int) -> Any:
    """The tiny model's config for a KV shape."""
    from ...refengine import TinyConfig

    if shape == "tiny":
        return TinyConfig(num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=128 // heads,
                          hidden_size=128, max_positions=max_positions)
    lay = published_layout()
    head_dim = lay.block_len // (lay.block_tokens * FP32)  # one fp32 KV head whose blocks are lay.block_len
    if 2 * layers > lay.regions:
        raise BenchError(f"--layers {layers}: the {shape} shape has {lay.regions} regions, the model needs "
                         f"{2 * layers}")
    return TinyConfig(num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=head_dim, hidden_size=head_dim,
                      block_size=lay.block_tokens, max_positions=max_positions)


def extra_regions(shape: str, cfg: Any) -> int:
    """Regions beyond the model's own that each request moves."""
    if shape == "tiny":
        return 0
    return published_layout().regions - 2 * int(cfg.num_layers)


def describe(shape: str, cfg: Any) -> dict[str, Any]:
    """What one request moves, per block and per token, for the JSON."""
    from ...refengine import PagedKV

    block_len = PagedKV.block_len_for(cfg)
    regions = 2 * int(cfg.num_layers) + extra_regions(shape, cfg)
    return {"name": shape, "regions": regions, "model_regions": 2 * int(cfg.num_layers),
            "extra_regions": regions - 2 * int(cfg.num_layers), "block_len": block_len,
            "block_tokens": int(cfg.block_size), "bytes_per_token": regions * block_len // int(cfg.block_size),
            "descriptors_per_block": regions,
            **({"published": published_layout().describe()} if shape != "tiny" else {})}


def _words(h: int, regions: range, positions: npt.NDArray[np.int64], cols: npt.NDArray[np.int64]) -> Any:
    """The stamp of the extra regions ``regions``: [len(regions), len(positions), len(cols)] uint32, odd
    (never the poison)."""
    r = np.arange(regions.start, regions.stop, dtype=np.uint64)[:, None, None]
    p = positions.astype(np.uint64)[None, :, None]
    c = cols.astype(np.uint64)[None, None, :]
    v = (np.uint64(h) + r * np.uint64(0x9E3779B1) + p * np.uint64(0x85EBCA77) + c * np.uint64(0xC2B2AE3D))
    return (v & np.uint64(0xFFFFFFFF)).astype(np.uint32) | np.uint32(1)


class StampedHooks:
    """Wraps an engine's hooks: stamps (prefill) and checks (decode) the extra regions per request.

    When the inner hooks list the extra regions spread among the model's layers (``extra_spans``, kvpushd
    progressive push), each layer's share is stamped as that layer is done, before the inner hooks ring
    it: the extra regions stand for the layers of a big model, written during the forward like the
    model's own. Otherwise every extra region is stamped once the prefill is done."""

    def __init__(self, inner: Any, kv: Any) -> None:
        self.inner = inner
        self.words = kv.extra_words()  # [extra regions, num_blocks, block_len / 4] uint32
        self.spans = int(getattr(inner, "extra_spans", 0) or 0)
        self._forward: tuple[str, list[int]] | None = None  # the prefill whose forward runs
        self._stamped = 0  # spans of it stamped so far
        width = self.words.shape[2]
        self.guard_cols = np.array([0, 1, width - 2, width - 1], dtype=np.int64)
        self.all_cols = np.arange(width, dtype=np.int64)
        self.bytes_per_block = (2 * kv.cfg.num_layers + kv.extra_regions) * kv.block_len
        self._pending: dict[str, tuple[str, list[int]]] = {}  # decode: req id -> (transfer id, blocks)
        self.stats = {"stamped_requests": 0, "checked_requests": 0, "checked_words": 0, "mismatched_words": 0,
                      "failed_checks": 0, "bytes_moved_checked": 0}

    def _targets(self, tid: str, blocks: Sequence[int]) -> tuple[Any, Any, int, int]:
        h = zlib.crc32(tid.encode())
        b = np.asarray(blocks, dtype=np.int64)
        return b, np.arange(len(b), dtype=np.int64), h, h % len(b)

    def _stamp(self, tid: str, blocks: Sequence[int], spans: range | None = None) -> None:
        """Stamp the extra regions of ``spans`` (all when None) in the request's blocks."""
        b, pos, h, s = self._targets(tid, blocks)
        n = self.words.shape[0]
        regions = range(n) if spans is None else range(spans.start * n // self.spans, spans.stop * n // self.spans)
        w = self.words[regions.start:regions.stop]
        w[:, b[:, None], self.guard_cols[None, :]] = _words(h, regions, pos, self.guard_cols)
        w[:, b[s], :] = _words(h, regions, pos[s:s + 1], self.all_cols)[:, 0, :]

    def _poison(self, tid: str, blocks: Sequence[int]) -> None:
        b, _, _, s = self._targets(tid, blocks)
        self.words[:, b[:, None], self.guard_cols[None, :]] = POISON_WORD
        self.words[:, b[s], :] = POISON_WORD

    def _check(self, tid: str, blocks: Sequence[int]) -> tuple[int, int]:
        """(words compared, words that differ)."""
        b, pos, h, s = self._targets(tid, blocks)
        n = self.words.shape[0]
        guards = self.words[:, b[:, None], self.guard_cols[None, :]]
        whole = self.words[:, b[s], :]
        bad = int(np.count_nonzero(guards != _words(h, range(n), pos, self.guard_cols)))
        bad += int(np.count_nonzero(whole != _words(h, range(n), pos[s:s + 1], self.all_cols)[:, 0, :]))
        return guards.size + whole.size, bad

    def __getattr__(self, name: str) -> Any:  # the inner hooks' optional ones (progressive push, abort)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- KVHooks ---------------------------------------------------------------------------

    def on_prefill_start(self, req_id: str, block_ids: Sequence[int]) -> None:
        fn = getattr(self.inner, "on_prefill_start", None)
        if fn is not None:
            fn(req_id, block_ids)
        if self.spans and block_ids:
            self._forward, self._stamped = (req_id, list(block_ids)), 0

    def on_layer_done(self, n: int) -> None:
        if self._forward is not None and n > self._stamped:
            self._stamp(*self._forward, range(self._stamped, min(n, self.spans)))
            self._stamped = min(n, self.spans)
        fn = getattr(self.inner, "on_layer_done", None)
        if fn is not None:
            fn(n)

    def on_prefill_done(self, req_id: str, block_ids: Sequence[int]) -> dict[str, Any]:
        if block_ids:  # what the layers have not stamped yet (all of it without spans)
            mine = self._forward is not None and self._forward[0] == req_id
            self._stamp(req_id, block_ids, range(self._stamped, self.spans) if mine else None)
            self.stats["stamped_requests"] += 1
        self._forward = None
        return dict(self.inner.on_prefill_done(req_id, block_ids))

    def on_blocks_allocated(self, req_id: str, block_ids: Sequence[int], kv_params: Mapping[str, Any]) -> None:
        tid = str(kv_params.get("transfer_id") or req_id)
        if block_ids:
            self._poison(tid, block_ids)
            self._pending[req_id] = (tid, list(block_ids))
        self.inner.on_blocks_allocated(req_id, block_ids, kv_params)

    def poll(self) -> Any:
        ev = self.inner.poll()
        for rid in list(ev.finished_recving):
            got = self._pending.pop(rid, None)
            if got is None:
                continue
            checked, bad = self._check(*got)
            self.stats["checked_requests"] += 1
            self.stats["checked_words"] += checked
            self.stats["mismatched_words"] += bad
            self.stats["bytes_moved_checked"] += len(got[1]) * self.bytes_per_block
            if bad:
                self.stats["failed_checks"] += 1
                ev.finished_recving.discard(rid)
                ev.failed[rid] = f"KV check: {bad} of {checked} words of the extra regions differ"
        for rid in ev.failed:
            self._pending.pop(rid, None)
        return ev

    def end_step(self) -> None:
        fn = getattr(self.inner, "end_step", None)
        if fn is not None:
            fn()

    def close(self) -> None:
        self.words = None  # the view pins the cache's map
        self.inner.close()
