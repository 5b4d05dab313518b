"""End to end: two real daemons, real NIXL WRITEs between real shared memory (UCX; the tests marked
``@both_backends`` on LIBFABRIC too)."""

from __future__ import annotations

import random
import threading

import numpy as np
from kvpushd_client import CompletionKind, Role
from kvpushd_client.types import Expect, Publish
from support import KV, POISON, attach_pair, both_backends, make_kv, wait_for


def check_blocks(src: KV, dst: KV, src_blocks: list[int], dst_blocks: list[int]) -> None:
    assert np.array_equal(dst.arr[:, dst_blocks, :], src.arr[:, src_blocks, :])


def check_poison_elsewhere(dst: KV, written: set[int]) -> None:
    others = [b for b in range(dst.num_blocks) if b not in written]
    assert np.all(dst.arr[:, others, :] == POISON), "bytes outside the destination blocks changed"


@both_backends
def test_register_first_then_publish(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("req-a", (10, 11, 12, 20), p.peer_address, "prefill", 1))
    pw.send(Publish("req-a", (1, 2, 3, 40)))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING and c.transfer_id == "req-a"
    s = pw.next_completion(20)
    assert s is not None and s.kind is CompletionKind.FINISHED_SENDING
    check_blocks(src, dst, [1, 2, 3, 40], [10, 11, 12, 20])
    check_poison_elsewhere(dst, {10, 11, 12, 20})
    pw.detach()
    dw.detach()


