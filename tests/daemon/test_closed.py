"""Closed by default: no peer can take, copy or stall a transfer, and every bound holds when a peer
stalls or a worker dies. Real daemons, real NIXL (UCX), real processes; a rogue peer speaks the
peer API with a NIXL agent of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from kvpushd_client import CompletionKind, Role
from kvpushd_client.proto.v1 import peer_pb2, worker_pb2, worker_pb2_grpc
from kvpushd_client.types import Expect, Publish
from support import KV, attach_pair, make_kv, start_daemon, wait_for
from support.peer import PeerSession
from test_peer_trust import session

from kvpushd.runtime.identity import agent_prefix

FAST = ("[transfer]\nheartbeat_interval_s = 0.2\npeer_timeout_s = 5.0\nexpect_timeout_s = 30.0\n"
        "publish_timeout_s = 30.0\n")


def _rogue_agent(instance: str) -> tuple[str, bytes]:
    """A NIXL agent named as the rogue daemon's own (so its metadata passes every name check)."""
    nixl_api = pytest.importorskip("nixl._api")
    name = agent_prefix("rogue", instance) + "thief"
    a = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    return name, bytes(a.get_agent_metadata())


def _request(tid: str, agent: tuple[str, bytes], blocks: list[int], rid: int = 1) -> peer_pb2.RegisterRequest:
    name, md = agent
    return peer_pb2.RegisterRequest(
        transfer_id=tid, registration_id=rid, producer_engine_id="prefill",
        producer_tp_size=1, consumer_engine_id="thief", consumer_tp_rank=0, consumer_tp_size=1,
        consumer_agent=peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind="DRAM",
                                          regions=[peer_pb2.RemoteRegion(base_addr=1 << 20, num_blocks=64,
                                                                         block_len=4096, block_stride=4096)
                                                   for _ in range(4)]),
        block_ids=blocks)


def _register(s: PeerSession, tid: str, agent: tuple[str, bytes], blocks: list[int],
              rid: int = 1) -> peer_pb2.PeerResult:
    return s.call("register", _request(tid, agent, blocks, rid))


