"""Logical token positions -> byte ranges, when the two sides' blocks do not line up one to one.

Prefill and decode may page the same tokens differently: other block sizes (tokens per block),
a decode-side prefix-cache hit that skips the first tokens, other TP sizes (each side holds another
slice of the KV heads), another layout (HND ``[heads, tokens, head bytes]`` as vLLM's default, or
NHD ``[tokens, heads, head bytes]``), and MLA regions whose one latent per token is the same on every
rank (``replicated``). For each region this module maps the transferred tokens onto both sides'
physical layouts and returns (address, length, device) descriptors, already merged where a
descriptor continues the previous one on both sides.

Pure numpy, no Python loop per token or per descriptor: a 16k-token request over 128 regions and 8
heads is a few array operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .errors import InvalidArgument

HND = 1  # kvpushd.v1.KVLayout values; 0 (unspecified) is HND
NHD = 2

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Part = tuple[int, int]  # (slices of the heads, which slice): (1, 0) is all heads
WHOLE: Part = (1, 0)


class Shape(Protocol):
    """What deciding between a prepared and a planned WRITE needs of one region (Geometry has it)."""

    @property
    def block_tokens(self) -> int: ...   # 0: unknown ("same as the peer")
    @property
    def layout(self) -> int: ...         # HND (or 0) or NHD
    @property
    def replicated(self) -> bool: ...    # MLA: one latent per token, the same on every rank


class Geometry(Shape, Protocol):
    """What the mapping needs to know of one region on one side (RegionSpec has these fields)."""

    @property
    def addr(self) -> int: ...
    @property
    def block_len(self) -> int: ...
    @property
    def block_stride(self) -> int: ...
    @property
    def device_id(self) -> int: ...
    @property
    def num_heads(self) -> int: ...      # KV heads in one block of this rank; 0: unknown


def sizes_differ(local: Sequence[Shape], remote: Sequence[Shape]) -> bool:
    """Both sides said their block size in tokens, and the sizes differ: tokens must be mapped."""
    return any(lr.block_tokens and rr.block_tokens and lr.block_tokens != rr.block_tokens
               for lr, rr in zip(local, remote, strict=False))


def needs_plan(local: Sequence[Shape], remote: Sequence[Shape], skip_tokens: int, skip_replicated: bool,
               src_part: Part, dst_part: Part) -> bool:
    """Whether a WRITE cannot use the prepared one-descriptor-per-block (or per block slice) lists:
    block sizes differ, a prefix is skipped, a layout other than HND or a replicated region meets
    a TP size change, or the two sides disagree on layout or replication."""
    if skip_tokens or skip_replicated:
        return True
    hetero = src_part != WHOLE or dst_part != WHOLE
    for lr, rr in zip(local, remote, strict=False):
        lay_l, lay_r = lr.layout or HND, rr.layout or HND
        if lr.block_tokens and rr.block_tokens and lr.block_tokens != rr.block_tokens:
            return True
        if lay_l != lay_r or lr.replicated != rr.replicated:
            return True
        if hetero and (lr.replicated or lay_l != HND):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Plan:
    """Descriptors of one WRITE: ``src`` and ``dst`` are Nx3 (address, length, device) arrays."""

    src: U64
    dst: U64
    requested: int   # descriptors before merging
    tokens: int      # logical tokens moved (per region)
    nbytes: int


def token_runs(n_src: int, bs_src: int, n_dst: int, bs_dst: int, skip: int) -> tuple[I64, I64]:
    """Maximal token runs inside one source block and one destination block.

    Source block i holds tokens [i*bs_src, (i+1)*bs_src); destination block j holds tokens
    [skip + j*bs_dst, skip + (j+1)*bs_dst). Tokens moved: [skip, min(n_src*bs_src, skip+n_dst*bs_dst)).
    Returns (first token, length) of each run, in token order.
    """
    end = min(n_src * bs_src, skip + n_dst * bs_dst)
    if end <= skip:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    first_src = -(-skip // bs_src) * bs_src
    cuts = np.union1d(np.arange(first_src, end, bs_src, dtype=np.int64),
                      np.arange(skip, end, bs_dst, dtype=np.int64))
    cuts = np.union1d(cuts, np.array([skip], dtype=np.int64))
    lengths = np.diff(np.append(cuts, end))
    return cuts, lengths


def merge_adjacent(src: U64, dst: U64) -> tuple[U64, U64]:
    """Merge each descriptor into the previous one where it continues it on both sides."""
    if len(src) < 2:
        return src, dst
    s_end = src[:-1, 0] + src[:-1, 1]
    d_end = dst[:-1, 0] + dst[:-1, 1]
    cont = (s_end == src[1:, 0]) & (d_end == dst[1:, 0]) & (src[:-1, 2] == src[1:, 2]) & (dst[:-1, 2] == dst[1:, 2])
    if not cont.any():
        return src, dst
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lens = np.add.reduceat(src[:, 1], starts)
    ms, md = src[starts].copy(), dst[starts].copy()
    ms[:, 1] = lens
    md[:, 1] = lens
    return ms, md


@dataclass(frozen=True, slots=True)
class _Side:
    bs: int
    heads: int
    head_bytes: int
    first_head: int
    layout: int


def _resolve(i: int, s: Geometry, d: Geometry, skip: int, sp: Part, dp: Part) -> tuple[_Side, _Side, int]:
    """Both sides' geometry of region ``i`` with unknowns filled in; -> (src, dst, heads moved)."""
    bs_s, bs_d = s.block_tokens or d.block_tokens, d.block_tokens or s.block_tokens
    if not bs_s:
        if skip:
            raise InvalidArgument(f"region {i}: skip_tokens needs the block size in tokens on either side")
        bs_s = bs_d = 1  # neither side said: a block is the unit, as before block sizes were known
    if s.replicated != d.replicated:
        raise InvalidArgument(f"layout mismatch in region {i}: replicated on one side only")
    lay_s, lay_d = s.layout or HND, d.layout or HND
    if s.replicated:  # one latent per token: every rank holds all of it, there are no heads to split
        h_s = h_d = 1
        sp = dp = WHOLE
        lay_s = lay_d = HND
    else:
        h_s, h_d = s.num_heads, d.num_heads
        if not h_s and h_d:
            h_s = h_d * sp[0] // dp[0]
        elif not h_d and h_s:
            h_d = h_s * dp[0] // sp[0]
        elif not h_s:
            hnd_ok = lay_s == lay_d == HND and bs_s == bs_d and skip % bs_s == 0
            nhd_ok = lay_s == lay_d == NHD and sp == dp == WHOLE  # a token's heads are contiguous
            if not (hnd_ok or nhd_ok):
                raise InvalidArgument(f"region {i}: num_heads is needed to map tokens across these layouts")
            # whole blocks (or their head slices) line up: treat each slice as one "head"
            h_s, h_d = sp[0], dp[0]
    if h_s % sp[0] or h_d % dp[0] or h_s // sp[0] != h_d // dp[0]:
        raise InvalidArgument(
            f"layout mismatch in region {i}: producer has {h_s} heads (1/{sp[0]} per WRITE), "
            f"consumer has {h_d} heads (1/{dp[0]} per WRITE)")
    n = h_s // sp[0]
    e_s, r_s = divmod(s.block_len, h_s * bs_s)
    e_d, r_d = divmod(d.block_len, h_d * bs_d)
    if r_s or r_d or e_s != e_d or e_s == 0:
        raise InvalidArgument(
            f"layout mismatch in region {i}: producer block_len {s.block_len} for {h_s} heads x {bs_s} tokens, "
            f"consumer block_len {d.block_len} for {h_d} heads x {bs_d} tokens")
    return (_Side(bs_s, h_s, e_s, sp[1] * n, lay_s), _Side(bs_d, h_d, e_d, dp[1] * n, lay_d), n)


