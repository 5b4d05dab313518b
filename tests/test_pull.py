"""Pull mode with real daemons: the decode node's daemon READs the prefill blocks (NIXL READ).

Decode registers as in push mode (with mode=pull); once the prefill daemon holds both the
registration and the publish it offers the source blocks to the decode daemon, which READs them
into the blocks its worker registered and notifies the prefill agent; the prefill daemon then
finishes the publish. Every destination byte is checked, and no other destination byte changes.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import POISON, attach_pair, make_kv, wait_for
from kvpushd_client import CompletionKind, Role

R, NB, HALF = 4, 32, 2048


def _settled(p, d) -> bool:  # type: ignore[no-untyped-def]
    return not p.client.status().transfers and not d.client.status().transfers


@pytest.mark.parametrize("order", ["expect_first", "publish_first"])
def test_pull_moves_bytes_exactly(daemon_pair, kv_pair, order: str) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    src_blocks, dst_blocks = [3, 4, 5, 9, 10], [40, 41, 2, 17, 18]
    if order == "expect_first":
        dw.expect("pull-1", dst_blocks, p.peer_address, "prefill", 1, transfer_mode="pull")
        pw.publish("pull-1", src_blocks)
    else:
        pw.publish("pull-1", src_blocks)
        dw.expect("pull-1", dst_blocks, p.peer_address, "prefill", 1, transfer_mode="pull")
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    c = pw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
    assert np.array_equal(dst.arr[:, dst_blocks, :], src.arr[:, src_blocks, :])
    others = [b for b in range(dst.num_blocks) if b not in dst_blocks]
    assert np.all(dst.arr[:, others, :] == POISON)
    dc, pc = d.client.status().counters, p.client.status().counters
    assert dc.reads_posted == 1 and dc.bytes_read == len(dst_blocks) * dst.regions * dst.block_len
    assert pc.writes_posted == 0 and dc.notifications_received == 0
    assert wait_for(lambda: _settled(p, d))
