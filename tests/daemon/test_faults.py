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
from kvpushd_client import Abort, CompletionKind, Expect, Publish, Role
from support import attach_pair, both_backends, start_daemon, wait_for

FAST = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 2.0\nexpect_timeout_s = 60.0\n"
        "publish_timeout_s = 60.0\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fast_pair(daemon_factory):  # type: ignore[no-untyped-def]
    return daemon_factory.pair(FAST)  # stopped (SIGCONT first if stopped) by the factory


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
@both_backends
def test_prefill_daemon_dies_or_hangs(fast_pair, kv_pair, how: str) -> None:
    p, d = fast_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("ok-before", (1,), p.peer_address, "prefill", 1))
    pw.send(Publish("ok-before", (2,)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    dw.send(Expect("stranded", (3, 4), p.peer_address, "prefill", 1))
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
    dw.send(Expect("held-at-prefill", (3, 4), p.peer_address, "prefill", 1))
    assert wait_for(lambda: any(t.transfer_id == "held-at-prefill" for t in p.client.status().transfers))
    d.proc.kill()
    d.proc.wait(10)
    # no more heartbeats: the prefill daemon drops the dead node's registrations
    assert wait_for(lambda: not p.client.status().transfers, timeout=20)


@both_backends
def test_restarted_prefill_daemon_is_handshaken_afresh(workdir, kv_pair, nixl_backend: str) -> None:
    port = free_port()
    listen = f"127.0.0.1:{port}"
    p = start_daemon(workdir, "pnode", FAST, listen=listen, backend=nixl_backend)
    # The decode daemon's handshakes to the dead address back off (calls fail at once meanwhile, by
    # design); short here, so that the Expect after the restart does not race the back-off.
    d = start_daemon(workdir, "dnode", FAST, backend=nixl_backend,
                     settings={"peer_api": {"handshake_retry_s": 0.05, "handshake_retry_max_s": 0.1}})
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("one", (1,), p.peer_address, "prefill", 1))
        pw.send(Publish("one", (2,)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        dw.send(Expect("across-restart", (5,), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
        p.proc.kill()
        p.proc.wait(10)
        p.client.close()
        p2 = start_daemon(workdir, "pnode", FAST, listen=listen,  # same address, new instance and agents
                          backend=nixl_backend)
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.code == "PEER_UNREACHABLE", c
        pw2 = p2.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory],
                               src.region_list)
        dw.send(Expect("after-restart", (6, 7), p2.peer_address, "prefill", 1))
        pw2.send(Publish("after-restart", (8, 9)))
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
        "from kvpushd_client import KVPushClient, MemfdMemory, Region, Role\n"
        "c = KVPushClient(sys.argv[1])\n"
        "w = c.attach('prefill', Role.PRODUCER, 0, 1, [MemfdMemory(int(sys.argv[2]), int(sys.argv[3]))],"
        " [Region(0, i * 64 * 4096, 64, 4096) for i in range(4)])\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, p.sock, str(src.buf.fd), str(src.buf.size)],
                            stdout=subprocess.PIPE, text=True, pass_fds=[src.buf.fd])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory],
                             dst.region_list)
        dw.send(Expect("orphaned-by-prefill", (1, 2), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.state == "registered" for t in d.client.status().transfers))
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: not p.client.status().workers)
        # the prefill engine is gone; its registration stays until the decode side gives up or
        # the engine comes back: withdraw it from the decode side with an abort
        assert dw.send(Abort("orphaned-by-prefill")) is True
        c = dw.next_completion(10)
        assert c.kind is CompletionKind.FAILED and c.code == "ABORTED"
        assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    finally:
        if proc.poll() is None:
            proc.kill()



# -- WRITEs made to fail, and leases ---------------------------------------------------------------
# KVPUSHD_FAULTS (kvpushd_lab/faults.py, test-only) is read by the daemon at start: set it
# only around the start of the daemon that should misbehave.


def _held(x) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(transfers pending, blocks they hold) from the status API."""
    st = x.client.status()
    return len(st.transfers), sum(t.num_blocks for t in st.transfers) + sum(w.pending_transfers for w in st.workers)


def _start_with_faults(monkeypatch, workdir, name: str, faults: str, config: str):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVPUSHD_FAULTS", faults)
    try:
        return start_daemon(workdir, name, config)
    finally:
        monkeypatch.delenv("KVPUSHD_FAULTS")


@pytest.mark.parametrize("fault", ["write_post", "write_complete"])
def test_a_failed_write_fails_both_sides(monkeypatch, workdir, kv_pair, fault: str) -> None:
    """A WRITE that fails (refused at post, or completed in error without its notification):
    prefill gets FAILED with its blocks, decode gets FAILED (TRANSFER_ERROR) with its blocks from
    the prefill daemon's failure notice (not from its own timeout), and nothing stays held."""
    p = _start_with_faults(monkeypatch, workdir, "pnode", f"{fault}=1.0,seed=1", FAST)
    d = start_daemon(workdir, "dnode", FAST)
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("doomed", (3, 4), p.peer_address, "prefill", 1))
        pw.send(Publish("doomed", (5, 6)))
        cp = pw.next_completion(30)
        assert cp is not None and cp.kind is CompletionKind.FAILED, cp
        assert cp.code == "TRANSFER_ERROR" and cp.block_ids == (5, 6), cp
        assert f"KVPUSHD_FAULTS {fault}" in cp.reason, cp.reason
        cd = dw.next_completion(30)  # expect_timeout_s is 60: a TIMEOUT here would mean a silent wait
        assert cd is not None and cd.kind is CompletionKind.FAILED, cd
        assert cd.code == "TRANSFER_ERROR" and cd.block_ids == (3, 4), cd
        assert "WRITE" in cd.reason and f"KVPUSHD_FAULTS {fault}" in cd.reason, cd.reason
        assert wait_for(lambda: _held(p) == (0, 0) and _held(d) == (0, 0)), (_held(p), _held(d))
        assert p.client.status().counters.transfers_failed == 1
        assert d.client.status().counters.transfers_failed == 1
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()