def test_a_rogue_peer_cannot_take_over_or_copy_a_registration(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """The real decode daemon registered first; a peer that knows the transfer id registers for it
    with its own agent: refused (PERMISSION_DENIED), and the real decode worker gets the exact bytes."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    dw.send(Expect("secret", (1, 2, 3), p.peer_address, "prefill", 1))
    assert wait_for(lambda: any(t.transfer_id == "secret" for t in p.client.status().transfers))
    rogue = session(p.peer_address, "rogue")
    e = _register(rogue, "secret", _rogue_agent(rogue.instance_id), [4, 5, 6])
    assert e.code == "PERMISSION_DENIED" and "another decode daemon" in e.message, e
    pw.send(Publish("secret", (10, 11, 12)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [1, 2, 3]] == src.arr[:, [10, 11, 12]]).all()
    assert "registration refused" in p.logs()  # the attempt is logged (and counted)


def test_peer_register_is_checked_like_the_worker_api(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    attach_pair(p, d, src, dst)
    peer = session(p.peer_address, "rogue")
    agent = _rogue_agent(peer.instance_id)
    e = _register(peer, "dups", agent, [1, 1, 2])
    assert e.code == "INVALID_ARGUMENT" and "duplicates" in e.message, e
    e = _register(peer, "many", agent, list(range(64)) * (1 << 14) + [0])
    assert e.code == "INVALID_ARGUMENT" and "at most" in e.message, e
    e = _register(peer, "range", agent, [64])
    assert e.code == "INVALID_ARGUMENT" and "out of range" in e.message, e


def test_a_register_flood_is_rate_limited(workdir, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", "max_registers_per_s = 5.0\n" + FAST)
    d = start_daemon(workdir, "dnode", FAST)
    src, dst = kv_pair
    try:
        pw, dw = attach_pair(p, d, src, dst)
        peer = session(p.peer_address, "flood")
        codes = [r.code for r in peer.batch([("register", _request(f"flood-{i}", ("x", b""), [1], rid=i + 1))
                                             for i in range(200)])]  # one batch: faster than the limit
        refused = sum(c == "RESOURCE_EXHAUSTED" for c in codes)
        assert codes[0] != "RESOURCE_EXHAUSTED"
        assert refused >= 100, codes  # a burst of one second's worth (5), then 5 per second
        # the real decode daemon, a peer of its own, is not limited by the flood
        dw.send(Expect("after-flood", (5,), p.peer_address, "prefill", 1))
        pw.send(Publish("after-flood", (6,)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    finally:
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0


def _big_kv(prefix: str, fill: str) -> KV:
    return make_kv(prefix, regions=4, num_blocks=64, block_len=256 << 10, fill=fill)  # 64 MiB: more than TCP buffers


@pytest.mark.parametrize("end", ["write_timeout", "sigterm"])
def test_a_stalled_peer_is_bounded(monkeypatch, workdir, end: str) -> None:  # type: ignore[no-untyped-def]
    """The decode daemon stops making progress (SIGSTOP) with a WRITE into it in flight (UCX over
    TCP: the WRITE cannot complete). Either the WRITE's own bound (write_timeout_s) fails it on the
    prefill side, or SIGTERM of the prefill daemon drains within drain_timeout_s; either way the
    publish gets its one completion with its blocks, and nothing stays held."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    bound = "write_timeout_s = 2.0\n" if end == "write_timeout" else "write_timeout_s = 600.0\ndrain_timeout_s = 3.0\n"
    p = start_daemon(workdir, "pnode", FAST + bound)
    d = start_daemon(workdir, "dnode", FAST)
    src, dst = _big_kv("kvpushd-test-bsrc", "random"), _big_kv("kvpushd-test-bdst", "poison")
    stopped = False
    try:
        pw, dw = attach_pair(p, d, src, dst)
        blocks = list(range(64))
        dw.send(Expect("stall", tuple(blocks), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.transfer_id == "stall" for t in p.client.status().transfers))
        os.kill(d.proc.pid, signal.SIGSTOP)
        stopped = True
        pw.send(Publish("stall", tuple(blocks)))
        if end == "sigterm":
            assert wait_for(lambda: any(t.state == "writing" for t in p.client.status().transfers))
            p.proc.send_signal(signal.SIGTERM)
        c = pw.next_completion(60)
        assert c is not None and c.kind is CompletionKind.FAILED and c.block_ids == tuple(blocks), c
        if end == "write_timeout":
            assert "write_timeout_s" in c.reason, c
            assert wait_for(lambda: len(p.client.status().transfers) == 0, 30)
        else:
            assert p.proc.wait(60) == 0  # the drain ended at its bound although the peer never answered
    finally:
        if stopped:
            os.kill(d.proc.pid, signal.SIGCONT)
        for x in (p, d):
            x.client.close()
            if x.proc.poll() is None:
                x.stop()
        src.close()
        dst.close()


_WORKER = """
import json, sys, time
from kvpushd_client import KVPushClient, MemfdMemory, Publish, Region, Role
a = json.loads(sys.argv[1])
c = KVPushClient(a["sock"])
w = c.attach("prefill", Role.PRODUCER, 0, 1, [MemfdMemory(a["fd"], a["size"])],
             [Region(0, i * a["nb"] * a["bl"], a["nb"], a["bl"]) for i in range(a["regions"])])
print("attached", flush=True)
sys.stdin.readline()
w.send(Publish(a["tid"], tuple(a["blocks"])))
print("published", flush=True)
time.sleep(600)
"""


def test_sigkill_of_the_prefill_worker_mid_write(monkeypatch, workdir, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """The prefill worker process is SIGKILLed while its WRITE is in flight (the fault hook posts it
    without its notification and holds it 3 s, as a slow network would): the decode worker is told
    FAILED only once that WRITE settled (never while the prefill daemon still shows it writing, and
    the destination bytes do not change after it was told), and the killed worker's engine may
    attach again at once."""
    monkeypatch.setenv("KVPUSHD_FAULTS", "write_complete=1,write_hold_s=3")
    p = start_daemon(workdir, "pnode", FAST)
    monkeypatch.delenv("KVPUSHD_FAULTS")
    d = start_daemon(workdir, "dnode", FAST)
    src, dst = kv_pair
    worker = None
    try:
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        args = {"sock": p.sock, "fd": src.buf.fd, "size": src.buf.size, "nb": src.num_blocks, "bl": src.block_len,
                "regions": src.regions, "tid": "killed", "blocks": [7, 8]}
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, json.dumps(args)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, pass_fds=[src.buf.fd])
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().strip() == b"attached"
        dw.send(Expect("killed", (1, 2), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.transfer_id == "killed" for t in p.client.status().transfers))
        worker.stdin.write(b"go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == b"published"
        assert wait_for(lambda: any(t.state == "writing" for t in p.client.status().transfers)), (
            p.client.status().transfers, p.logs()[-3000:])
        worker.kill()
        worker.wait()
        # its engine attaches again at once (the dead worker's WRITE is still held in flight)
        again = wait_for(lambda: _try_attach(p, src), 5)
        assert again, "the killed worker's engine could not attach again while its WRITE settled"
        cd = dw.next_completion(30)
        writing_when_told = [t.transfer_id for t in p.client.status().transfers if t.state == "writing"]
        assert cd is not None and cd.kind is CompletionKind.FAILED and cd.block_ids == (1, 2), cd
        assert writing_when_told == [], "the decode worker was told to free blocks under a WRITE in flight"
        told = dst.arr[:, [1, 2]].copy()
        time.sleep(1.0)  # a watcher on the destination: nothing lands after the decode side was told
        assert np.array_equal(told, dst.arr[:, [1, 2]])
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0


def _try_attach(p, src: KV) -> bool:  # type: ignore[no-untyped-def]
    try:
        p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    except Exception:
        return False
    return True


def test_status_stays_bounded_under_a_handshake_flood(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """1,500 handshakes, each from a made-up address: the status answer stays small and answers. (All
    come from loopback, one identity: its session bound, 16 by default, is lifted here.)"""
    p = daemon_factory("pnode", settings={"peer_api": {"max_sessions_per_peer": 2000}})
    for i in range(1500):
        session(p.peer_address, f"flood-{i}", own_address=f"127.0.{i // 250}.{i % 250}:7700").close()
    st = p.client.status()
    assert len(st.peers) <= 256 and st.peers_omitted >= 1500 - 256, (len(st.peers), st.peers_omitted)
    assert st.ByteSize() < 1 << 20
    out = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", p.sock, "status", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_worker_socket_has_its_own_small_message_limit(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, _ = daemon_pair
    stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(f"unix:{p.sock}"))
    big = worker_pb2.CommandBatch(worker_id="w", commands=[worker_pb2.Command(seq=1, expect=worker_pb2.ExpectRequest(
        transfer_id="t", block_ids=[1 << 27] * (3 << 20)))])
    assert big.ByteSize() > 8 << 20
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Stream(iter([big]), timeout=30))
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert p.client.status().node_id == "pnode"  # and the daemon goes on
