"""Heterogeneous TP between prefill and decode (vLLM's HND layout): heads split or gathered per rank.

In HND a block holds (heads, tokens, head dim), so with P TP2 -> D TP1 decode's block is prefill
rank 0's block followed by rank 1's; with P TP1 -> D TP2 each decode rank takes one half of the
prefill block. Every rank's destination blocks are checked bit for bit.
"""

from __future__ import annotations

import numpy as np
from kvpushd_client import CompletionKind, Expect, Publish, Role
from support import POISON, both_backends, make_kv, wait_for

R, NB, HALF = 4, 32, 2048


@both_backends
def test_prefill_tp2_to_decode_tp1(daemon_pair) -> None:
    p, d = daemon_pair
    srcs = [make_kv(f"kvpushd-test-p{r}", regions=R, num_blocks=NB, block_len=HALF, seed=r) for r in range(2)]
    dst = make_kv("kvpushd-test-d", regions=R, num_blocks=NB, block_len=2 * HALF, fill="poison")
    try:
        pws = [p.client.attach("prefill", Role.PRODUCER, r, 2, [s.buf.memory], s.region_list)
               for r, s in enumerate(srcs)]
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        src_blocks, dst_blocks = [3, 4, 9], [20, 21, 5]
        dw.send(Expect("tp21", tuple(dst_blocks), p.peer_address, "prefill", 2))
        for w in pws:
            w.send(Publish("tp21", tuple(src_blocks)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        for w in pws:
            assert w.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        got = dst.arr[:, dst_blocks, :]
        for r in range(2):
            assert np.array_equal(got[:, :, r * HALF:(r + 1) * HALF], srcs[r].arr[:, src_blocks, :])
        others = [b for b in range(NB) if b not in dst_blocks]
        assert np.all(dst.arr[:, others, :] == POISON)
        assert d.client.status().counters.notifications_received == 2  # one per producer rank
        assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    finally:
        for kv in [*srcs, dst]:
            kv.close()


@both_backends
def test_prefill_tp1_to_decode_tp2(daemon_pair) -> None:
    p, d = daemon_pair
    src = make_kv("kvpushd-test-p", regions=R, num_blocks=NB, block_len=2 * HALF)
    dsts = [make_kv(f"kvpushd-test-d{r}", regions=R, num_blocks=NB, block_len=HALF, fill="poison") for r in range(2)]
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dws = [d.client.attach("decode", Role.CONSUMER, r, 2, [k.buf.memory], k.region_list)
               for r, k in enumerate(dsts)]
        src_blocks = [1, 2, 3, 4]
        dst_blocks = [[7, 8, 9, 10], [30, 0, 12, 13]]  # each decode rank allocates its own blocks
        pw.send(Publish("tp12", tuple(src_blocks)))
        for w, blocks in zip(dws, dst_blocks, strict=True):
            w.send(Expect("tp12", tuple(blocks), p.peer_address, "prefill", 1))
        for w in dws:
            assert w.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        # prefill is done only once both decode ranks have their half
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        for r, (k, blocks) in enumerate(zip(dsts, dst_blocks, strict=True)):
            assert np.array_equal(k.arr[:, blocks, :], src.arr[:, src_blocks, r * HALF:(r + 1) * HALF])
            others = [b for b in range(NB) if b not in blocks]
            assert np.all(k.arr[:, others, :] == POISON)
        assert p.client.status().counters.writes_posted == 2  # one WRITE per decode rank
    finally:
        for kv in [src, *dsts]:
            kv.close()


def test_tp_layouts_that_do_not_fit_fail_clearly(daemon_pair) -> None:
    p, d = daemon_pair
    srcs = [make_kv(f"kvpushd-test-p{r}", regions=R, num_blocks=NB, block_len=HALF) for r in range(2)]
    dst = make_kv("kvpushd-test-d", regions=R, num_blocks=NB, block_len=HALF, fill="poison")  # should be 2x
    try:
        pws = [p.client.attach("prefill", Role.PRODUCER, r, 2, [s.buf.memory], s.region_list)
               for r, s in enumerate(srcs)]
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send(Expect("bad", (1,), p.peer_address, "prefill", 2))
        for w in pws:
            w.send(Publish("bad", (1,)))
        c = dw.next_completion(20)
        assert c.kind is CompletionKind.FAILED and "layout mismatch" in c.reason
        for w in pws:
            assert w.next_completion(20).kind is CompletionKind.FAILED
        assert np.all(dst.arr == POISON)
    finally:
        for kv in [*srcs, dst]:
            kv.close()
