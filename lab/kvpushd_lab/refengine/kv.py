"""The reference model's paged KV cache (``PagedKV``): per layer one K and one V tensor of shape
``[num_blocks, kv_heads, block_size, head_dim]`` -- vLLM's HND layout, so within a block a rank's KV
heads are one contiguous slice and a heterogeneous-TP transfer moves contiguous byte ranges. The tensors
are views over caller-provided memory (the map of a sealed memfd), laid out region after region: layer 0
K, layer 0 V, layer 1 K, ... ``PagedKV.regions()`` describes exactly these bytes as kvpushd regions.
``extra_regions`` adds regions of the same block length after the model's, which the model never reads:
KV that is moved like the model's (``kvpushd bench sweep --kv-shape``: the bytes and descriptor counts
of a big model's rank around the tiny model's compute). ``regions(spread=True)`` lists them spread among
the model's layers, so a progressive push's layer group l (R / layers regions in list order) is layer
l's K and V with its share of the extra regions.

Gathering and scattering blocks over every rank's cache (``gather_blocks``, ``scatter_blocks``) is how
the model reads and writes it, and ``copy_blocks`` is a KV transfer in process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvpushd_client import Region, SealedBuffer

from .config import TinyConfig


class PagedKV:
    """One TP rank's KV cache: per layer K and V of shape [num_blocks, kv_heads/tp, block_size, head_dim].

    ``memory`` is any writable buffer (an ``mmap`` of a ``SealedBuffer``, a ``bytearray``) of at least
    ``offset + PagedKV.nbytes_for(...)`` bytes; the tensors are views over it, so what kvpushd writes
    into that memory is what the model reads. Without ``memory`` the cache lives on the private heap
    (for monolithic runs). ``PagedKV.shared()`` creates the shared memory too and owns it.
    """

    def __init__(self, cfg: TinyConfig, num_blocks: int, memory: Any = None, offset: int = 0,
                 tp_rank: int = 0, tp_size: int = 1, extra_regions: int = 0) -> None:
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.heads = cfg.kv_slice(tp_rank, tp_size)
        self.num_heads = self.heads.stop - self.heads.start
        self.offset = offset
        self.extra_regions = extra_regions
        self.shm: SealedBuffer | None = None
        n = self.nbytes_for(cfg, num_blocks, tp_size) // cfg.dtype_bytes  # the model's regions only
        if memory is None:
            if extra_regions:
                raise ValueError("extra_regions need caller-provided memory (PagedKV.shared)")
            flat = torch.zeros(n, dtype=cfg.dtype)
        else:
            if offset % cfg.dtype_bytes:
                raise ValueError(f"offset {offset} is not aligned to {cfg.dtype_bytes} bytes")
            flat = torch.frombuffer(memory, dtype=cfg.dtype, count=n, offset=offset)
        self._flat = flat
        self._memory = memory
        per = n // (2 * cfg.num_layers)
        shape = (num_blocks, self.num_heads, cfg.block_size, cfg.head_dim)
        views = [flat[i * per:(i + 1) * per].view(shape) for i in range(2 * cfg.num_layers)]
        self.k: list[torch.Tensor] = views[0::2]
        self.v: list[torch.Tensor] = views[1::2]

    @classmethod
    def shared(cls, cfg: TinyConfig, num_blocks: int, prefix: str, tp_rank: int = 0, tp_size: int = 1,
               extra_regions: int = 0) -> PagedKV:
        """A cache over a new ``SealedBuffer`` (a sealed memfd, handed to the daemon by descriptor)."""
        shm = SealedBuffer.create(prefix, cls.nbytes_for(cfg, num_blocks, tp_size, extra_regions))
        torch.frombuffer(shm.mmap, dtype=torch.uint8).zero_()  # every page resident, as vLLM's torch.zeros KV
        kv = cls(cfg, num_blocks, shm.mmap, 0, tp_rank, tp_size, extra_regions)
        kv.shm = shm
        return kv

    @staticmethod
    def nbytes_for(cfg: TinyConfig, num_blocks: int, tp_size: int = 1, extra_regions: int = 0) -> int:
        return (2 * cfg.num_layers + extra_regions) * num_blocks * PagedKV.block_len_for(cfg, tp_size)

    @staticmethod
    def block_len_for(cfg: TinyConfig, tp_size: int = 1) -> int:
        return cfg.kv_heads_per_rank(tp_size) * cfg.block_size * cfg.head_dim * cfg.dtype_bytes

    @property
    def block_len(self) -> int:
        return self.block_len_for(self.cfg, self.tp_size)

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.cfg, self.num_blocks, self.tp_size, self.extra_regions)

    def region_layout(self) -> list[tuple[int, int, int, int]]:
        """(offset, num_blocks, block_len, block_stride) per region: layer 0 K, layer 0 V, layer 1 K, ...,
        then the ``extra_regions``."""
        size = self.num_blocks * self.block_len
        return [(self.offset + i * size, self.num_blocks, self.block_len, self.block_len)
                for i in range(2 * self.cfg.num_layers + self.extra_regions)]

    def extra_words(self) -> Any:
        """The extra regions as a numpy uint32 array [extra_regions, num_blocks, block_len / 4] (a view)."""
        import numpy as np

        if self._memory is None or not self.extra_regions:
            return np.zeros((0, self.num_blocks, self.block_len // 4), dtype=np.uint32)
        start = self.offset + 2 * self.cfg.num_layers * self.num_blocks * self.block_len
        return np.frombuffer(self._memory, dtype=np.uint32, count=self.extra_regions * self.num_blocks
                             * self.block_len // 4, offset=start).reshape(self.extra_regions, self.num_blocks, -1)

    @property
    def spreads_extra(self) -> bool:
        """Whether the extra regions divide evenly among the model's layers (``regions(spread=True)``)."""
        return bool(self.extra_regions) and self.extra_regions % self.cfg.num_layers == 0

    def region_order(self, spread: bool = False) -> list[int]:
        """The regions' indices in ``region_layout()`` in the order ``regions()`` lists them. ``spread``
        (needs ``spreads_extra``): per layer l, its share of the extra regions (the l-th
        ``extra_regions / num_layers`` of them), then layer l's K and V."""
        n, layers = 2 * self.cfg.num_layers, self.cfg.num_layers
        if not spread or not self.extra_regions:
            return list(range(n + self.extra_regions))
        if not self.spreads_extra:
            raise ValueError(f"{self.extra_regions} extra regions do not divide among {layers} layers")
        per = self.extra_regions // layers
        order: list[int] = []
        for lay in range(layers):
            order += range(n + lay * per, n + (lay + 1) * per)
            order += [2 * lay, 2 * lay + 1]
        return order

    def regions(self, memory_index: int = 0, spread: bool = False) -> list[Region]:
        """The same layout as ``kvpushd_client.Region`` objects, for ``KVPushClient.attach``, in
        ``region_order(spread)``.

        Each says its block size in tokens and its KV heads (HND), so the other side may page the
        same tokens in blocks of another size."""
        layout = self.region_layout()
        return [Region(memory_index, off, nb, bl, stride, block_size_tokens=self.cfg.block_size,
                       num_heads=self.num_heads)
                for off, nb, bl, stride in (layout[i] for i in self.region_order(spread))]

    def fill_(self, value: float) -> None:
        self._flat.fill_(value)

    def close(self) -> None:
        """Drop the views and, for ``shared()`` caches, unmap it and close its memfd.

        (Views from ``extra_words()`` must be dropped first: they pin the map.)"""
        self.k = []
        self.v = []
        self._memory = None
        self._flat = torch.empty(0, dtype=self.cfg.dtype)  # drops the last view of the map
        if self.shm is not None:
            self.shm.close()
            self.shm = None


