"""Decline: a decode worker whose Expect never reached its daemon (the daemon was down or refused it)
says so once attached, and the prefill daemon frees the transfer's source blocks at once instead of
holding them for publish_timeout_s (120 s by default, 20 s in these fixtures). Real daemons, real NIXL."""

from __future__ import annotations

import signal
import time

import pytest
from kvpushd_client import CompletionKind, Decline, Expect, KVPushError, Publish, Role
from kvpushd_client.reconnect import ReconnectingStreamWorker
from support import wait_for

LONG = "[transfer]\npublish_timeout_s = 300.0\nexpect_timeout_s = 300.0\n"


def _failed_soon(w, tid: str, within_s: float = 10.0):  # type: ignore[no-untyped-def]
    """The completion ``w`` gets for ``tid`` within ``within_s`` (far below the 300 s publish timeout)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        c = w.next_completion(0.2)
        if c is not None and c.transfer_id == tid:
            return c
    return None


def test_decline_fails_a_waiting_publish_at_once(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_factory.pair(LONG)
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    pw.send(Publish("t1", (1, 2, 3)))
    assert wait_for(lambda: any(t.transfer_id == "t1" for t in p.client.status().transfers))
    dw.send(Decline("t1", p.peer_address, "prefill", "its Expect was refused"))
    c = _failed_soon(pw, "t1")
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "ABORTED"
    assert "declined" in c.reason and "its Expect was refused" in c.reason
    assert tuple(c.block_ids) == (1, 2, 3)
    assert wait_for(lambda: not p.client.status().transfers)
    # the same transfer id published again within publish_timeout_s fails at once (remembered)
    pw.send(Publish("t1", (4,)))
    c = _failed_soon(pw, "t1")
    assert c is not None and c.kind is CompletionKind.FAILED and "declined" in c.reason
    # other transfers are untouched: a normal one still moves its bytes
    dw.send(Expect("t2", (5, 6), p.peer_address, "prefill", 1))
    pw.send(Publish("t2", (7, 8)))
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING
    assert (dst.arr[:, [5, 6]] == src.arr[:, [7, 8]]).all()
    pw.detach()
    dw.detach()
    daemon_factory.close(check=(p, d))


def test_decline_before_publish_and_over_the_stream(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_factory.pair(LONG + '[metrics]\nlisten = "127.0.0.1:0"\n')
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send_nowait(Decline("early", p.peer_address, "prefill", "decode daemon was restarting"))
    dw.step()
    assert dw.flush(20)
    assert wait_for(lambda: _declines(p) >= 1, 10)
    pw.send_nowait(Publish("early", (9, 10)))
    pw.step()
    c = _failed_soon(pw, "early")
    assert c is not None and c.kind is CompletionKind.FAILED and "decode daemon was restarting" in c.reason
    pw.detach()
    dw.detach()


def _declines(p) -> int:  # type: ignore[no-untyped-def]
    """Transfers the prefill daemon was told were declined (its metrics)."""
    text = p.metrics()
    for line in text.splitlines():
        if line.startswith('kvpushd_declines_total{direction="received"}'):
            return int(float(line.split()[-1]))
    return 0


def test_decline_is_refused_for_a_pending_expect_and_for_another_daemons_transfer(  # type: ignore[no-untyped-def]
        daemon_factory, kv_pair) -> None:
    p, d = daemon_factory.pair(LONG)
    rogue = daemon_factory("rogue", LONG)
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    rw = rogue.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send(Expect("t3", (1, 2), p.peer_address, "prefill", 1))
    with pytest.raises(KVPushError) as e:  # pending here: abort it instead
        dw.send(Decline("t3", p.peer_address, "prefill"))
    assert e.value.code == "FAILED_PRECONDITION"
    assert wait_for(lambda: any(t.transfer_id == "t3" for t in p.client.status().transfers))
    # another decode daemon cannot end a transfer this one registered (the prefill side refuses it)
    rw.send(Decline("t3", p.peer_address, "prefill", "rogue"))
    assert wait_for(lambda: "could not decline transfer" in rogue.logs(), 10)
    pw.send(Publish("t3", (3, 4)))
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING
    assert (dst.arr[:, [1, 2]] == src.arr[:, [3, 4]]).all()
    with pytest.raises(KVPushError) as e:
        pw.send(Decline("t3", p.peer_address, "prefill"))  # a producer cannot decline
    assert e.value.code == "FAILED_PRECONDITION"
    for w in (pw, dw, rw):
        w.detach()


def test_decode_daemon_down_when_the_request_came(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """What the vLLM connector does: the Expect is refused while the decode daemon is down; it
    declines; the reconnecting worker makes the Decline once re-attached; prefill frees at once."""
    p, d = daemon_factory.pair(LONG)
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    link = ReconnectingStreamWorker(d.sock, dict(engine_id="decode", role=Role.CONSUMER, tp_rank=0, tp_size=1,
                                           memory=[dst.buf.memory], regions=dst.region_list),
                              rpc_timeout_s=5, reconnect_interval_s=0.2)
    link.start(30)
    try:
        pw.send(Publish("t4", (1, 2)))  # prefill done first: its blocks wait for a registration
        d.stop(signal.SIGKILL)
        assert wait_for(lambda: not link.connected, 30)
        call = link.send_nowait(Expect("t4", (3, 4), p.peer_address, "prefill", 1))
        ev = []
        assert wait_for(lambda: ev.extend(link.poll()) or any(e.kind == "refused" and e.call is call for e in ev), 30)
        link.decline_nowait(Decline("t4", p.peer_address, "prefill", "its Expect did not reach the decode daemon"))
        time.sleep(0.5)
        assert any(t.transfer_id == "t4" for t in p.client.status().transfers)  # still held: nobody told it
        d.restart()
        started = time.monotonic()
        c = _failed_soon(pw, "t4", 30)
        assert c is not None and c.kind is CompletionKind.FAILED and "declined" in c.reason
        print(f"prefill blocks freed {time.monotonic() - started:.2f}s after the decode daemon came back")
        assert link.connected
    finally:
        link.close()
        pw.detach()
