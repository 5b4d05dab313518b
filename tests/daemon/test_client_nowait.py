"""Queued commands (StreamWorker.*_nowait): the engine thread only appends; ``step()`` sends them in
order; a refused command comes back as a FAILED completion with its blocks."""

from __future__ import annotations

from kvpushd_client import Abort, CompletionKind, Expect, Publish
from support import attach_pair, wait_for


def drain(w, n: int, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    got = []
    assert wait_for(lambda: got.extend(w.completions()) or len(got) >= n, timeout), got
    return got


def test_queued_calls_move_exact_bytes(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    for i in range(8):
        dw.send_nowait(Expect(f"q-{i}", (2 * i, 2 * i + 1), p.peer_address, "prefill", 1))
        pw.send_nowait(Publish(f"q-{i}", (40 + 2 * i, 41 + 2 * i)))
    assert dw.flush(20) and pw.flush(20)
    recv = drain(dw, 8)
    sent = drain(pw, 8)
    assert {c.kind for c in recv} == {CompletionKind.FINISHED_RECEIVING}
    assert {c.kind for c in sent} == {CompletionKind.FINISHED_SENDING}
    assert (dst.arr[:, 0:16] == src.arr[:, 40:56]).all()


def test_refused_call_becomes_failed_completion(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send_nowait(Expect("bad", (1, 10**6), p.peer_address, "prefill", 1))   # block out of range
    pw.send_nowait(Publish("dup", (3, 3)))                                      # duplicate block ids
    assert dw.step() == 1 and pw.step() == 1
    (c,) = drain(dw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "REFUSED" and "INVALID_ARGUMENT" in c.reason
    assert c.transfer_id == "bad" and c.block_ids == (1, 10**6)
    (c,) = drain(pw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "REFUSED" and c.block_ids == (3, 3)
    # queued calls keep their order: an abort queued after an expect ends that expect
    dw.send_nowait(Expect("gone", (5,), p.peer_address, "prefill", 1))
    dw.send_nowait(Abort("gone"))
    dw.send_nowait(Abort("never-existed"))  # no completion, no error
    assert dw.step() == 3
    (c,) = drain(dw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "ABORTED" and c.transfer_id == "gone"
    assert dw.flush(10)
    assert wait_for(lambda: not d.client.status().transfers)
    # detach sends the step and waits for its answers first
    dw.send_nowait(Expect("last", (6,), p.peer_address, "prefill", 1))
    dw.detach()