def as_caches(kv: PagedKV | Sequence[PagedKV]) -> list[PagedKV]:
    """Normalise one cache (TP1) or one per TP rank into a rank-ordered list covering every KV head."""
    caches = [kv] if isinstance(kv, PagedKV) else list(kv)
    if not caches:
        raise ValueError("no KV caches")
    tp = caches[0].tp_size
    if len(caches) != tp or sorted(c.tp_rank for c in caches) != list(range(tp)):
        raise ValueError(f"need exactly one cache per TP rank 0..{tp - 1}")
    if any(c.tp_size != tp or c.num_blocks != caches[0].num_blocks or c.cfg != caches[0].cfg for c in caches):
        raise ValueError("the rank caches of one engine must agree on tp_size, num_blocks and config")
    return sorted(caches, key=lambda c: c.tp_rank)


def gather_blocks(caches: Sequence[PagedKV], layer: int,
                  block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``block_ids`` over all ranks: two contiguous [n, kv_heads, block_size, head_dim] tensors."""
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    k = torch.cat([c.k[layer].index_select(0, idx) for c in caches], dim=1).contiguous()
    v = torch.cat([c.v[layer].index_select(0, idx) for c in caches], dim=1).contiguous()
    return k, v


def scatter_blocks(caches: Sequence[PagedKV], layer: int, block_ids: Sequence[int], k: torch.Tensor,
                   v: torch.Tensor) -> None:
    """Write full-head blocks ([n, kv_heads, block_size, head_dim]) into every rank's head slice."""
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    for c in caches:
        c.k[layer].index_copy_(0, idx, k[:, c.heads].contiguous())
        c.v[layer].index_copy_(0, idx, v[:, c.heads].contiguous())


def copy_blocks(src: PagedKV | Sequence[PagedKV], src_blocks: Sequence[int], dst: PagedKV | Sequence[PagedKV],
                dst_blocks: Sequence[int]) -> None:
    """What a KV transfer does, in process: every layer's K and V of ``src_blocks`` into ``dst_blocks``.

    Source and destination may have different TP sizes (heads are gathered, then re-split)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("source and destination block lists differ in length")
    s, d = as_caches(src), as_caches(dst)
    for layer in range(s[0].cfg.num_layers):
        k, v = gather_blocks(s, layer, src_blocks)
        scatter_blocks(d, layer, dst_blocks, k, v)