def test_lease_does_not_expire_a_write_in_flight(monkeypatch, workdir, kv_pair) -> None:
    """publish_timeout_s is 0.5 s, the (injected slow) WRITE takes 3 s: the matched transfer
    finishes, it is not expired while its WRITE is in flight."""
    cfg = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 5.0\nexpect_timeout_s = 30.0\n"
           "publish_timeout_s = 0.5\n")
    p = _start_with_faults(monkeypatch, workdir, "pnode", "write_hold_s=3", cfg)
    d = start_daemon(workdir, "dnode", cfg)
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("slow", (1, 2), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.transfer_id == "slow" for t in p.client.status().transfers))
        pw.send(Publish("slow", (7, 8)))
        assert wait_for(lambda: any(t.state == "writing" for t in p.client.status().transfers))
        cd = dw.next_completion(30)
        cp = pw.next_completion(30)
        assert cd.kind is CompletionKind.FINISHED_RECEIVING, cd
        assert cp.kind is CompletionKind.FINISHED_SENDING, cp
        import numpy as np

        assert np.array_equal(dst.arr[:, [1, 2], :], src.arr[:, [7, 8], :])
        assert wait_for(lambda: _held(p) == (0, 0) and _held(d) == (0, 0))
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()


def test_lease_expiry_under_load(workdir, kv_pair) -> None:
    """Many transfers at once: a third are published but never registered (they expire after
    publish_timeout_s), a third registered but never published (expect_timeout_s), a third
    both (they finish). Every request ends, and nothing is held afterwards."""
    cfg = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 10.0\nexpect_timeout_s = 2.0\n"
           "publish_timeout_s = 1.0\n")
    p = start_daemon(workdir, "pnode", cfg)
    d = start_daemon(workdir, "dnode", cfg)
    src, dst = kv_pair
    n = 60
    kinds = ["publish-only", "expect-only", "both"]
    try:
        pw, dw = attach_pair(p, d, src, dst)
        want_p: dict[str, str] = {}
        want_d: dict[str, str] = {}
        for i in range(n):
            kind = kinds[i % 3]
            tid = f"load-{i}-{kind}"
            if kind != "publish-only":
                dw.send(Expect(tid, (i,), p.peer_address, "prefill", 1))
                want_d[tid] = "TIMEOUT" if kind == "expect-only" else "OK"
            if kind != "expect-only":
                pw.send(Publish(tid, tuple([63 - (i % 32)] if kind == "publish-only" else [i])))
                want_p[tid] = "TIMEOUT" if kind == "publish-only" else "OK"

        def drain(w, want: dict[str, str]) -> dict[str, str]:  # type: ignore[no-untyped-def]
            got: dict[str, str] = {}
            while len(got) < len(want):
                c = w.next_completion(30)
                assert c is not None, f"requests never ended: {sorted(set(want) - set(got))[:5]}"
                assert c.transfer_id not in got, f"two completions for {c.transfer_id}"
                got[c.transfer_id] = "OK" if c.kind is not CompletionKind.FAILED else c.code
            return got

        assert drain(pw, want_p) == want_p
        assert drain(dw, want_d) == want_d
        assert wait_for(lambda: _held(p) == (0, 0) and _held(d) == (0, 0)), (_held(p), _held(d))
        assert pw.completions() == [] and dw.completions() == []
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()


def test_decode_abort_waits_for_the_write_in_flight(monkeypatch, workdir, kv_pair) -> None:
    """The decode engine aborts while the prefill daemon's WRITE into its blocks is in flight (held
    3 s by the fault hook): the decode worker is told FAILED only once that WRITE has settled, so it
    never frees blocks a WRITE may still land in."""
    cfg = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 5.0\nexpect_timeout_s = 30.0\n"
           "publish_timeout_s = 30.0\n")
    p = _start_with_faults(monkeypatch, workdir, "pnode", "write_hold_s=3", cfg)
    d = start_daemon(workdir, "dnode", cfg)
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("inflight", (1, 2), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.transfer_id == "inflight" for t in p.client.status().transfers))
        pw.send(Publish("inflight", (7, 8)))
        assert wait_for(lambda: any(t.state == "writing" for t in p.client.status().transfers))
        assert dw.send(Abort("inflight"))
        cd = dw.next_completion(30)
        writing_when_told = [t.transfer_id for t in p.client.status().transfers if t.state == "writing"]
        assert cd is not None and cd.kind is CompletionKind.FAILED and cd.code == "ABORTED", cd
        assert cd.block_ids == (1, 2)
        assert writing_when_told == [], "the decode worker was told to free blocks under a WRITE in flight"
        cp = pw.next_completion(30)
        assert cp is not None and cp.kind is CompletionKind.FAILED and cp.block_ids == (7, 8), cp
        assert wait_for(lambda: _held(p) == (0, 0) and _held(d) == (0, 0))
        # the transfer id can be used again once its FAILED came
        dw.send(Expect("inflight", (3, 4), p.peer_address, "prefill", 1))
        dw.send(Abort("inflight"))
        assert dw.next_completion(30).kind is CompletionKind.FAILED
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()
