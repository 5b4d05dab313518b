"""Progressive push: a publish declared before the forward, layer groups written as the doorbell goes.

Real daemons, real NIXL. The "engine" here writes each layer group's KV into its source regions
only when it gets to that layer, then rings the doorbell: a WRITE posted before its group was
ready would land the poison that was there before, so every byte checked at the end says that no
group went early, and the decode side is told only once every group has landed.
"""

from __future__ import annotations

import time

import grpc
import pytest
from kvpushd_client import Abort, Attach, CompletionKind, Expect, KVPushError, Publish, Role, _convert
from kvpushd_client.handover import hand_over
from support import POISON, attach_pair, both_backends, layered_kv, wait_for

REGIONS, LAYERS, BLOCKS = 8, 4, 64


@pytest.fixture
def kv():  # type: ignore[no-untyped-def]
    src, dst, want = layered_kv("prog", REGIONS, BLOCKS, 3)
    yield src, dst, want
    src.close()
    dst.close()


def _compute_layer(src, want, g: int, blocks: list[int]) -> None:  # type: ignore[no-untyped-def]
    per = REGIONS // LAYERS
    for r in range(g * per, (g + 1) * per):
        src.arr[r, blocks] = want[r, blocks]


def _counters(dm):  # type: ignore[no-untyped-def]
    return dm.client.status().counters


@pytest.mark.parametrize("registration", ["before", "between", "after"])
@both_backends
def test_layer_groups_go_as_the_doorbell_rings(group_pair, kv, registration: str) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    sblocks, dblocks = [3, 4, 5, 9], [10, 11, 12, 30]
    notifs0, bytes0 = _counters(d).notifications_received, _counters(p).bytes_written

    def expect() -> None:
        dw.send(Expect("t1", tuple(dblocks), p.peer_address, "prefill", 1))

    if registration == "before":
        expect()
    seq = bell.step()
    pw.send(Publish("t1", tuple(sblocks), step=seq, layers=LAYERS))  # declared before the forward
    for g in range(LAYERS):
        if registration == "between" and g == 2:
            expect()
        _compute_layer(src, want, g, sblocks)
        bell.layer_done(g + 1)
        if g < LAYERS - 1:
            time.sleep(0.15)
            assert dw.completions() == []  # not complete while a layer group is missing
    bell.seal()
    if registration == "after":
        time.sleep(0.1)
        expect()
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
    assert (dst.arr[:, dblocks] == want[:, sblocks]).all()
    assert (dst.arr[:, [0, 1, 2, 13]] == POISON).all()  # nothing else written
    # the prefill daemon counts the leg's bytes, whichever WRITEs carried them
    assert wait_for(lambda: _counters(p).bytes_written - bytes0 == REGIONS * len(sblocks) * 4096)
    got = _counters(d).notifications_received - notifs0
    if registration == "before":
        assert got == LAYERS  # one WRITE (and notification) per group, each as it became ready
    elif registration == "after":
        assert got == 1  # the step was complete: one WRITE of everything
    else:
        assert 2 <= got <= LAYERS - 1  # what was ready caught up at once (merged), the rest one by one
    pw.detach()
    dw.detach()
    assert wait_for(lambda: not p.client.status().workers and not d.client.status().workers)


@pytest.mark.parametrize(("min_write", "writes"), [(None, 1), (64 << 10, 2), (0, LAYERS)])
def test_small_layer_groups_gather_into_writes_of_min_write_bytes(daemon_factory, kv, min_write, writes) -> None:  # type: ignore[no-untyped-def]
    """A layer group here is 2 regions x 4 blocks x 4 KiB = 32 KiB: the default (1 MiB) sends the whole
    leg as one WRITE once the step is complete, 64 KiB two groups a WRITE, 0 every group alone; the
    bytes are the same and no WRITE goes before its groups are ready."""
    p, d = daemon_factory.pair("[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n" + (
        "" if min_write is None else f"progressive_min_write_bytes = {min_write}\n"))
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    sblocks, dblocks = [3, 4, 5, 9], [10, 11, 12, 30]
    notifs0 = _counters(d).notifications_received
    dw.send(Expect("g1", tuple(dblocks), p.peer_address, "prefill", 1))
    pw.send(Publish("g1", tuple(sblocks), step=bell.step(), layers=LAYERS))
    for g in range(LAYERS):
        _compute_layer(src, want, g, sblocks)
        bell.layer_done(g + 1)
        time.sleep(0.1)
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
    assert (dst.arr[:, dblocks] == want[:, sblocks]).all()
    assert _counters(d).notifications_received - notifs0 == writes
    pw.detach()
    dw.detach()
    daemon_factory.close(check=(p, d))


