"""Faults with real processes: a peer daemon killed, stopped (SIGSTOP) or restarted mid-transfer.

Every request on the surviving side must end (FAILED with a reason) within the configured bound,
and the status API must show nothing left pending.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import attach_pair, start_daemon, wait_for
from kvpushd_client import CompletionKind, Role

FAST = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 2.0\nexpect_timeout_s = 60.0\n"
        "publish_timeout_s = 60.0\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fast_pair(workdir):  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", FAST)
    d = start_daemon(workdir, "dnode", FAST)
    yield p, d
    for x in (p, d):
        if x.proc.poll() is None:
            x.proc.send_signal(signal.SIGCONT)
            x.stop()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_prefill_daemon_dies_or_hangs(fast_pair, kv_pair, how: str) -> None:
    p, d = fast_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.expect("ok-before", [1], p.peer_address, "prefill", 1)
    pw.publish("ok-before", [2])
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    dw.expect("stranded", [3, 4], p.peer_address, "prefill", 1)
    assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
    p.proc.send_signal(getattr(signal, how))
    t0 = time.monotonic()
    c = dw.next_completion(30)
    waited = time.monotonic() - t0
    assert c is not None and c.kind is CompletionKind.FAILED, c
    assert c.code == "PEER_UNREACHABLE" and c.block_ids == (3, 4), c
    assert waited < 20, f"took {waited:.1f}s to notice"  # bound: peer_timeout_s plus RPC deadlines
    assert not d.client.status().transfers
    peers = {x.address: x for x in d.client.status().peers}
    assert peers[p.peer_address].state == "unreachable"
    if how == "SIGSTOP":
        p.proc.send_signal(signal.SIGCONT)


def test_decode_daemon_killed_releases_its_registrations(fast_pair, kv_pair) -> None:
    p, d = fast_pair
    src, dst = kv_pair
    _, dw = attach_pair(p, d, src, dst)
    dw.expect("held-at-prefill", [3, 4], p.peer_address, "prefill", 1)
    assert wait_for(lambda: any(t.transfer_id == "held-at-prefill" for t in p.client.status().transfers))
    d.proc.kill()
    d.proc.wait(10)
    # no more heartbeats: the prefill daemon drops the dead node's registrations
    assert wait_for(lambda: not p.client.status().transfers, timeout=20)


def test_restarted_prefill_daemon_is_handshaken_afresh(workdir, kv_pair) -> None:
    port = free_port()
    listen = f"127.0.0.1:{port}"
    p = start_daemon(workdir, "pnode", FAST, listen=listen)
    d = start_daemon(workdir, "dnode", FAST)
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.expect("one", [1], p.peer_address, "prefill", 1)
        pw.publish("one", [2])
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        dw.expect("across-restart", [5], p.peer_address, "prefill", 1)
        assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
        p.proc.kill()
        p.proc.wait(10)
        p.client.close()
        p2 = start_daemon(workdir, "pnode", FAST, listen=listen)  # same address, new instance and agents
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.code == "PEER_UNREACHABLE", c
        pw2 = p2.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory],
                               src.region_list)
        dw.expect("after-restart", [6, 7], p2.peer_address, "prefill", 1)
        pw2.publish("after-restart", [8, 9])
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw2.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        import numpy as np

        assert np.array_equal(dst.arr[:, [6, 7], :], src.arr[:, [8, 9], :])
        p = p2
    finally:
        for x in (p, d):
            x.client.close()
            if x.proc.poll() is None:
                x.stop()


def test_killed_prefill_worker_fails_the_decode_side(fast_pair, kv_pair) -> None:
    """The prefill worker's process dies after publishing: its publish dies with it, and the
    decode request it was matched with fails instead of waiting forever."""
    p, d = fast_pair
    src, dst = kv_pair
    script = (
        "import sys,time\n"
        "from kvpushd_client import KVPushClient, Region, Role, ShmMemory\n"
        "c = KVPushClient(sys.argv[1])\n"
        "w = c.attach('prefill', Role.PRODUCER, 0, 1, [ShmMemory(sys.argv[2], int(sys.argv[3]))],"
        " [Region(0, i * 64 * 4096, 64, 4096) for i in range(4)])\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, p.sock, src.buf.name, str(src.buf.size)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory],
                             dst.region_list)
        dw.expect("orphaned-by-prefill", [1, 2], p.peer_address, "prefill", 1)
        assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: not p.client.status().workers)
        # the prefill engine is gone; its registration stays until the decode side gives up or
        # the engine comes back: withdraw it from the decode side with an abort
        assert dw.abort("orphaned-by-prefill") is True
        c = dw.next_completion(10)
        assert c.kind is CompletionKind.FAILED and c.code == "ABORTED"
        assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    finally:
        if proc.poll() is None:
            proc.kill()

