"""Descriptor building over region tables, no NIXL.

The transfer thread and the lab's raw-NIXL baselines both build their descriptor lists here: one
descriptor per region and block (or per block slice across TP sizes), and per request its index
lists and the count after merging blocks adjacent on both sides (``plan_leg``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..core.errors import InvalidArgument
from ..core.layout import WHOLE as WHOLE  # re-exported: the transfer room's callers take them from here
from ..core.layout import Part as Part  # (slices per block, which slice): (1, 0) is the whole block

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """Absolute address of block 0 of a region, and its layout."""

    addr: int
    num_blocks: int
    block_len: int
    block_stride: int
    device_id: int
    block_tokens: int = 0    # tokens per block; 0: not said (maps one to one with the peer's blocks)
    num_heads: int = 0       # KV heads in one block; 0: not said
    layout: int = 0          # core.layout.HND (or 0) or NHD
    replicated: bool = False  # MLA latent: the same on every TP rank, never split by heads


@dataclass(frozen=True, slots=True)
class RemoteAgent:
    """A consumer worker's agent as the producer side knows it (from the peer API)."""

    name: str
    metadata: bytes
    mem_type: str
    regions: tuple[RegionSpec, ...]


def block_descs(regions: Sequence[RegionSpec], part: Part = WHOLE) -> npt.NDArray[np.uint64]:
    """Nx3 (addr, len, device) for one slice of every block of every region, region-major."""
    k, j = part
    out = []
    for r in regions:
        step = r.block_len // k
        d = np.empty((r.num_blocks, 3), dtype=np.uint64)
        d[:, 0] = (np.uint64(r.addr + j * step)
                   + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.block_stride))
        d[:, 1] = step
        d[:, 2] = r.device_id
        out.append(d)
    return np.concatenate(out) if out else np.empty((0, 3), dtype=np.uint64)


def region_bases(regions: Sequence[RegionSpec]) -> IntArray:
    """Index of each region's block 0 in the block-descriptor list."""
    counts = np.array([r.num_blocks for r in regions], dtype=np.int64)
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def leg_indices(bases: IntArray, blocks: IntArray) -> npt.NDArray[np.int32]:
    """Descriptor indices of ``blocks`` in every region: no Python loop per descriptor."""
    return (bases[:, None] + blocks[None, :]).reshape(-1).astype(np.int32)


@dataclass(frozen=True, slots=True)
class PairPlan:
    """What moving blocks between two agents' regions needs that does not change per request
    (checked once per pair and slice; per request only the block ids are looked at)."""

    regions: int
    dense: int              # regions whose adjacent blocks merge into one descriptor
    block_bytes: int        # bytes moved per block, all regions (this slice)
    src_blocks: int         # blocks in the smallest source region
    dst_blocks: int
    src_bases: tuple[int, ...]  # descriptor index of each region's block 0
    dst_bases: tuple[int, ...]