def test_publish_first_then_register(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    pw.send(Publish("req-b", (7, 8)))
    assert wait_for(lambda: any(t.transfer_id == "req-b" for t in p.client.status().transfers))
    dw.send(Expect("req-b", (30, 5), p.peer_address, "prefill", 1))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    check_blocks(src, dst, [7, 8], [30, 5])
    check_poison_elsewhere(dst, {30, 5})


def test_many_concurrent_requests_both_orders(daemon_pair) -> None:
    p, d = daemon_pair
    src = make_kv("kvpushd-test-src", regions=8, num_blocks=512, block_len=2048)
    dst = make_kv("kvpushd-test-dst", regions=8, num_blocks=512, block_len=2048, fill="poison")
    try:
        pw, dw = attach_pair(p, d, src, dst)
        rng = random.Random(7)
        n, per = 48, 8
        dst_perm = rng.sample(range(dst.num_blocks), n * per)  # fragmented destination blocks
        reqs = []
        for i in range(n):
            s_blocks = rng.sample(range(src.num_blocks), per)
            reqs.append((f"req-{i}", s_blocks, dst_perm[i * per:(i + 1) * per], rng.random() < 0.5))

        def go(tid: str, s: list[int], t: list[int], expect_first: bool) -> None:
            if expect_first:
                dw.send(Expect(tid, tuple(t), p.peer_address, "prefill", 1))
                pw.send(Publish(tid, tuple(s)))
            else:
                pw.send(Publish(tid, tuple(s)))
                dw.send(Expect(tid, tuple(t), p.peer_address, "prefill", 1))

        threads = [threading.Thread(target=go, args=r) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        recv = {c.transfer_id: c for c in iter(lambda: dw.next_completion(30), None)}
        sent = {}
        while len(sent) < n:
            c = pw.next_completion(30)
            assert c is not None
            sent[c.transfer_id] = c
        while len(recv) < n:
            c = dw.next_completion(30)
            assert c is not None
            recv[c.transfer_id] = c
        assert {c.kind for c in recv.values()} == {CompletionKind.FINISHED_RECEIVING}
        assert {c.kind for c in sent.values()} == {CompletionKind.FINISHED_SENDING}
        for _tid, s_blocks, d_blocks, _ in reqs:
            check_blocks(src, dst, s_blocks, d_blocks)
        check_poison_elsewhere(dst, set(dst_perm))
        assert {r[3] for r in reqs} == {True, False}
        for x in (p, d):
            st = x.client.status()
            assert list(st.transfers) == [], st.transfers
        assert p.client.status().counters.writes_posted == n
        assert d.client.status().counters.notifications_received == n
    finally:
        src.close()
        dst.close()


def test_adjacent_blocks_are_merged(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("run", tuple(range(8, 24)), p.peer_address, "prefill", 1))  # 16 blocks, one run
    pw.send(Publish("run", tuple(range(32, 48))))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    c = p.client.status().counters
    assert c.descriptors_requested == 16 * src.regions
    assert c.descriptors_posted == src.regions  # one descriptor per region after merging
    check_blocks(src, dst, list(range(32, 48)), list(range(8, 24)))


def test_partial_prefix_hit_writes_only_the_tail(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    pw.send(Publish("tail", (1, 2, 3, 4, 5)))
    dw.send(Expect("tail", (50, 51), p.peer_address, "prefill", 1))  # decode had the first 3 cached
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    check_blocks(src, dst, [4, 5], [50, 51])
    check_poison_elsewhere(dst, {50, 51})


def test_kv_both_role_and_publish_timeout(workdir, kv_pair) -> None:
    from support import start_daemon

    src, _dst = kv_pair
    p = start_daemon(workdir, "short", "[transfer]\npublish_timeout_s = 0.3\nexpect_timeout_s = 0.3\n")
    try:
        w = p.client.attach("both", Role.BOTH, 0, 1, [src.buf.memory], src.region_list)
        w.send(Publish("never-registered", (1, 2)))
        c = w.next_completion(10)
        assert c.kind is CompletionKind.FAILED and c.code == "TIMEOUT" and c.block_ids == (1, 2)
        w.send(Expect("never-published", (3,), p.peer_address, "both", 1))  # loops back to itself
        c = w.next_completion(10)
        assert c.kind is CompletionKind.FAILED and c.code == "TIMEOUT"
        assert wait_for(lambda: list(p.client.status().transfers) == [])
    finally:
        p.client.close()
        assert p.stop() == 0


def test_sigterm_releases_everything(workdir, kv_pair) -> None:
    from support import start_daemon

    src, _ = kv_pair
    p = start_daemon(workdir, "term")
    p.client.attach("e", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    pid = p.proc.pid
    with open(f"/proc/{pid}/maps") as f:
        maps_before = f.read()
    assert src.buf.name in maps_before  # the daemon maps the worker's memory
    p.client.close()
    assert p.stop() == 0
    assert "kvpushd stopped" in p.logs()
    assert not (workdir / "term.sock").exists()


WORKER_SCRIPT = r"""
import sys, time
from kvpushd_client import Expect, KVPushClient, MemfdMemory, Region, Role
sock, fd, size, peer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
c = KVPushClient(sock)
w = c.attach("decode", Role.CONSUMER, 0, 1, [MemfdMemory(fd, size)], [Region(0, 0, 64, 4096)])
w.send(Expect("orphan", (1, 2), peer, "prefill", 1))
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_worker_is_detached_and_its_transfers_end(daemon_pair, kv_pair) -> None:
    import signal
    import subprocess
    import sys

    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    proc = subprocess.Popen([sys.executable, "-c", WORKER_SCRIPT, d.sock, str(dst.buf.fd), str(dst.buf.size),
                             p.peer_address], stdout=subprocess.PIPE, text=True, pass_fds=[dst.buf.fd])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert wait_for(lambda: any(t.transfer_id == "orphan" for t in p.client.status().transfers))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # the decode daemon notices the session's end, detaches, and withdraws the registration
        assert wait_for(lambda: not d.client.status().workers and not d.client.status().transfers)
        assert wait_for(lambda: not p.client.status().transfers)
        maps = open(f"/proc/{d.proc.pid}/maps").read()  # noqa: SIM115
        assert dst.buf.name not in maps, "the dead worker's memory is still mapped"
        # a publish for the withdrawn transfer now waits for a registration that will not come,
        # and the prefill side is not harmed
        pw.send(Publish("after", (1,)))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_fails_pending_transfers_on_both_sides(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("waits-for-prefill", (1, 2), p.peer_address, "prefill", 1))
    pw.send(Publish("waits-for-decode", (3,)))
    assert wait_for(lambda: len(p.client.status().transfers) == 2)
    assert p.stop() == 0  # drains: nothing is in flight, so it does not wait for the timeout
    c = pw.next_completion(5)
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "SHUTDOWN"
    c = dw.next_completion(10)  # the prefill daemon's notice reaches the decode side
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "SHUTDOWN" and c.block_ids == (1, 2)
    assert wait_for(lambda: not d.client.status().transfers)
