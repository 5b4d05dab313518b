"""Queued calls (Worker.*_nowait): the engine thread only enqueues; the calls are made in order by
the client's sender thread; a refused call comes back as a FAILED completion with its blocks."""

from __future__ import annotations

from kvpushd_client import CompletionKind
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
        dw.expect_nowait(f"q-{i}", [2 * i, 2 * i + 1], p.peer_address, "prefill", 1)
        pw.publish_nowait(f"q-{i}", [40 + 2 * i, 41 + 2 * i])
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
    dw.expect_nowait("bad", [1, 10**6], p.peer_address, "prefill", 1)   # block out of range
    pw.publish_nowait("dup", [3, 3])                                      # duplicate block ids
    (c,) = drain(dw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "REFUSED" and "INVALID_ARGUMENT" in c.reason
    assert c.transfer_id == "bad" and c.block_ids == (1, 10**6)
    (c,) = drain(pw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "REFUSED" and c.block_ids == (3, 3)
    # queued calls keep their order: an abort queued after an expect ends that expect
    dw.expect_nowait("gone", [5], p.peer_address, "prefill", 1)
    dw.abort_nowait("gone")
    dw.abort_nowait("never-existed")  # no completion, no error
    (c,) = drain(dw, 1)
    assert c.kind is CompletionKind.FAILED and c.code == "ABORTED" and c.transfer_id == "gone"
    assert dw.flush(10)
    assert wait_for(lambda: not d.client.status().transfers)
    # detach waits for queued calls first
    dw.expect_nowait("last", [6], p.peer_address, "prefill", 1)
    dw.detach()


def test_reconnecting_worker_reattaches_after_a_daemon_restart(daemon_pair, kv_pair, workdir) -> None:
    """ReconnectingWorker (the connector's link) on the same queue: refusals come back as REFUSED
    with their blocks; a killed daemon is reported lost once, a restarted one re-attached to."""
    from kvpushd_client import Role
    from kvpushd_client.reconnect import ReconnectingWorker
    from support import start_daemon

    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    rw = ReconnectingWorker(d.sock, dict(engine_id="decode", role=Role.CONSUMER, tp_rank=0, tp_size=1,
                                         memory=[dst.buf.memory], regions=dst.region_list),
                            rpc_timeout_s=5.0, reconnect_interval_s=0.1)
    rw.start(connect_timeout_s=30)
    events: list = []

    def until(pred) -> bool:  # type: ignore[no-untyped-def]
        return wait_for(lambda: events.extend(rw.poll()) or pred(), 30)

    try:
        assert rw.connected and rw.epoch == 1
        bad = rw.expect_nowait("bad", [1, 10**6], p.peer_address, "prefill", 1, tag="mine")
        assert until(lambda: any(e.kind == "refused" for e in events)), events
        (ev,) = [e for e in events if e.kind == "refused"]
        assert ev.call is bad and ev.call.tag == "mine" and ev.epoch == 1
        assert ev.completion.code == "REFUSED" and ev.completion.block_ids == (1, 10**6)
        assert ev.error is not None and ev.error.code == "INVALID_ARGUMENT"
        assert rw.connected  # a refusal is no loss

        rw.expect_nowait("q-1", [2, 3], p.peer_address, "prefill", 1)
        assert rw.flush(20) and wait_for(lambda: "q-1" in {t.transfer_id for t in d.client.status().transfers})
        d.proc.kill()
        d.proc.wait()
        assert until(lambda: any(e.kind == "lost" for e in events))
        assert [e.epoch for e in events if e.kind == "lost"] == [1]
        d.client.close()
        d2 = start_daemon(workdir, "dnode", "[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
        d.proc, d.client = d2.proc, d2.client  # the fixture stops this one
        assert wait_for(lambda: rw.connected, 30) and rw.epoch == 2

        events.clear()
        rw.expect_nowait("q-2", [4, 5], p.peer_address, "prefill", 1)
        pw.publish("q-2", [40, 41])
        assert until(lambda: any(e.kind == "completion" for e in events))
        (c,) = [e for e in events if e.kind == "completion"]
        assert c.epoch == 2 and c.completion.kind is CompletionKind.FINISHED_RECEIVING
        assert (dst.arr[:, 4:6] == src.arr[:, 40:42]).all()
        assert [e.kind for e in events] == ["completion"]
    finally:
        rw.close()