def _addresses(g: Geometry, side: _Side, blocks: I64, off: I64, head: I64) -> U64:
    """Byte address of (block id, token offset in the block, head) for broadcastable arrays."""
    e = side.head_bytes
    inner = off * (side.heads * e) + head * e if side.layout == NHD else head * (side.bs * e) + off * e
    return (np.uint64(g.addr) + blocks.astype(np.uint64) * np.uint64(g.block_stride)
            + inner.astype(np.uint64))


def plan_write(src_regions: Sequence[Geometry], dst_regions: Sequence[Geometry], src_blocks: Sequence[int] | I64,
               dst_blocks: Sequence[int] | I64, skip_tokens: int = 0, src_part: Part = WHOLE,
               dst_part: Part = WHOLE, skip_replicated: bool = False) -> Plan:
    """Descriptors that copy tokens [skip, end) of every region from the source blocks to the destination.

    ``src_blocks`` hold the prompt from token 0; ``dst_blocks`` hold it from token ``skip_tokens``
    (the decode side already has the tokens before). ``src_part``/``dst_part`` say which slice of
    each side's heads this WRITE covers (``topology.block_parts``). ``skip_replicated``: leave out
    replicated regions (another producer rank writes them).
    """
    if len(src_regions) != len(dst_regions):
        raise InvalidArgument(
            f"layout mismatch: producer has {len(src_regions)} regions, consumer has {len(dst_regions)}")
    if skip_tokens < 0:
        raise InvalidArgument("skip_tokens must not be negative")
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    srcs: list[U64] = []
    dsts: list[U64] = []
    tokens = 0
    nbytes = 0
    runs_cache: dict[tuple[int, int], tuple[I64, I64]] = {}
    for i, (s, d) in enumerate(zip(src_regions, dst_regions, strict=True)):
        ss, ds, n = _resolve(i, s, d, skip_tokens, src_part, dst_part)
        if skip_tokens % ds.bs:
            raise InvalidArgument(f"skip_tokens {skip_tokens} is not a whole number of decode blocks ({ds.bs} tokens)")
        if s.replicated and skip_replicated:
            continue
        key = (ss.bs, ds.bs)
        if key not in runs_cache:
            runs_cache[key] = token_runs(len(sb), ss.bs, len(db), ds.bs, skip_tokens)
        start, length = runs_cache[key]
        if len(start) == 0:
            raise InvalidArgument(
                f"nothing to move: {len(sb)} source blocks of {ss.bs} tokens, skip_tokens {skip_tokens}")
        s_blk, s_off = sb[start // ss.bs], start % ss.bs
        d_blk, d_off = db[(start - skip_tokens) // ds.bs], (start - skip_tokens) % ds.bs
        e = ss.head_bytes
        heads = np.arange(n, dtype=np.int64)
        if ss.layout == ds.layout == HND:
            # one descriptor per (run, head): a head's tokens are contiguous within a block
            sa = _addresses(s, ss, s_blk[:, None], s_off[:, None], ss.first_head + heads[None, :])
            da = _addresses(d, ds, d_blk[:, None], d_off[:, None], ds.first_head + heads[None, :])
            ln = np.broadcast_to((length * e)[:, None], sa.shape)
        elif ss.layout == ds.layout == NHD and n == ss.heads == ds.heads:
            # all heads of a token run are contiguous on both sides
            sa = _addresses(s, ss, s_blk, s_off, np.zeros(1, np.int64))
            da = _addresses(d, ds, d_blk, d_off, np.zeros(1, np.int64))
            ln = length * (n * e)
        else:
            # per token: each run expanded to its tokens (NHD head slices, or the two layouts differ)
            rep = np.repeat(np.arange(len(start)), length)
            step = np.arange(len(rep), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
            t_sb, t_so = s_blk[rep], s_off[rep] + step
            t_db, t_do = d_blk[rep], d_off[rep] + step
            if ss.layout == ds.layout == NHD:  # the head slice of one token is contiguous
                sa = _addresses(s, ss, t_sb, t_so, np.full(1, ss.first_head))
                da = _addresses(d, ds, t_db, t_do, np.full(1, ds.first_head))
                ln = np.full(len(rep), n * e, dtype=np.int64)
            else:
                sa = _addresses(s, ss, t_sb[:, None], t_so[:, None], ss.first_head + heads[None, :])
                da = _addresses(d, ds, t_db[:, None], t_do[:, None], ds.first_head + heads[None, :])
                ln = np.full(sa.shape, e, dtype=np.int64)
        k = sa.size
        sd = np.empty((k, 3), dtype=np.uint64)
        dd = np.empty((k, 3), dtype=np.uint64)
        sd[:, 0] = sa.reshape(-1)
        dd[:, 0] = da.reshape(-1)
        sd[:, 1] = dd[:, 1] = np.asarray(ln, dtype=np.uint64).reshape(-1)
        sd[:, 2] = s.device_id
        dd[:, 2] = d.device_id
        srcs.append(sd)
        dsts.append(dd)
        moved = int(length.sum())
        tokens = max(tokens, moved)
        nbytes += moved * n * e
    if not srcs:
        empty = np.empty((0, 3), dtype=np.uint64)
        return Plan(empty, empty, 0, 0, 0)
    src_all = np.concatenate(srcs)
    dst_all = np.concatenate(dsts)
    requested = len(src_all)
    ms, md = merge_adjacent(src_all, dst_all)
    return Plan(ms, md, requested, tokens, nbytes)


def check_block_ids(src_blocks: I64, src_num_blocks: int, dst_blocks: I64, dst_num_blocks: int) -> None:
    if len(src_blocks) and (src_blocks.min() < 0 or src_blocks.max() >= src_num_blocks):
        raise InvalidArgument("source block id out of range")
    if len(dst_blocks) and (dst_blocks.min() < 0 or dst_blocks.max() >= dst_num_blocks):
        raise InvalidArgument("destination block id out of range")