def pair_plan(src_regions: Sequence[RegionSpec], dst_regions: Sequence[RegionSpec], src_part: Part, dst_part: Part,
              src_bases: IntArray, dst_bases: IntArray) -> PairPlan:
    """Check two region tables against each other once (``check_regions``); what a leg needs of them."""
    check_regions(src_regions, dst_regions, src_part, dst_part)
    whole = src_part == WHOLE and dst_part == WHOLE
    dense = sum(1 for a, b in zip(src_regions, dst_regions, strict=True)
                if whole and a.block_stride == a.block_len and b.block_stride == b.block_len)
    return PairPlan(len(src_regions), dense, int(sum(r.block_len // src_part[0] for r in src_regions)),
                    min(r.num_blocks for r in src_regions), min(r.num_blocks for r in dst_regions),
                    tuple(int(b) for b in src_bases), tuple(int(b) for b in dst_bases))


def ready_first(idx: Sequence[int] | npt.NDArray[np.int32], blocks: int, ready: int) -> npt.NDArray[np.int32]:
    """A leg's region-major indices (regions x ``blocks``) with the first ``ready`` blocks of every
    region moved to the front: those are one contiguous slice (one WRITE of every layer of them), and
    the rest stays region-major after it, so a layer group of the remaining blocks is a slice too.
    Built once per leg, in numpy."""
    a = np.asarray(idx, dtype=np.int32).reshape(-1, blocks)
    return np.concatenate((a[:, :ready].reshape(-1), a[:, ready:].reshape(-1)))


@dataclass(frozen=True, slots=True)
class Units:
    """How a staged leg's descriptor indices split into the units its notifications count
    (core/notif.py): ``lead`` units complete at once (1: the ready blocks of every layer, the first
    ``head`` indices), then one per layer group, ``per_group`` indices each. ``sliced`` False: the
    indices are planned per request and cannot be split; the leg is one WRITE once its step is complete."""

    units: int
    lead: int = 0
    head: int = 0
    per_group: int = 0
    sliced: bool = True

    def ready(self, groups: int, layers: int) -> int:
        """Units that may be posted once ``groups`` of the ``layers`` layer groups are complete."""
        if not self.sliced:
            return self.units if groups >= layers else 0
        return min(self.units, self.lead + groups)

    def end(self, done: int) -> int:
        """The index where the first ``done`` units end (0 with ``sliced`` False: all of them)."""
        return self.head + (done - self.lead) * self.per_group if done and self.sliced else 0


def units(indices: int, blocks: int, layers: int, ready: int) -> Units:
    """The units of a leg of ``indices`` region-major indices over ``blocks`` blocks written in ``layers``
    groups, whose first ``ready`` blocks are complete (its indices reordered by ``ready_first``)."""
    if not indices or not blocks or indices % blocks or (indices // blocks) % layers:
        return Units(layers, sliced=False)  # (a layer group is R/layers whole regions)
    ready = min(ready, blocks)
    head = indices // blocks * ready
    if ready == blocks:
        return Units(1, 1, head)  # nothing left to wait for: one WRITE of all, at once
    return Units(layers + (1 if ready else 0), 1 if ready else 0, head, (indices - head) // layers)


SMALL_LEG = 128  # descriptors up to which a leg's index lists are built in plain Python (cheaper there)


@dataclass(frozen=True, slots=True)
class Leg:
    """One request's descriptor indices on both sides, and its figures."""

    src_idx: list[int] | npt.NDArray[np.int32]
    dst_idx: list[int] | npt.NDArray[np.int32]
    nbytes: int
    requested: int
    merged: int


def plan_leg(plan: PairPlan, src: Sequence[int], dst: Sequence[int]) -> Leg:
    """Index lists of one request (region-major, as ``leg_indices``), its bytes and descriptor counts
    (merging runs of blocks adjacent on both sides, in dense regions); the block ids checked against
    the regions. Plain Python for the usual small
    request: several times cheaper than numpy there."""
    n = len(src)
    if n != len(dst):
        raise InvalidArgument(f"block lists of unequal length: {n} source, {len(dst)} destination")
    if n and (min(src) < 0 or max(src) >= plan.src_blocks):
        raise InvalidArgument("source block id out of range")
    if n and (min(dst) < 0 or max(dst) >= plan.dst_blocks):
        raise InvalidArgument("destination block id out of range")
    if n * plan.regions <= SMALL_LEG:
        si: list[int] | npt.NDArray[np.int32] = [b + x for b in plan.src_bases for x in src]
        di: list[int] | npt.NDArray[np.int32] = [b + x for b in plan.dst_bases for x in dst]
        joins = sum(1 for i in range(1, n) if src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1)
    else:
        sa, da = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        si = leg_indices(np.asarray(plan.src_bases, dtype=np.int64), sa)
        di = leg_indices(np.asarray(plan.dst_bases, dtype=np.int64), da)
        joins = int(np.count_nonzero((np.diff(sa) == 1) & (np.diff(da) == 1)))
    runs = n - joins if n else 0
    return Leg(si, di, plan.block_bytes * n, n * plan.regions, plan.dense * runs + (plan.regions - plan.dense) * n)


def check_regions(src_regions: Sequence[RegionSpec], dst_regions: Sequence[RegionSpec], src_part: Part,
                  dst_part: Part) -> None:
    """Layouts must match region for region (slice for slice across TP sizes)."""
    if len(src_regions) != len(dst_regions):
        raise InvalidArgument(
            f"layout mismatch: producer has {len(src_regions)} regions, consumer has {len(dst_regions)}")
    for i, (lr, rr) in enumerate(zip(src_regions, dst_regions, strict=True)):
        if lr.block_len % src_part[0] or rr.block_len % dst_part[0] or \
                lr.block_len // src_part[0] != rr.block_len // dst_part[0]:
            raise InvalidArgument(
                f"layout mismatch in region {i}: producer block_len {lr.block_len} (1/{src_part[0]} per WRITE), "
                f"consumer block_len {rr.block_len} (1/{dst_part[0]} per WRITE)")
