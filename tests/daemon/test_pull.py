"""Pull mode with real daemons: the decode node's daemon READs the prefill blocks (NIXL READ).

Decode registers as in push mode (with mode=pull); once the prefill daemon holds both the
registration and the publish it offers the source blocks to the decode daemon, which READs them
into the blocks its worker registered and notifies the prefill agent; the prefill daemon then
finishes the publish. Every destination byte is checked, and no other destination byte changes.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvpushd_client import Abort, CompletionKind, Expect, Publish, Role, TransferMode
from support import POISON, attach_pair, both_backends, make_kv, wait_for

R, NB, HALF = 4, 32, 2048


def _settled(p, d) -> bool:  # type: ignore[no-untyped-def]
    return not p.client.status().transfers and not d.client.status().transfers


@pytest.mark.parametrize("order", ["expect_first", "publish_first"])
@both_backends
def test_pull_moves_bytes_exactly(daemon_pair, kv_pair, order: str) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    src_blocks, dst_blocks = [3, 4, 5, 9, 10], [40, 41, 2, 17, 18]
    if order == "expect_first":
        dw.send(Expect("pull-1", tuple(dst_blocks), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
        pw.send(Publish("pull-1", tuple(src_blocks)))
    else:
        pw.send(Publish("pull-1", tuple(src_blocks)))
        dw.send(Expect("pull-1", tuple(dst_blocks), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
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


@both_backends
def test_pull_prefill_tp2_to_decode_tp1(daemon_pair) -> None:
    p, d = daemon_pair
    srcs = [make_kv(f"kvpushd-test-p{r}", regions=R, num_blocks=NB, block_len=HALF, seed=r) for r in range(2)]
    dst = make_kv("kvpushd-test-d", regions=R, num_blocks=NB, block_len=2 * HALF, fill="poison")
    try:
        pws = [p.client.attach("prefill", Role.PRODUCER, r, 2, [s.buf.memory], s.region_list)
               for r, s in enumerate(srcs)]
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        src_blocks, dst_blocks = [3, 4, 9], [20, 21, 5]
        pws[0].send(Publish("tp21", tuple(src_blocks)))  # one rank before the registration, one after
        dw.send(Expect("tp21", tuple(dst_blocks), p.peer_address, "prefill", 2, transfer_mode=TransferMode.PULL))
        pws[1].send(Publish("tp21", tuple(src_blocks)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        for w in pws:
            assert w.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        got = dst.arr[:, dst_blocks, :]
        for r in range(2):
            assert np.array_equal(got[:, :, r * HALF:(r + 1) * HALF], srcs[r].arr[:, src_blocks, :])
        others = [b for b in range(NB) if b not in dst_blocks]
        assert np.all(dst.arr[:, others, :] == POISON)
        assert d.client.status().counters.reads_posted == 2  # one READ per producer rank
        assert wait_for(lambda: _settled(p, d))
    finally:
        for kv in [*srcs, dst]:
            kv.close()


def test_pull_prefill_tp1_to_decode_tp2(daemon_pair) -> None:
    p, d = daemon_pair
    src = make_kv("kvpushd-test-p", regions=R, num_blocks=NB, block_len=2 * HALF)
    dsts = [make_kv(f"kvpushd-test-d{r}", regions=R, num_blocks=NB, block_len=HALF, fill="poison") for r in range(2)]
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dws = [d.client.attach("decode", Role.CONSUMER, r, 2, [k.buf.memory], k.region_list)
               for r, k in enumerate(dsts)]
        src_blocks = [1, 2, 3, 4]
        dst_blocks = [[7, 8, 9, 10], [30, 0, 12, 13]]
        dws[0].send(Expect("tp12", tuple(dst_blocks[0]), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
        pw.send(Publish("tp12", tuple(src_blocks)))
        dws[1].send(Expect("tp12", tuple(dst_blocks[1]), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
        for w in dws:
            assert w.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING  # once both ranks READ
        for r, (k, blocks) in enumerate(zip(dsts, dst_blocks, strict=True)):
            assert np.array_equal(k.arr[:, blocks, :], src.arr[:, src_blocks, r * HALF:(r + 1) * HALF])
            others = [b for b in range(NB) if b not in blocks]
            assert np.all(k.arr[:, others, :] == POISON)
        assert d.client.status().counters.reads_posted == 2 and p.client.status().counters.writes_posted == 0
        assert wait_for(lambda: _settled(p, d))
    finally:
        for kv in [src, *dsts]:
            kv.close()


def test_push_and_pull_mixed_concurrently(daemon_pair, kv_pair) -> None:
    """Requests of both modes, both arrival orders, interleaved on one daemon pair."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    rng = np.random.default_rng(7)
    n = 16
    src_sets = rng.permutation(src.num_blocks)[: n * 2].reshape(n, 2)
    dst_sets = rng.permutation(dst.num_blocks)[: n * 2].reshape(n, 2)
    modes = [TransferMode.PULL if i % 2 else TransferMode.PUSH for i in range(n)]
    for i in range(n):  # first half: expect first; second half: publish first
        tid = f"mix-{i}"
        if i < n // 2:
            dw.send(Expect(tid, tuple(dst_sets[i].tolist()), p.peer_address, "prefill", 1, transfer_mode=modes[i]))
        else:
            pw.send(Publish(tid, tuple(src_sets[i].tolist())))
    for i in range(n):
        tid = f"mix-{i}"
        if i < n // 2:
            pw.send(Publish(tid, tuple(src_sets[i].tolist())))
        else:
            dw.send(Expect(tid, tuple(dst_sets[i].tolist()), p.peer_address, "prefill", 1, transfer_mode=modes[i]))
    got_d = {c.transfer_id: c for c in (dw.next_completion(20) for _ in range(n))}
    got_p = {c.transfer_id: c for c in (pw.next_completion(20) for _ in range(n))}
    assert all(c.kind is CompletionKind.FINISHED_RECEIVING for c in got_d.values()) and len(got_d) == n, got_d
    assert all(c.kind is CompletionKind.FINISHED_SENDING for c in got_p.values()) and len(got_p) == n, got_p
    for i in range(n):
        assert np.array_equal(dst.arr[:, dst_sets[i], :], src.arr[:, src_sets[i], :]), (i, modes[i])
    used = set(dst_sets.reshape(-1).tolist())
    assert np.all(dst.arr[:, [b for b in range(dst.num_blocks) if b not in used], :] == POISON)
    dc, pc = d.client.status().counters, p.client.status().counters
    assert dc.reads_posted == n // 2 and pc.writes_posted == n // 2 and dc.notifications_received == n // 2
    assert wait_for(lambda: _settled(p, d))


