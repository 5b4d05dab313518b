"""descs.plan_leg (the per-request path of the NIXL thread) agrees with numpy references (leg_indices,
and the merged-descriptor count and range checks written out below) on every shape: whole blocks and
TP slices, dense and strided regions, small lists (plain Python) and large ones (numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpushd.core.errors import InvalidArgument
from kvpushd.transfer import descs
from kvpushd.transfer.descs import WHOLE, RegionSpec, leg_indices, pair_plan, plan_leg


def merged_count(local, remote, src, dst, src_part, dst_part) -> int:  # type: ignore[no-untyped-def]
    """Descriptors after merging runs of blocks adjacent on both sides (per dense region)."""
    if len(src) == 0:
        return 0
    runs = int(len(src) - np.count_nonzero((np.diff(src) == 1) & (np.diff(dst) == 1)))
    whole = src_part == WHOLE and dst_part == WHOLE
    return sum(runs if whole and lr.block_stride == lr.block_len and rr.block_stride == rr.block_len else len(src)
               for lr, rr in zip(local, remote, strict=True))


def check_ranges(local, remote, src, dst) -> None:  # type: ignore[no-untyped-def]
    """The per-request checks, in numpy."""
    if len(src) != len(dst):
        raise InvalidArgument(f"block lists of unequal length: {len(src)} source, {len(dst)} destination")
    if len(src) and (src.min() < 0 or src.max() >= min(r.num_blocks for r in local)):
        raise InvalidArgument("source block id out of range")
    if len(dst) and (dst.min() < 0 or dst.max() >= min(r.num_blocks for r in remote)):
        raise InvalidArgument("destination block id out of range")


def regions(n: int, blocks: int, block_len: int, stride: int) -> tuple[RegionSpec, ...]:
    return tuple(RegionSpec(i << 24, blocks, block_len, stride, 0) for i in range(n))


@pytest.mark.parametrize("n_regions,stride_pad,parts", [(4, 0, (WHOLE, WHOLE)), (3, 64, (WHOLE, WHOLE)),
                                                        (2, 0, ((2, 1), WHOLE)), (128, 0, (WHOLE, WHOLE))])
@pytest.mark.parametrize("n_blocks", [1, 2, 7, 32, 40, 300])
def test_plan_leg_matches_the_numpy_reference(n_regions: int, stride_pad: int, parts: tuple, n_blocks: int) -> None:
    src_part, dst_part = parts
    local = regions(n_regions, 512, 4096 * src_part[0], 4096 * src_part[0] + stride_pad)
    remote = regions(n_regions, 600, 4096, 4096)
    rng = np.random.default_rng(n_blocks * 7 + n_regions)
    # runs of adjacent blocks mixed with jumps, as a paged KV cache hands them out
    src = np.cumsum(rng.choice([1, 1, 1, 5], n_blocks)) % 512
    dst = np.cumsum(rng.choice([1, 1, 2], n_blocks)) % 600
    src_l, dst_l = [int(x) for x in src], [int(x) for x in dst]
    lb, rb = descs.region_bases(local), descs.region_bases(remote)
    plan = pair_plan(local, remote, src_part, dst_part, lb, rb)
    leg = plan_leg(plan, src_l, dst_l)
    check_ranges(local, remote, src, dst)
    assert list(leg.src_idx) == list(leg_indices(lb, src)) and list(leg.dst_idx) == list(leg_indices(rb, dst))
    assert leg.merged == merged_count(local, remote, src, dst, src_part, dst_part)
    assert leg.requested == n_regions * n_blocks
    assert leg.nbytes == sum(r.block_len // src_part[0] for r in local) * n_blocks


def test_plan_leg_refuses_what_the_checks_refuse() -> None:
    local, remote = regions(2, 8, 4096, 4096), regions(2, 4, 4096, 4096)
    plan = pair_plan(local, remote, WHOLE, WHOLE, descs.region_bases(local), descs.region_bases(remote))
    for src, dst, why in (([1, 2], [1], "unequal length"), ([8], [0], "source block id out of range"),
                          ([-1], [0], "source block id out of range"), ([0], [4], "destination block id")):
        with pytest.raises(InvalidArgument, match=why):
            plan_leg(plan, src, dst)
        with pytest.raises(InvalidArgument, match=why):
            check_ranges(local, remote, np.asarray(src), np.asarray(dst))
    with pytest.raises(InvalidArgument, match="layout mismatch"):
        pair_plan(local, regions(3, 4, 4096, 4096), WHOLE, WHOLE, descs.region_bases(local),
                  descs.region_bases(regions(3, 4, 4096, 4096)))
    with pytest.raises(InvalidArgument, match="layout mismatch in region 0"):
        pair_plan(local, regions(2, 4, 2048, 2048), WHOLE, WHOLE, descs.region_bases(local),
                  descs.region_bases(local))
