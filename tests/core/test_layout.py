"""core/layout.py: token mapping between different block sizes, layouts, TP slices and skipped prefixes.

Every plan is checked against a naive reference that copies one (token, head) at a time with its
own address arithmetic, by applying both to byte arrays and comparing the results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpushd.core.errors import InvalidArgument
from kvpushd.core.layout import HND, NHD, merge_adjacent, plan_write, token_runs
from kvpushd.core.topology import block_parts, consumer_targets


@dataclass(frozen=True)
class G:
    addr: int
    block_len: int
    block_stride: int
    device_id: int = 0
    block_tokens: int = 0
    num_heads: int = 0
    layout: int = HND
    replicated: bool = False


def where(layout: int, heads: int, bs: int, e: int, blk: int, off: int, head: int, g: G) -> int:
    """Naive byte address of (block, token offset, head), written independently of the module."""
    if layout == NHD:
        return g.addr + blk * g.block_stride + (off * heads + head) * e
    return g.addr + blk * g.block_stride + (head * bs + off) * e


def naive(src_mem: np.ndarray, dst_mem: np.ndarray, src: list[G], dst: list[G], sb: list[int], db: list[int],
          skip: int, hs: int, hd: int, bs_s: int, bs_d: int, e: int, first_s: int, first_d: int, n: int,
          skip_replicated: bool = False) -> int:
    end = min(len(sb) * bs_s, skip + len(db) * bs_d)
    moved = 0
    for s, d in zip(src, dst, strict=True):
        if s.replicated and skip_replicated:
            continue
        rn, rfs, rfd, rhs, rhd = (1, 0, 0, 1, 1) if s.replicated else (n, first_s, first_d, hs, hd)
        re = e
        for t in range(skip, end):
            for j in range(rn):
                a = where(s.layout if not s.replicated else HND, rhs, bs_s, re, sb[t // bs_s], t % bs_s, rfs + j, s)
                u = t - skip
                b = where(d.layout if not d.replicated else HND, rhd, bs_d, re, db[u // bs_d], u % bs_d, rfd + j, d)
                dst_mem[b:b + re] = src_mem[a:a + re]
                moved += re
    return moved


def apply(plan, src_mem: np.ndarray, dst_mem: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    for (a, ln, _), (b, ln2, _) in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
        assert ln == ln2
        dst_mem[b:b + ln] = src_mem[a:a + ln]


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    total_heads = draw(st.sampled_from([2, 4, 8]))
    p_tp = draw(st.sampled_from([t for t in (1, 2, 4) if total_heads % t == 0]))
    d_tp = draw(st.sampled_from([t for t in (1, 2, 4) if total_heads % t == 0]))
    p_rank = draw(st.integers(0, p_tp - 1))
    c_rank = draw(st.sampled_from(list(consumer_targets(p_rank, p_tp, d_tp))))
    sp, dp = block_parts(p_rank, p_tp, c_rank, d_tp)
    hs, hd = total_heads // p_tp, total_heads // d_tp
    n = hs // sp[0]
    bs_s = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    bs_d = draw(st.sampled_from([1, 2, 4, 6, 8, 16, 32]))
    e = draw(st.sampled_from([1, 2, 4]))
    lay_s = draw(st.sampled_from([HND, NHD, 0]))
    lay_d = draw(st.sampled_from([HND, NHD]))
    nreg = draw(st.integers(1, 3))
    replicated = [draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else False for _ in range(nreg)]
    tokens = draw(st.integers(1, 70))
    skip = bs_d * draw(st.integers(0, (tokens - 1) // bs_d))
    ns, nd = -(-tokens // bs_s), -(-(tokens - skip) // bs_d)
    nb_s, nb_d = ns + draw(st.integers(0, 5)), nd + draw(st.integers(0, 5))
    sb = draw(st.permutations(range(nb_s)))[:ns]
    db = draw(st.permutations(range(nb_d)))[:nd]
    pad_s, pad_d = draw(st.sampled_from([0, 0, 8])), draw(st.sampled_from([0, 0, 4]))
    # a side may leave its block size or head count out (0): the other side's is used
    hide = draw(st.sampled_from(["none", "none", "src_bs", "dst_bs", "src_heads", "dst_heads"]))
    if hide == "src_bs" and bs_s != bs_d:
        hide = "none"
    if hide == "dst_bs" and bs_s != bs_d:
        hide = "none"
    src, dst = [], []
    a_s = a_d = 0
    for r in range(nreg):
        rep = replicated[r]
        bl_s = (1 if rep else hs) * bs_s * e
        bl_d = (1 if rep else hd) * bs_d * e
        src.append(G(a_s, bl_s, bl_s + pad_s, 0, 0 if hide == "src_bs" else bs_s,
                     0 if hide == "src_heads" or rep else hs, lay_s, rep))
        dst.append(G(a_d, bl_d, bl_d + pad_d, 0, 0 if hide == "dst_bs" else bs_d,
                     0 if hide == "dst_heads" or rep else hd, lay_d, rep))
        a_s += nb_s * (bl_s + pad_s) + 16
        a_d += nb_d * (bl_d + pad_d) + 16
    skip_rep = draw(st.booleans())
    return dict(src=src, dst=dst, sb=list(sb), db=list(db), skip=skip, sp=sp, dp=dp, hs=hs, hd=hd, bs_s=bs_s,
                bs_d=bs_d, e=e, n=n, size_s=a_s, size_d=a_d, skip_rep=skip_rep)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_plan_matches_naive_per_token_copy(c) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    src_mem = rng.integers(0, 256, c["size_s"], dtype=np.uint8)
    want = np.full(c["size_d"], 0xA5, dtype=np.uint8)
    got = want.copy()
    first_s, first_d = c["sp"][1] * c["n"], c["dp"][1] * c["n"]
    moved = naive(src_mem, want, c["src"], c["dst"], c["sb"], c["db"], c["skip"], c["hs"], c["hd"], c["bs_s"],
                  c["bs_d"], c["e"], first_s, first_d, c["n"], c["skip_rep"])
    plan = plan_write(c["src"], c["dst"], c["sb"], c["db"], c["skip"], c["sp"], c["dp"], c["skip_rep"])
    apply(plan, src_mem, got)
    assert np.array_equal(got, want)
    assert plan.nbytes == moved == int(plan.src[:, 1].sum())
    assert len(plan.src) <= plan.requested
    # merged: no descriptor continues the previous one on both sides
    if len(plan.src) > 1:
        cont = ((plan.src[:-1, 0] + plan.src[:-1, 1] == plan.src[1:, 0])
                & (plan.dst[:-1, 0] + plan.dst[:-1, 1] == plan.dst[1:, 0]))
        assert not cont.any()


def test_token_runs() -> None:
    start, length = token_runs(3, 16, 2, 32, 0)  # 48 tokens of P16 into D32: one run per source block
    assert start.tolist() == [0, 16, 32] and length.tolist() == [16, 16, 16]
    start, length = token_runs(2, 32, 3, 16, 0)  # P32 -> D16: min(64, 48) tokens
    assert start.tolist() == [0, 16, 32] and length.tolist() == [16, 16, 16]
    start, length = token_runs(3, 16, 1, 32, 16)  # skip 16 (one D16... here one half of a P32 block)
    assert start.tolist() == [16, 32] and length.tolist() == [16, 16]
    start, length = token_runs(2, 6, 3, 4, 4)  # unaligned sizes: cuts at 6 and 4 + 4k
    assert start.tolist() == [4, 6, 8] and length.tolist() == [2, 2, 4]


def test_equal_sizes_merge_to_whole_blocks() -> None:
    """P16 -> D16 HND, blocks in runs: one descriptor per run of blocks per region, like the prepped path."""
    h, bs, e = 4, 16, 8
    bl = h * bs * e
    src = [G(i * 100 * bl, bl, bl, 0, bs, h) for i in range(2)]
    dst = [G(i * 100 * bl, bl, bl, 0, bs, h) for i in range(2)]
    plan = plan_write(src, dst, [3, 4, 5, 9], [10, 11, 12, 20])
    assert len(plan.src) == 4 and plan.requested == 2 * 4 * h
    assert plan.src[:, 1].tolist() == [3 * bl, bl, 3 * bl, bl]


def test_unknown_block_size_and_heads_is_the_old_whole_block_mapping() -> None:
    bl = 4096
    src = [G(0, bl, bl), G(1 << 20, bl, bl)]
    dst = [G(0, 2 * bl, 2 * bl), G(1 << 20, 2 * bl, 2 * bl)]
    plan = plan_write(src, dst, [1, 2], [5, 9], 0, (1, 0), (2, 1))  # P TP2 rank 1 -> D TP1
    assert plan.src[:, 0].tolist() == [bl, 2 * bl, (1 << 20) + bl, (1 << 20) + 2 * bl]
    assert plan.src[:, 1].tolist() == [bl] * 4
    assert plan.dst[:, 0].tolist() == [5 * 2 * bl + bl, 9 * 2 * bl + bl, (1 << 20) + 5 * 2 * bl + bl,
                                       (1 << 20) + 9 * 2 * bl + bl]


def test_refusals() -> None:
    g16 = G(0, 4 * 16 * 2, 4 * 16 * 2, 0, 16, 4)
    with pytest.raises(InvalidArgument, match="regions"):
        plan_write([g16], [g16, g16], [0], [0])
    with pytest.raises(InvalidArgument, match="whole number of decode blocks"):
        plan_write([g16], [g16], [0, 1], [0], skip_tokens=8)
    with pytest.raises(InvalidArgument, match="num_heads is needed"):
        plan_write([G(0, 512, 512, 0, 16)], [G(0, 512, 512, 0, 32)], [0, 1], [0])
    with pytest.raises(InvalidArgument, match="layout mismatch"):
        plan_write([g16], [G(0, 4 * 32 * 4, 4 * 32 * 4, 0, 32, 4)], [0, 1], [0])  # head bytes differ
    with pytest.raises(InvalidArgument, match="nothing to move"):
        plan_write([g16], [g16], [0], [1, 2], skip_tokens=16)
    with pytest.raises(InvalidArgument, match="replicated"):
        plan_write([g16], [G(0, 128, 128, 0, 16, 4, HND, True)], [0], [0])


def test_merge_adjacent() -> None:
    s = np.array([[0, 4, 0], [4, 4, 0], [8, 4, 0], [20, 4, 0]], dtype=np.uint64)
    d = np.array([[100, 4, 0], [104, 4, 0], [200, 4, 0], [204, 4, 0]], dtype=np.uint64)
    ms, md = merge_adjacent(s, d)
    assert ms.tolist() == [[0, 8, 0], [8, 4, 0], [20, 4, 0]]
    assert md.tolist() == [[100, 8, 0], [200, 4, 0], [204, 4, 0]]


def test_large_request_builds_quickly() -> None:
    """16k tokens x 128 regions x 8 heads, P16 -> D32: about a million descriptors, no Python loop.

    Prints the time; asserts only the counts (no timed asserts)."""
    h, e, nb = 8, 256, 1100
    regs = 128
    src = [G(i * nb * h * 16 * e, h * 16 * e, h * 16 * e, 0, 16, h) for i in range(regs)]
    dst = [G(i * nb * h * 32 * e, h * 32 * e, h * 32 * e, 0, 32, h) for i in range(regs)]
    t0 = time.perf_counter()
    plan = plan_write(src, dst, np.arange(1024), np.arange(512))
    dt = time.perf_counter() - t0
    print(f"plan of {plan.requested} descriptors ({len(plan.src)} after merging) in {dt * 1e3:.0f} ms")
    assert plan.requested == regs * h * 1024 and plan.tokens == 16384
    assert plan.nbytes == regs * 16384 * h * e


def _nhd_case(p_tp: int, d_tp: int, layout_said: bool) -> tuple[bool, int]:
    """All heads of a tokens-first ([tokens, heads, head bytes]) KV split over P TP p_tp and D TP d_tp:
    every WRITE planned as the daemon plans it. -> (decode's bytes equal the logical KV, WRITEs)."""
    heads, bs, e, nb = 4, 8, 4, 6
    rng = np.random.default_rng(1)
    kv = rng.integers(0, 256, (nb, bs, heads, e), dtype=np.uint8)  # one logical block table, all heads
    hp, hd = heads // p_tp, heads // d_tp
    p_mem = [np.ascontiguousarray(kv[:, :, r * hp:(r + 1) * hp]).reshape(-1) for r in range(p_tp)]
    d_mem = [np.zeros(nb * bs * hd * e, dtype=np.uint8) for _ in range(d_tp)]
    lay = NHD if layout_said else 0
    src = [G(0, hp * bs * e, hp * bs * e, 0, bs, hp if layout_said else 0, lay)]
    dst = [G(0, hd * bs * e, hd * bs * e, 0, bs, hd if layout_said else 0, lay)]
    blocks = [0, 1, 2, 3, 4, 5]
    writes = 0
    for pr in range(p_tp):
        for cr in consumer_targets(pr, p_tp, d_tp):
            sp, dp = block_parts(pr, p_tp, cr, d_tp)
            apply(plan_write(src, dst, blocks, blocks, 0, sp, dp), p_mem[pr], d_mem[cr])
            writes += 1
    ok = all(np.array_equal(d_mem[r].reshape(nb, bs, hd, e), kv[:, :, r * hd:(r + 1) * hd]) for r in range(d_tp))
    return ok, writes


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (1, 1)])
def test_tokens_first_layout_across_tp_sizes_moves_exact_bytes(p_tp: int, d_tp: int) -> None:
    """What KVPushdConnector states (NHD, heads per rank, block size) splits blocks by heads right."""
    ok, writes = _nhd_case(p_tp, d_tp, layout_said=True)
    assert ok and writes == max(p_tp, d_tp)


def test_tokens_first_layout_not_said_is_split_as_heads_first() -> None:
    """Why the layout must be said: unsaid, a block is split as heads-first (the daemon's default for
    older clients), and a tokens-first block reaches decode scrambled."""
    assert _nhd_case(2, 1, layout_said=False)[0] is False
    assert _nhd_case(1, 1, layout_said=False)[0] is True  # same TP: whole blocks, any layout


def test_tokens_first_layout_without_heads_is_refused() -> None:
    """NHD said but not the head count: no split can be planned, the pair is refused."""
    bl = 4 * 8 * 4
    src = [G(0, bl // 2, bl // 2, 0, 8, 0, NHD)]
    dst = [G(0, bl, bl, 0, 8, 0, NHD)]
    with pytest.raises(InvalidArgument, match="num_heads is needed"):
        plan_write(src, dst, [0], [0], 0, (1, 0), (2, 0))