def test_read_that_cannot_be_posted_ends_both_sides(daemon_pair) -> None:
    """Layouts that do not fit: the decode daemon cannot post the READ; both requests fail, nothing moves."""
    p, d = daemon_pair
    src = make_kv("kvpushd-test-p", regions=R, num_blocks=NB, block_len=HALF)
    dst = make_kv("kvpushd-test-d", regions=R, num_blocks=NB, block_len=2 * HALF, fill="poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send(Expect("bad", (1, 2), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
        pw.send(Publish("bad", (5, 6)))
        c = dw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED, c
        assert c.code in ("TRANSFER_ERROR", "LAYOUT_MISMATCH") and c.block_ids == (1, 2), c
        c = pw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED and c.block_ids == (5, 6), c
        assert np.all(dst.arr == POISON)
        assert wait_for(lambda: _settled(p, d))
        # the same layouts fail a push WRITE too (on the prefill side this time)
        dw.send(Expect("good", (3,), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PUSH))
        pw.send(Publish("good", (7,)))
        assert dw.next_completion(20).kind is CompletionKind.FAILED  # still the wrong layout for a WRITE
    finally:
        for kv in [src, dst]:
            kv.close()


def test_decode_abort_before_publish_ends_both_sides(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("ab", (1, 2), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
    assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
    assert dw.send(Abort("ab"))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "ABORTED", c
    assert wait_for(lambda: not p.client.status().transfers)  # the withdrawal reached the prefill daemon
    pw.send(Publish("ab", (3, 4)))  # nothing to pull into any more: the publish waits for its deadline
    assert np.all(dst.arr == POISON)
    assert pw.send(Abort("ab"))
    assert pw.next_completion(20).kind is CompletionKind.FAILED


def test_offers_are_checked_against_the_registration(daemon_pair, kv_pair) -> None:
    """A peer may only make the decode daemon READ into blocks registered for that very transfer,
    and only the prefill daemon the registration went to may offer; refused offers change nothing."""
    from kvpushd_client.proto.v1 import peer_pb2
    from test_peer_trust import session

    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("sec", (1, 2), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
    assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
    rid = next(t.registration_id for t in d.client.status().transfers if t.transfer_id == "sec")
    assert next(t.mode for t in d.client.status().transfers if t.transfer_id == "sec") == "pull"
    p_instance = p.client.status().instance_id
    sessions = {}

    def handshake(node_id: str, address: str, instance: str) -> None:
        sessions[instance] = session(d.peer_address, node_id, instance, address)

    def offer(instance: str, node_id: str, tid: str, blocks: list[int], reg: int = rid, rank: int = 0) -> str:
        name = f"kvpushd.{node_id}.{instance[:8]}.prefill.tp0.pp0.w1-fake"
        md = b"nixlSerDes|Agent" + len(name).to_bytes(8, "little") + name.encode()
        agent = peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind="DRAM",
                                   regions=[peer_pb2.RemoteRegion(base_addr=4096, num_blocks=src.num_blocks,
                                                                  block_len=src.block_len,
                                                                  block_stride=src.block_len)] * src.regions)
        return sessions[instance].call("offer", peer_pb2.OfferRequest(
            transfer_id=tid, registration_id=reg, producer_rank=rank, producer_tp_size=1, producer_agent=agent,
            block_ids=blocks)).code

    # a daemon the registration was not sent to
    handshake("evil", "127.0.0.1:9", "e" * 32)
    assert offer("e" * 32, "evil", "sec", [0, 1]) == "PERMISSION_DENIED"
    # posing as the prefill daemon (its instance id): the registration's own terms still hold
    handshake("pnode", p.peer_address, p_instance)
    assert offer(p_instance, "pnode", "other", [0, 1]) == "PERMISSION_DENIED"  # transfer id
    assert offer(p_instance, "pnode", "sec", [0, 1], reg=rid + 1) == "NOT_FOUND"  # registration
    assert offer(p_instance, "pnode", "sec", [0, 1, 2]) == "INVALID_ARGUMENT"  # block count
    assert offer(p_instance, "pnode", "sec", [0, 1], rank=1) == "INVALID_ARGUMENT"  # rank
    assert offer(p_instance, "pnode", "sec", [0, 10**6]) == "INVALID_ARGUMENT"  # out of range
    assert d.client.status().counters.reads_posted == 0 and np.all(dst.arr == POISON)
    # the real offer still lands
    pw.send(Publish("sec", (5, 6)))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert np.array_equal(dst.arr[:, [1, 2], :], src.arr[:, [5, 6], :])
    assert wait_for(lambda: _settled(p, d))


FAST = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 2.0\nexpect_timeout_s = 10.0\n"
        "publish_timeout_s = 60.0\n")


@pytest.fixture
def fast_pair(daemon_factory):  # type: ignore[no-untyped-def]
    return daemon_factory.pair(FAST)  # stopped (SIGCONT first if stopped) by the factory


def test_decode_daemon_stopped_before_the_offer_ends_the_publish(fast_pair, kv_pair) -> None:
    """The offer cannot be delivered and the decode daemon goes silent: the publish fails (peer
    loss), well before publish_timeout_s, and the prefill worker gets its blocks back."""
    import signal

    p, d = fast_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("stop", (1, 2), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
    assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
    d.proc.send_signal(signal.SIGSTOP)
    try:
        pw.send(Publish("stop", (3, 4)))
        c = pw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.block_ids == (3, 4), c
        assert c.code in ("PEER_UNREACHABLE", "TRANSFER_ERROR"), c
        assert wait_for(lambda: not p.client.status().transfers)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    # The prefill daemon dropped the decode daemon as lost without telling it (as in push mode):
    # the decode request ends at the latest at its expect_timeout_s.
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED and c.block_ids == (1, 2), c
    assert np.all(dst.arr == POISON)


@both_backends
def test_prefill_daemon_killed_during_pull_ends_the_decode_side(fast_pair, kv_pair) -> None:
    """The prefill daemon dies with the offer delivered (or on its way): the decode request ends,
    FAILED with its blocks, or finished with exact bytes if the READ got through first."""
    import signal

    p, d = fast_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("kill", (1, 2), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL))
    assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
    d.proc.send_signal(signal.SIGSTOP)  # hold the offer in the decode daemon's socket
    pw.send(Publish("kill", (3, 4)))
    wait_for(lambda: False, timeout=0.5)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait(10)
    d.proc.send_signal(signal.SIGCONT)
    c = dw.next_completion(30)
    assert c is not None, "decode request never ended"
    if c.kind is CompletionKind.FAILED:
        assert c.block_ids == (1, 2), c
    else:
        assert c.kind is CompletionKind.FINISHED_RECEIVING
        assert np.array_equal(dst.arr[:, [1, 2], :], src.arr[:, [3, 4], :])
    assert wait_for(lambda: not d.client.status().transfers)
