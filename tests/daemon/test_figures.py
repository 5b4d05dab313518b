"""Completions carry the figures of their transfer, from the daemons (push and pull)."""

from __future__ import annotations

from kvpushd_client import Abort, CompletionKind, Expect, Publish, TransferMode
from support import attach_pair


def test_push_figures(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("fig-push", (10, 11, 12, 20), p.peer_address, "prefill", 1))
    pw.send(Publish("fig-push", (1, 2, 3, 40)))
    r = dw.next_completion(20)
    s = pw.next_completion(20)
    assert r is not None and r.kind is CompletionKind.FINISHED_RECEIVING
    assert s is not None and s.kind is CompletionKind.FINISHED_SENDING
    moved = 4 * src.regions * src.block_len  # 4 blocks in each of the regions
    # prefill daemon: it posted the WRITE, so it knows all of it
    fs = s.figures
    assert fs is not None
    assert fs.nbytes == moved and fs.nixl_transfers == 1
    # blocks 1,2,3 are adjacent on both sides (10,11,12): 2 runs per region
    assert fs.descriptors == 2 * src.regions
    assert fs.post_s > 0 and fs.transfer_s > 0 and fs.elapsed_s > 0
    assert fs.rendezvous_wait_s > 0  # the registration came first, then the publish
    # decode daemon: it knows what landed in its blocks and how long it waited, not the WRITE's figures
    fr = r.figures
    assert fr is not None
    assert fr.nbytes == moved and fr.nixl_transfers == 0 and fr.descriptors == 0
    assert fr.post_s == 0 and fr.transfer_s == 0 and fr.rendezvous_wait_s == 0
    assert fr.elapsed_s > 0
    pw.detach()
    dw.detach()


def test_pull_figures(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    pw.send(Publish("fig-pull", (5, 9)))
    dw.send(Expect("fig-pull", (30, 31), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
    r = dw.next_completion(20)
    s = pw.next_completion(20)
    assert r is not None and r.kind is CompletionKind.FINISHED_RECEIVING
    assert s is not None and s.kind is CompletionKind.FINISHED_SENDING
    moved = 2 * src.regions * src.block_len
    fr = r.figures  # decode daemon posted the READ
    assert fr is not None and fr.nbytes == moved and fr.nixl_transfers == 1
    assert fr.descriptors == 2 * src.regions  # 5 and 9 are not adjacent
    assert fr.transfer_s > 0 and fr.elapsed_s > 0
    fs = s.figures  # prefill daemon: only that its blocks were read
    assert fs is not None and fs.nixl_transfers == 0 and fs.elapsed_s > 0
    pw.detach()
    dw.detach()


def test_failed_completion_has_figures(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("fig-abort", (1, 2), p.peer_address, "prefill", 1))
    assert dw.send(Abort("fig-abort"))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "ABORTED"
    assert c.figures is not None and c.figures.nbytes == 0 and c.figures.elapsed_s > 0
    pw.detach()
    dw.detach()