def test_a_later_step_completes_an_earlier_one_and_a_stale_word_is_ignored(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    dw.send(Expect("t2", (1, 2), p.peer_address, "prefill", 1))
    first = bell.step()
    bell.layer_done(LAYERS)  # an earlier step, complete: says nothing of the next one
    nxt = first + 1
    pw.send(Publish("t2", (7, 8), step=nxt, layers=LAYERS))
    time.sleep(0.3)
    assert dw.completions() == []
    for g in range(LAYERS):
        _compute_layer(src, want, g, [7, 8])
    assert bell.step() == nxt
    bell.step()  # the next step began: step nxt is complete
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    assert (dst.arr[:, [1, 2]] == want[:, [7, 8]]).all()
    pw.detach()
    dw.detach()


def test_abort_mid_layers_fails_both_sides_after_the_writes_settle(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    dw.send(Expect("t3", (20, 21), p.peer_address, "prefill", 1))
    seq = bell.step()
    pw.send(Publish("t3", (40, 41), step=seq, layers=LAYERS))
    _compute_layer(src, want, 0, [40, 41])
    bell.layer_done(1)
    assert wait_for(lambda: (dst.arr[:2, [20, 21]] == want[:2, [40, 41]]).all())  # group 0 landed
    assert pw.send(Abort("t3"))
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "ABORTED", c
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED, c
    for g in range(1, LAYERS):  # the engine goes on; nothing more is written
        _compute_layer(src, want, g, [40, 41])
        bell.layer_done(g + 1)
    time.sleep(0.3)
    assert (dst.arr[2:, [20, 21]] == POISON).all()
    assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    pw.detach()
    dw.detach()


def test_worker_dying_between_layers_fails_the_transfer(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    dw.send(Expect("t4", (5, 6), p.peer_address, "prefill", 1))
    seq = bell.step()
    pw.send(Publish("t4", (5, 6), step=seq, layers=LAYERS))
    _compute_layer(src, want, 0, [5, 6])
    bell.layer_done(1)
    pw._call.cancel()  # the prefill worker's session ends between layers (its process died)
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED, c
    assert wait_for(lambda: not p.client.status().workers)
    assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    dw.detach()


def test_bad_progressive_publishes_are_refused(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, _ = group_pair
    src, _, _ = kv
    plain = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    with pytest.raises(KVPushError, match="without a doorbell"):
        plain.send(Publish("b1", (1,), step=1, layers=LAYERS))
    plain.detach()
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list, doorbell=True)
    for step, layers in ((1, 3), (0, 4), (1, 70000), (2, 0)):  # 3 does not divide 8 regions
        with pytest.raises(KVPushError, match="progressive publish"):
            pw.send(Publish("b2", (1,), step=step, layers=layers))
    pw.send(Publish("b3", (1,), step=1, layers=REGIONS))  # one region per group is fine
    assert pw.send(Abort("b3"))
    pw.detach()
    for name, token, code, says in (
            ("kvpushd-kv-bell-nobody", b"", grpc.StatusCode.PERMISSION_DENIED, "by /dev/shm name"),  # refused
            ("", b"short", grpc.StatusCode.INVALID_ARGUMENT, "token"),
            ("", b"\0" * 16, grpc.StatusCode.NOT_FOUND, "no descriptor arrived"),  # never handed over
            ("kvpushd-kv-bell-x", b"\1" * 16, grpc.StatusCode.INVALID_ARGUMENT, "not both")):
        mem = [src.buf.memory]  # its descriptor, handed over again for each Attach
        req = _convert.attach_request(Attach("prefill", Role.PRODUCER, 0, 1, mem, src.region_list),
                                      hand_over(p.sock, mem))
        req.doorbell, req.doorbell_token = name, token
        with pytest.raises(grpc.RpcError) as e:
            p.client.stub.Attach(req, timeout=10)
        assert e.value.code() == code and says in (e.value.details() or ""), e.value
    assert not p.client.status().workers


def test_a_worker_that_truncates_its_doorbell_fails_only_its_own_publish(daemon_factory, kv) -> None:  # type: ignore[no-untyped-def]
    """The daemon reads the word with pread: a page cut to nothing reads as "no progress" (the declared
    step times out) where a load through a mapping would have killed the daemon with SIGBUS."""
    import os

    p, d = daemon_factory.pair("[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n"
                               "write_timeout_s = 1.0\n")
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    dw.send(Expect("cut", (1, 2), p.peer_address, "prefill", 1))
    pw.send(Publish("cut", (1, 2), step=bell.step(), layers=LAYERS))
    bell.layer_done(1)
    os.ftruncate(bell.fd, 0)
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED, c
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED, c
    assert p.proc.poll() is None and p.client.status().node_id  # the daemon goes on
    _compute_layer(src, want, 0, [5])
    for g in range(1, LAYERS):
        _compute_layer(src, want, g, [5])
    dw.send(Expect("next", (9,), p.peer_address, "prefill", 1))
    pw.send(Publish("next", (5,)))  # whole, no doorbell needed: the other work of the worker is unharmed
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    assert (dst.arr[:, [9]] == want[:, [5]]).all()
    pw.detach()
    dw.detach()
    daemon_factory.close(check=(p, d))
