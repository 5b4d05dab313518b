"""Prefill and decode with different block sizes (tokens per block), skipped prefixes and MLA regions.

Real daemons, real NIXL WRITEs between shared-memory KV caches in vLLM's HND layout
([blocks, heads, tokens, head bytes] per region). Every destination byte is checked: the moved tokens
equal the source's, token by token and head by head, and every other byte is still poison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from kvpushd_client import CompletionKind, Expect, Publish, Region, Role, SealedBuffer
from support import POISON, both_backends, wait_for

R, E, HEADS = 3, 8, 4  # regions, bytes per head and token, KV heads of the whole model


@dataclass
class Cache:
    """One rank's KV: ``arr[region, block, head, token, byte]`` (HND) in one shm object."""

    buf: SealedBuffer
    num_blocks: int
    heads: int
    bs: int
    replicated: bool = False
    arr: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.arr = np.frombuffer(self.buf.mmap, dtype=np.uint8).reshape(R, self.num_blocks, self.heads, self.bs, E)

    @property
    def block_len(self) -> int:
        return self.heads * self.bs * E

    def regions(self, send_heads: bool = True) -> list[Region]:
        return [Region(0, i * self.num_blocks * self.block_len, self.num_blocks, self.block_len,
                       block_size_tokens=self.bs, num_heads=self.heads if send_heads else 0,
                       replicated=self.replicated) for i in range(R)]

    def tokens(self, blocks: list[int], first: int, end: int) -> np.ndarray:
        """[region, head, token, byte] of logical tokens [first, end), ``blocks`` holding token ``first`` on."""
        t = np.arange(first, end) - first
        return self.arr[:, np.asarray(blocks)[t // self.bs], :, t % self.bs, :].transpose(1, 2, 0, 3)

    def close(self) -> None:
        del self.arr
        self.buf.close()


def cache(name: str, num_blocks: int, heads: int, bs: int, fill: str, seed: int = 0, replicated: bool = False) -> Cache:
    buf = SealedBuffer.create(name, R * num_blocks * heads * bs * E)
    c = Cache(buf, num_blocks, heads, bs, replicated)
    if fill == "random":
        c.arr[:] = np.random.default_rng(seed).integers(0, 256, c.arr.shape, dtype=np.uint8)
    else:
        c.arr[:] = POISON
    return c


def run(p, d, p_tp: int, d_tp: int, p_bs: int, d_bs: int, prompt: int, skip: int = 0,  # type: ignore[no-untyped-def]
        mla: bool = False, send_heads: bool = True) -> None:
    heads_p = 1 if mla else HEADS // p_tp
    heads_d = 1 if mla else HEADS // d_tp
    nb = 24
    srcs = [cache(f"kvpushd-bs-p{r}", nb, heads_p, p_bs, "random", seed=r if not mla else 7, replicated=mla)
            for r in range(p_tp)]
    dsts = [cache(f"kvpushd-bs-d{r}", nb, heads_d, d_bs, "poison", replicated=mla) for r in range(d_tp)]
    try:
        pws = [p.client.attach("prefill", Role.PRODUCER, r, p_tp, [s.buf.memory], s.regions(send_heads))
               for r, s in enumerate(srcs)]
        dws = [d.client.attach("decode", Role.CONSUMER, r, d_tp, [k.buf.memory], k.regions())
               for r, k in enumerate(dsts)]
        n_src = -(-prompt // p_bs)
        n_dst = -(-(prompt - skip) // d_bs)
        src_blocks = [5, 2, 9, 10, 11, 0, 3][:n_src]
        dst_blocks = [[17, 4, 5, 6, 1, 12, 13][:n_dst], [20, 21, 3, 2, 8, 9, 7][:n_dst]][:d_tp]
        for w, blocks in zip(dws, dst_blocks, strict=True):
            w.send(Expect("bs", tuple(blocks), p.peer_address, "prefill", p_tp, skip_tokens=skip))
        for w in pws:
            w.send(Publish("bs", tuple(src_blocks)))
        for w in dws:
            c = w.next_completion(30)
            assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
        for w in pws:
            c = w.next_completion(30)
            assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
        end = min(n_src * p_bs, skip + n_dst * d_bs)
        # the whole model's heads for tokens [skip, end), as prefill holds them
        if mla:
            want = srcs[0].tokens(src_blocks, 0, end)[:, :, skip:]
        else:
            want = np.concatenate([s.tokens(src_blocks, 0, end)[:, :, skip:] for s in srcs], axis=1)
        for r, (k, blocks) in enumerate(zip(dsts, dst_blocks, strict=True)):
            got = k.tokens(blocks, skip, end)
            mine = want if mla else want[:, r * heads_d:(r + 1) * heads_d]
            assert np.array_equal(got, mine), f"decode rank {r}: tokens differ"
            # nothing else changed: the written token slots are the only non-poison bytes
            mask = np.ones(k.arr.shape, dtype=bool)
            t = np.arange(end - skip)
            mask[:, np.asarray(blocks)[t // d_bs], :, t % d_bs, :] = False
            assert np.all(k.arr[mask] == POISON), f"decode rank {r}: bytes outside the moved tokens changed"
        writers = max(1, p_tp // d_tp) if not mla else 1
        assert d.client.status().counters.notifications_received == writers * d_tp
        assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    finally:
        for kv in [*srcs, *dsts]:
            kv.close()


CASES = [  # (p_tp, d_tp, p_bs, d_bs, prompt tokens)
    (1, 1, 16, 32, 40),
    (1, 1, 32, 16, 40),
    (1, 1, 8, 24, 50),   # sizes that are not multiples of each other
    (2, 1, 16, 32, 45),
    (1, 2, 32, 16, 45),
    (2, 1, 32, 16, 33),
    (1, 2, 16, 32, 70),
]


@pytest.mark.parametrize(("p_tp", "d_tp", "p_bs", "d_bs", "prompt"), CASES,
                         ids=[f"tp{a}-tp{b}-bs{c}-bs{d}" for a, b, c, d, _ in CASES])
def test_block_sizes_differ(daemon_pair, p_tp: int, d_tp: int, p_bs: int, d_bs: int, prompt: int) -> None:
    run(*daemon_pair, p_tp, d_tp, p_bs, d_bs, prompt)


@both_backends
def test_producer_may_leave_out_its_head_count(daemon_pair) -> None:
    """num_heads on one side is enough: the other's follows from the TP sizes."""
    run(*daemon_pair, 2, 1, 16, 32, 40, send_heads=False)


@pytest.mark.parametrize(("p_bs", "d_bs", "skip"), [(32, 16, 16), (16, 32, 32), (16, 16, 32), (16, 48, 48)])
def test_skip_tokens(daemon_pair, p_bs: int, d_bs: int, skip: int) -> None:
    """Decode already holds the first ``skip`` tokens (prefix-cache hit): only the rest is written."""
    run(*daemon_pair, 1, 1, p_bs, d_bs, 90, skip=skip)


@both_backends
def test_skip_tokens_with_hetero_tp(daemon_pair) -> None:
    run(*daemon_pair, 2, 1, 32, 16, 70, skip=16)


@pytest.mark.parametrize(("p_tp", "d_tp", "p_bs", "d_bs"), [(2, 1, 16, 16), (1, 2, 16, 16), (2, 1, 16, 32),
                                                             (4, 2, 32, 16), (1, 1, 16, 32)])
def test_mla_replicated_regions(daemon_pair, p_tp: int, d_tp: int, p_bs: int, d_bs: int) -> None:
    """One latent per token, the same on every rank: each decode rank gets it once (one notification)."""
    run(*daemon_pair, p_tp, d_tp, p_bs, d_bs, 37, mla=True)


def test_skip_must_be_whole_decode_blocks(daemon_pair) -> None:
    from kvpushd_client import KVPushError

    p, d = daemon_pair
    k = cache("kvpushd-bs-d", 8, 2, 16, "poison")
    try:
        w = d.client.attach("decode", Role.CONSUMER, 0, 1, [k.buf.memory], k.regions())
        with pytest.raises(KVPushError, match="whole number of blocks"):
            w.send(Expect("x", (1,), p.peer_address, "prefill", 1, skip_tokens=8))
    finally:
        k.close()


def test_block_sizes_differ_without_head_counts_fail_clearly(daemon_pair) -> None:
    p, d = daemon_pair
    s = cache("kvpushd-bs-p", 8, 2, 16, "random")
    k = cache("kvpushd-bs-d", 8, 2, 32, "poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [s.buf.memory], s.regions(send_heads=False))
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [k.buf.memory], k.regions(send_heads=False))
        dw.send(Expect("x", (1,), p.peer_address, "prefill", 1))
        pw.send(Publish("x", (2, 3)))
        c = dw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED and "num_heads" in c.reason, c
        c = pw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED
        assert np.all(k.arr == POISON)
    finally:
        s.close()
        k.close()
