"""ReconnectingStreamWorker (the vLLM connector's link on the worker stream): a step's commands reach the
daemon as one CommandBatch (the daemon counts them per worker), a refusal comes back as a REFUSED
completion on its attachment, a killed daemon is reported lost once, a command made meanwhile is refused
at once, and a restarted daemon is re-attached to and serves new requests."""

from __future__ import annotations

from kvpushd_client import Abort, CompletionKind, Expect, Publish, Role
from support import start_daemon, wait_for


def counts(d, engine: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    (w,) = [w for w in d.client.status().workers if w.engine_id == engine]
    return w.command_batches, w.stream_commands


def test_stream_link_batches_per_step_and_reattaches(daemon_pair, kv_pair, workdir) -> None:
    from kvpushd_client.reconnect import ReconnectingStreamWorker

    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    rs = ReconnectingStreamWorker(d.sock, dict(engine_id="decode", role=Role.CONSUMER, tp_rank=0, tp_size=1,
                                               memory=[dst.buf.memory], regions=dst.region_list),
                                  rpc_timeout_s=5.0, reconnect_interval_s=0.1)
    rs.start(connect_timeout_s=30)
    events: list = []

    def until(pred) -> bool:  # type: ignore[no-untyped-def]
        return wait_for(lambda: events.extend(rs.poll()) or pred(), 30)

    try:
        assert rs.connected and rs.epoch == 1
        assert counts(d, "decode") == (0, 0)
        # One step: three Expects and a bad one, one message.
        calls = [rs.send_nowait(Expect(f"s-{i}", (2 * i, 2 * i + 1), p.peer_address, "prefill", 1)) for i in range(3)]
        bad = rs.send_nowait(Expect("bad", (1, 10**6), p.peer_address, "prefill", 1), tag="mine")
        assert rs.step() == 4 and rs.flush(20)
        assert [c.epoch for c in (*calls, bad)] == [1] * 4
        assert counts(d, "decode") == (1, 4)
        assert until(lambda: any(e.kind == "completion" for e in events)), events
        (ev,) = [e for e in events if e.kind == "completion"]
        assert ev.epoch == 1 and ev.completion.kind is CompletionKind.FAILED and ev.completion.code == "REFUSED"
        assert ev.completion.transfer_id == "bad" and ev.completion.block_ids == (1, 10**6)
        assert "INVALID_ARGUMENT" in ev.completion.reason and rs.connected  # a refusal is no loss
        # A second step with an Abort for one of them: one more batch.
        rs.send_nowait(Abort("s-2"), only_epoch=1)
        rs.send_nowait(Abort("s-1"), only_epoch=7)  # another attachment's: dropped, never sent
        assert rs.step() == 1 and rs.flush(20)
        assert counts(d, "decode") == (2, 5)
        assert rs.step() == 0 and counts(d, "decode") == (2, 5)  # an empty step sends nothing

        assert wait_for(lambda: {"s-0", "s-1"} <= {t.transfer_id for t in d.client.status().transfers})
        events.clear()
        d.proc.kill()
        d.proc.wait()
        assert until(lambda: any(e.kind == "lost" for e in events))
        assert [e.epoch for e in events if e.kind == "lost"] == [1]
        late = rs.send_nowait(Expect("late", (9,), p.peer_address, "prefill", 1), tag="t")  # not attached
        assert until(lambda: any(e.kind == "refused" for e in events))
        (ref,) = [e for e in events if e.kind == "refused"]
        assert ref.call is late and ref.epoch is None and late.epoch is None
        assert ref.error is not None and ref.error.code == "UNAVAILABLE" and ref.completion.block_ids == (9,)
        assert rs.step() == 0
        d.client.close()
        d2 = start_daemon(workdir, "dnode", "[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
        d.proc, d.client = d2.proc, d2.client  # the fixture stops this one
        assert wait_for(lambda: rs.connected, 30) and rs.epoch == 2
        assert [e.kind for e in events if e.kind == "lost"] == ["lost"]  # lost once, whatever came after

        events.clear()
        rs.send_nowait(Expect("s-new", (4, 5), p.peer_address, "prefill", 1))
        assert rs.step() == 1
        assert wait_for(lambda: "s-new" in {t.transfer_id for t in d.client.status().transfers})
        pw.send(Publish("s-new", (40, 41)))
        assert until(lambda: any(e.kind == "completion" for e in events))
        (c,) = [e for e in events if e.kind == "completion"]
        assert c.epoch == 2 and c.completion.kind is CompletionKind.FINISHED_RECEIVING
        assert (dst.arr[:, 4:6] == src.arr[:, 40:42]).all()
        assert [e.kind for e in events] == ["completion"]
        assert counts(d, "decode") == (1, 1)
    finally:
        rs.close()
        pw.detach()


def test_call_and_wait_rides_the_stream(daemon_pair, kv_pair) -> None:
    """The call-and-wait forms (for tools) are commands on the worker's stream, one batch each."""
    from support import attach_pair

    p, d = daemon_pair
    src, dst = kv_pair
    _, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("u-1", (1,), p.peer_address, "prefill", 1))
    assert dw.send(Abort("u-1")) and not dw.send(Abort("u-1"))  # found, then not
    assert counts(d, "decode") == (3, 3)


def test_commands_stepped_after_the_stream_died_are_refused(daemon_pair, kv_pair, workdir) -> None:
    """StreamWorker: a step after the daemon went away still ends every command (REFUSED, with its
    blocks), none is left waiting for an answer that cannot come."""
    p, d = daemon_pair
    _, dst = kv_pair
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send_nowait(Expect("before", (1,), p.peer_address, "prefill", 1))
    assert dw.flush(20)
    d.proc.kill()
    d.proc.wait()
    assert wait_for(lambda: not dw.alive, 30)
    dw.send_nowait(Expect("after-1", (2, 3), p.peer_address, "prefill", 1))
    dw.send_nowait(Abort("after-1"))  # an abort ends nothing of its own
    dw.send_nowait(Expect("after-2", (4,), p.peer_address, "prefill", 1))
    assert dw.step() == 3 and dw.flush(5)
    got = dw.completions()
    assert [(c.transfer_id, c.kind, c.code, c.block_ids) for c in got] == [
        ("after-1", CompletionKind.FAILED, "REFUSED", (2, 3)), ("after-2", CompletionKind.FAILED, "REFUSED", (4,))]
    dw.detach()
    d.client.close()
    d2 = start_daemon(workdir, "dnode")
    d.proc, d.client = d2.proc, d2.client  # the fixture stops this one


def test_the_link_hands_over_its_own_descriptors_whatever_the_caller_closed(daemon_pair, kv_pair, workdir) -> None:
    """A caller that closes its memfd and its doorbell page's descriptor once the link started, the
    numbers then naming other memfds: the link re-attaches to a restarted daemon with its own copies.
    Had it handed over whatever the numbers named then, the daemon would have written the next transfer
    there, and the other page would already be a worker's doorbell (a second worker's attach with it
    refused)."""
    import mmap
    import os

    from kvpushd_client import MemfdMemory
    from kvpushd_client.doorbell import SIZE as PAGE
    from kvpushd_client.doorbell import Doorbell
    from kvpushd_client.reconnect import ReconnectingStreamWorker
    from kvpushd_client.shm import sealed_memfd

    p, d = daemon_pair
    src, dst = kv_pair
    size = dst.buf.memory.size
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    mine = os.dup(dst.buf.fd)  # the caller's descriptor of its KV
    bell = Doorbell()
    rs = ReconnectingStreamWorker(d.sock, dict(engine_id="decode", role=Role.CONSUMER, tp_rank=0, tp_size=1,
                                               memory=[MemfdMemory(mine, size)], regions=dst.region_list,
                                               doorbell=bell), rpc_timeout_s=5.0, reconnect_interval_s=0.1)
    rs.start(connect_timeout_s=30)
    other, other_page = sealed_memfd("other", size), sealed_memfd("other-page", PAGE)
    view = mmap.mmap(other, size)
    events: list = []
    try:
        os.dup2(other, mine)  # the caller closed its descriptors, and the numbers now name other memfds
        os.dup2(other_page, bell.fd)
        d.proc.kill()
        d.proc.wait()
        d.client.close()
        d2 = start_daemon(workdir, "dnode", "[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n")
        d.proc, d.client = d2.proc, d2.client  # the fixture stops this one
        assert wait_for(lambda: rs.connected and rs.epoch == 2, 30)
        rs.send_nowait(Expect("after", (4, 5), p.peer_address, "prefill", 1))
        assert rs.step() == 1
        assert wait_for(lambda: "after" in {t.transfer_id for t in d.client.status().transfers})
        pw.send(Publish("after", (40, 41)))
        assert wait_for(lambda: events.extend(rs.poll()) or any(e.kind == "completion" for e in events), 30)
        (c,) = [e.completion for e in events if e.kind == "completion"]
        assert c.kind is CompletionKind.FINISHED_RECEIVING, c
        landed = {"KV": bool((dst.arr[:, 4:6] == src.arr[:, 40:42]).all()), "not in the other KV memfd":
                  view[:] == bytes(size)}
        assert all(landed.values()), landed
        # bell.fd now names the other page: free, so another worker may ring it
        d.client.attach("decode-2", Role.CONSUMER, 0, 1, [MemfdMemory(other, size)], dst.region_list,
                        doorbell=bell).detach()
    finally:
        rs.close()
        pw.detach()
        view.close()
        bell.close()
        for fd in (other, other_page, mine):
            os.close(fd)
