"""The peer Channel stream (protocol 5, the only peer API besides Handshake): one long-lived stream per
calling daemon and peer, batches of items answered each on its own by seq, the session checked once
when the stream opens.

Real daemons and real NIXL throughout; a fake prefill daemon (a gRPC server in this process) only
where a test must see the batches a decode daemon writes, and raw streams only where a test must send
what a daemon never would.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from kvpushd_client import Abort, CompletionKind, Expect, Publish, Role
from kvpushd_client.proto.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from support import POISON, make_kv, start_daemon, wait_for

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.runtime.identity import agent_prefix

LONG = "[transfer]\nexpect_timeout_s = 60.0\npublish_timeout_s = 60.0\n"
CHANNEL = "/kvpushd.v1.PeerService/Channel"


def handshake(address: str, node_id: str = "raw") -> tuple[grpc.Channel, str, str]:
    """A raw peer session: (channel, instance id, session token)."""
    instance = uuid.uuid4().hex
    chan = grpc.insecure_channel(address)
    resp = peer_pb2_grpc.PeerServiceStub(chan).Handshake(peer_pb2.HandshakeRequest(
        protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id=node_id,
        peer_address="127.0.0.1:1", instance_id=instance), timeout=10)
    return chan, instance, resp.session_token


def session_md(instance: str, token: str) -> tuple[tuple[str, str], ...]:
    return (("kvpushd-session", token), ("kvpushd-instance", instance))


def stream(chan: grpc.Channel, batches: list[Any], md: Any, raw: bool = False) -> tuple[grpc.StatusCode, str,
                                                                                        list[peer_pb2.PeerItem]]:
    """Send batches on one Channel stream, half-close, and read every answer: (status, details, results)."""
    if raw:
        call = chan.stream_stream(CHANNEL)(iter(batches), timeout=20, metadata=md)
        try:
            got = [it for b in call for it in peer_pb2.PeerBatch.FromString(b).items]
            return grpc.StatusCode.OK, "", got
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []  # type: ignore[attr-defined]
    stub = peer_pb2_grpc.PeerServiceStub(chan)
    try:
        got = [it for b in stub.Channel(iter(batches), timeout=20, metadata=md) for it in b.items]
        return grpc.StatusCode.OK, "", got
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []  # type: ignore[attr-defined]


def test_a_stream_without_a_live_session_is_refused_once_at_open(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, _ = daemon_pair
    chan, instance, token = handshake(p.peer_address)
    beat = peer_pb2.PeerBatch(items=[peer_pb2.PeerItem(seq=1, heartbeat=peer_pb2.HeartbeatRequest())])
    for md in ((), (("kvpushd-instance", instance),), session_md(instance, "0" * 32),
               session_md(uuid.uuid4().hex, token), (("kvpushd-session", token),)):
        code, details, got = stream(chan, [beat], md)
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "handshake first" in details, (md, code, details)
        assert not got
    code, details, got = stream(chan, [beat, beat], session_md(instance, token))
    assert code is grpc.StatusCode.OK, details
    assert [(it.seq, it.result.code, it.result.heartbeat.knows_caller) for it in got] == [(1, "OK", True)] * 2
    assert got[0].result.heartbeat.instance_id == p.client.status().instance_id
    # an item without an operation, or a result sent to the callee, fails alone
    empty, result = peer_pb2.PeerItem(seq=2), peer_pb2.PeerItem(seq=3, result=peer_pb2.PeerResult(code="OK"))
    own = peer_pb2.PeerItem(seq=4, heartbeat=peer_pb2.HeartbeatRequest())
    code, _, got = stream(chan, [peer_pb2.PeerBatch(items=[empty, result, own])], session_md(instance, token))
    assert code is grpc.StatusCode.OK
    assert [(it.seq, it.result.code) for it in got] == [(2, "INVALID_ARGUMENT"), (3, "INVALID_ARGUMENT"), (4, "OK")]
    chan.close()


def consumer_agent(node: str, instance: str) -> tuple[Any, peer_pb2.AgentInfo]:
    """A real NIXL agent named as ``instance``'s agents must be, with its metadata (no memory: nothing
    is ever written to it, the registrations are withdrawn)."""
    nixl_api = pytest.importorskip("nixl._api")
    name = agent_prefix(node, instance) + "a"
    agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    info = peer_pb2.AgentInfo(agent_name=name, agent_metadata=bytes(agent.get_agent_metadata()),
                              memory_kind="DRAM",
                              regions=[peer_pb2.RemoteRegion(base_addr=4096, num_blocks=64, block_len=4096,
                                                             block_stride=4096)] * 4)
    return agent, info


def test_items_of_a_batch_are_handled_in_order_and_each_answered(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, _ = daemon_pair
    src, _ = kv_pair
    p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    chan, instance, token = handshake(p.peer_address, "orderly")
    agent, info = consumer_agent("orderly", instance)

    bare = peer_pb2.AgentInfo(agent_name=info.agent_name, memory_kind="DRAM")

    def reg(seq: int, tid: str, rid: int, blocks: list[int]) -> peer_pb2.PeerItem:
        return peer_pb2.PeerItem(seq=seq, register=peer_pb2.RegisterRequest(
            transfer_id=tid, registration_id=rid, producer_engine_id="prefill", producer_tp_size=1,
            consumer_engine_id="orderly-decode", consumer_tp_rank=0, consumer_tp_size=1,
            consumer_agent=info if seq == 10 else bare, block_ids=blocks))

    def withdraw(seq: int, tid: str, rid: int) -> peer_pb2.PeerItem:
        return peer_pb2.PeerItem(seq=seq, withdraw=peer_pb2.FailNotice(
            transfer_id=tid, registration_id=rid, code=common_pb2.FAILURE_ABORTED, reason="test"))

    # In order: the agent's metadata rides on the first item only, so the later ones find the agent
    # known only if the first was handled before them; "a" registered then withdrawn is gone; "b"
    # withdrawn first stays withdrawn (the core drops a Register of a withdrawn id). A bad item (a
    # block id out of the consumer's range) in the middle fails alone.
    batch = peer_pb2.PeerBatch(items=[reg(10, "a", 1, [1]), withdraw(11, "a", 1), reg(12, "bad", 3, [64]),
                                      withdraw(13, "b", 2), reg(14, "b", 2, [2]),
                                      reg(15, "c", 4, [3])])
    code, details, got = stream(chan, [batch], session_md(instance, token))
    assert code is grpc.StatusCode.OK, details
    results = {it.seq: it.result for it in got}
    assert sorted(results) == [10, 11, 12, 13, 14, 15] and len(got) == 6  # each once
    assert [results[s].code for s in (10, 11, 13, 14, 15)] == ["OK"] * 5
    assert results[12].code == "INVALID_ARGUMENT" and "out of range" in results[12].message, results[12]
    assert not any(r.need_metadata for r in results.values())  # metadata rode on the first item only
    pending = {t.transfer_id for t in p.client.status().transfers}
    assert pending == {"c"}, pending
    code, _, got = stream(chan, [peer_pb2.PeerBatch(items=[withdraw(1, "b", 2), withdraw(2, "c", 4)])],
                          session_md(instance, token))
    assert code is grpc.StatusCode.OK and [it.result.code for it in got] == ["OK", "OK"]
    assert wait_for(lambda: not p.client.status().transfers, 10)
    # status counts that caller's Channel: two streams, one batch each, none open now
    (peer,) = [x for x in p.client.status().peers if x.instance_id == instance]
    assert (peer.inbound_streams, peer.stream_batches_received, peer.streams_opened) == (0, 2, 0), peer
    del agent
    chan.close()


def test_malformed_batches_get_a_clear_status_and_the_daemon_goes_on(workdir) -> None:  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", "max_message_bytes = 1048576\n")
    d = start_daemon(workdir, "dnode")
    src, dst = make_kv("kvpushd-test-msrc"), make_kv("kvpushd-test-mdst", fill="poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        chan, instance, token = handshake(p.peer_address)
        md = session_md(instance, token)
        good = peer_pb2.PeerBatch(items=[peer_pb2.PeerItem(seq=1, heartbeat=peer_pb2.HeartbeatRequest())])
        cases = [
            ([b"\xff\xff\xff\xff garbage"], grpc.StatusCode.INVALID_ARGUMENT, "malformed PeerBatch"),
            ([good.SerializeToString(), b"\x0a\xff\xff\xff\xff\x0f"], grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
            ([b"\x0a\x00" * (600 << 10)], grpc.StatusCode.RESOURCE_EXHAUSTED, ""),  # over max_message_bytes
        ]
        for batches, want, words in cases:
            code, details, _ = stream(chan, batches, md, raw=True)
            assert code is want and words in details, (want, code, details)
        # a batch over the item limit is refused unparsed: its stream ends RESOURCE_EXHAUSTED, saying why
        code, details, got = stream(chan, [peer_pb2.PeerBatch(items=[peer_pb2.PeerItem(seq=i) for i in range(5000)])],
                                    md)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4096" in details, (code, details)
        # an item asking for absurd sizes fails alone; an item of no kind too
        huge = peer_pb2.PeerItem(seq=7, register=peer_pb2.RegisterRequest(
            transfer_id="huge", registration_id=9, producer_engine_id="prefill", producer_tp_size=1,
            consumer_tp_size=2**32 - 1, consumer_agent=peer_pb2.AgentInfo(
                agent_name=agent_prefix("raw", instance) + "x", agent_metadata=b"x" * 1000, memory_kind="DRAM",
                regions=[peer_pb2.RemoteRegion(num_blocks=2**32 - 1, block_len=2**63, block_stride=2**63)] * 5000),
            block_ids=[2**32 - 1]))
        code, details, got = stream(chan, [peer_pb2.PeerBatch(items=[huge, peer_pb2.PeerItem(seq=8),
                                                                     good.items[0]])], md)
        assert code is grpc.StatusCode.OK, details
        assert [(it.seq, it.result.code) for it in got] == [(7, "INVALID_ARGUMENT"), (8, "INVALID_ARGUMENT"),
                                                            (1, "OK")], got
        chan.close()
        # the daemon goes on: a real transfer lands
        dw.send(Expect("after", (3, 4), p.peer_address, "prefill", 1))
        pw.send(Publish("after", (7, 8)))
        assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        assert (dst.arr[:, [3, 4]] == src.arr[:, [7, 8]]).all()
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()
        src.close()
        dst.close()


def test_one_bad_registration_among_good_ones_fails_alone_and_the_rest_land(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    plan = {"g0": ([1, 2], [10, 11]), "g1": ([3], [12]), "g2": ([4, 5, 6], [13, 14, 15])}
    dw.send_nowait(Expect("g0", tuple(plan["g0"][0]), p.peer_address, "prefill", 1))
    dw.send_nowait(Expect("bad", (7,), p.peer_address, "nobody-here", 1))  # no such prefill engine on that node
    dw.send_nowait(Expect("g1", tuple(plan["g1"][0]), p.peer_address, "prefill", 1))
    dw.send_nowait(Expect("g2", tuple(plan["g2"][0]), p.peer_address, "prefill", 1))
    dw.step()  # one batch: one PeerBatch to the prefill daemon
    c = dw.next_completion(30)
    assert c is not None and (c.transfer_id, c.kind, c.code) == ("bad", CompletionKind.FAILED, "PEER_REJECTED"), c
    assert "NOT_FOUND" in c.reason and "nobody-here" in c.reason, c.reason
    for tid, (_, sb) in plan.items():
        pw.send(Publish(tid, tuple(sb)))
    got = {}
    while len(got) < 3:
        c = dw.next_completion(30)
        assert c is not None, got
        assert c.transfer_id not in got
        got[c.transfer_id] = c
    assert {t: c.kind for t, c in got.items()} == {t: CompletionKind.FINISHED_RECEIVING for t in plan}
    for _, (db, sb) in plan.items():
        assert np.array_equal(dst.arr[:, db], src.arr[:, sb])  # bit-exact
    assert (dst.arr[:, 7] == POISON).all()
    assert dw.next_completion(0.5) is None


class FakePrefill(grpc.GenericRpcHandler):
    """A prefill daemon that records every PeerBatch a decode daemon writes and accepts every item."""

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex
        self.batches: list[peer_pb2.PeerBatch] = []
        self.unary: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        name = details.method.rsplit("/", 1)[-1]
        if name == "Channel":
            return grpc.stream_stream_rpc_method_handler(self.channel, peer_pb2.PeerBatch.FromString,
                                                         peer_pb2.PeerBatch.SerializeToString)
        if name == "Handshake":
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: peer_pb2.HandshakeResponse(
                    protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id="fake",
                    instance_id=self.instance, session_token="t" * 32),
                peer_pb2.HandshakeRequest.FromString, peer_pb2.HandshakeResponse.SerializeToString)

        def refuse(req: bytes, ctx: Any) -> bytes:
            self.unary[name] += 1
            ctx.abort(grpc.StatusCode.UNIMPLEMENTED, "the fake only serves the stream")
            return b""

        return grpc.unary_unary_rpc_method_handler(refuse)

    def channel(self, requests: Any, ctx: Any) -> Any:
        for batch in requests:
            with self.lock:
                self.batches.append(batch)
            out = peer_pb2.PeerBatch()
            for it in batch.items:
                r = out.items.add(seq=it.seq).result
                r.code = "OK"
                if it.WhichOneof("item") == "heartbeat":
                    r.heartbeat.instance_id = self.instance
                    r.heartbeat.knows_caller = True
            yield out

    def items(self, kind: str) -> list[tuple[int, peer_pb2.PeerItem]]:
        with self.lock:
            return [(i, it) for i, b in enumerate(self.batches) for it in b.items if it.WhichOneof("item") == kind]


def test_a_decode_daemon_writes_one_batch_per_turn_in_order_with_heartbeats_on_the_stream(workdir) -> None:  # type: ignore[no-untyped-def]
    fake = FakePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[fake])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    d = start_daemon(workdir, "dnode", LONG + "heartbeat_interval_s = 0.2\n")
    dst = make_kv("kvpushd-test-fdst", fill="poison")
    try:
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        tids = [f"o{i}" for i in range(16)]
        for i, tid in enumerate(tids):
            dw.send_nowait(Expect(tid, (i,), f"127.0.0.1:{port}", "prefill", 1))
        dw.step()
        assert wait_for(lambda: len(fake.items("register")) == 16, 30), fake.batches
        regs = fake.items("register")
        assert [it.register.transfer_id for _, it in regs] == tids  # in order
        assert len({i for i, _ in regs}) == 1  # one PeerBatch: one write for the turn
        assert [it.register.consumer_agent.agent_metadata != b"" for _, it in regs] == [True] + [False] * 15
        # registered and waiting: heartbeats ride on the stream, no unary call is made
        assert wait_for(lambda: len(fake.items("heartbeat")) >= 3, 30)
        for tid in tids:
            dw.send_nowait(Abort(tid))
        dw.step()
        assert wait_for(lambda: len(fake.items("withdraw")) == 16, 30)
        got = []
        while len(got) < 16:
            c = dw.next_completion(30)
            assert c is not None, got
            got.append(c)
        assert sorted(c.transfer_id for c in got) == sorted(tids)
        assert {(c.kind, c.code) for c in got} == {(CompletionKind.FAILED, "ABORTED")}
        assert not fake.unary, fake.unary
        # status (and kvpushctl peers) count the decode daemon's Channel: one stream, its batches
        (peer,) = [x for x in d.client.status().peers if x.address == f"127.0.0.1:{port}"]
        assert peer.streams_opened == 1 and peer.stream_batches_sent >= 3 and peer.inbound_streams == 0, peer
        ctl = subprocess.run([sys.executable, "-m", "kvpushd.ctl", "--socket", d.sock, "peers"],
                             capture_output=True, text=True, timeout=60)
        assert ctl.returncode == 0 and "STREAM" in ctl.stdout and "out 1/" in ctl.stdout, ctl.stdout + ctl.stderr
        beats = len(fake.items("heartbeat"))
        with fake.lock:
            assert len(fake.batches) <= 2 + beats + 16, len(fake.batches)  # 16 registers went in one
    finally:
        d.client.close()
        d.stop()
        server.stop(None)
        dst.close()


def collect(w: Any, n: int, wait_s: float) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + wait_s
    while len(got) < n and time.monotonic() < deadline:
        c = w.next_completion(max(0.1, deadline - time.monotonic()))
        if c is not None:
            got.append(c)
    return got


def test_a_peer_killed_mid_batch_ends_every_request_on_the_stream_once(workdir) -> None:  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", LONG + "peer_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n")
    d = start_daemon(workdir, "dnode", "connect_timeout_s = 2.0\nrpc_timeout_s = 3.0\n" + LONG
                     + "peer_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n")
    src, dst = make_kv("kvpushd-test-ksrc"), make_kv("kvpushd-test-kdst", fill="poison")
    stopped = False
    try:
        p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        for i in range(6):  # registered, waiting for a publish that never comes
            dw.send_nowait(Expect(f"r{i}", (i,), p.peer_address, "prefill", 1))
        dw.step()
        assert wait_for(lambda: len(p.client.status().transfers) == 6, 30)
        os.kill(p.proc.pid, signal.SIGSTOP)
        stopped = True
        for i in range(6, 12):  # written to the stream, never answered
            dw.send_nowait(Expect(f"u{i}", (i,), p.peer_address, "prefill", 1))
        dw.step()
        time.sleep(0.3)
        os.kill(p.proc.pid, signal.SIGKILL)  # the stream breaks mid-batch
        p.proc.wait(10)
        stopped = False
        # bound: peer_timeout_s for the registered ones, rpc_timeout_s for the unanswered; generous here
        got = collect(dw, 12, 60)
        want = [f"r{i}" for i in range(6)] + [f"u{i}" for i in range(6, 12)]
        assert sorted(c.transfer_id for c in got) == sorted(want)
        assert {(c.kind, c.code) for c in got} == {(CompletionKind.FAILED, "PEER_UNREACHABLE")}, got
        assert dw.next_completion(1) is None  # once each
        assert not d.client.status().transfers
    finally:
        if stopped:
            os.kill(p.proc.pid, signal.SIGCONT)
        d.client.close()
        d.stop()
        p.stop()
        src.close()
        dst.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def test_back_pressure_from_a_stopped_peer_is_bounded_and_it_recovers(workdir) -> None:  # type: ignore[no-untyped-def]
    p = start_daemon(workdir, "pnode", LONG)
    d = start_daemon(workdir, "dnode", "connect_timeout_s = 2.0\nrpc_timeout_s = 2.0\nmax_stream_items = 256\n"
                     + LONG + "peer_timeout_s = 4.0\nheartbeat_interval_s = 0.5\n")
    dsrc = make_kv("kvpushd-test-bpsrc", regions=1, num_blocks=64, block_len=64)
    dst = make_kv("kvpushd-test-bpdst", regions=1, num_blocks=4096, block_len=64, fill="poison")
    stopped = False
    try:
        pw2 = p.client.attach("prefill2", Role.PRODUCER, 0, 1, [dsrc.buf.memory], dsrc.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send_nowait(Expect("warm", (0,), p.peer_address, "prefill2", 1))  # the stream is open and in use
        dw.step()
        pw2.send(Publish("warm", (1,)))
        assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert pw2.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        rss0 = rss_mib(d.proc.pid)
        os.kill(p.proc.pid, signal.SIGSTOP)
        stopped = True
        n = 3000
        for step in range(30):  # many steps of many items: far more than the stream's bound
            for i in range(100):
                k = 1 + step * 100 + i
                dw.send_nowait(Expect(f"bp{k}", (k,), p.peer_address, "prefill2", 1))
            dw.step()
        got = collect(dw, n, 120)
        rss1 = rss_mib(d.proc.pid)
        assert len(got) == n and len({c.transfer_id for c in got}) == n, len(got)
        assert {(c.kind, c.code) for c in got} == {(CompletionKind.FAILED, "PEER_UNREACHABLE")}, \
            collections.Counter((c.kind, c.code) for c in got)
        reasons = collections.Counter("not reading" in c.reason or "no answer" in c.reason
                                      or "did not take" in c.reason for c in got)
        assert reasons[True] > 0, got[:3]
        assert rss1 - rss0 < 200, (rss0, rss1)  # bounded (3000 requests' own state included)
        assert not d.client.status().transfers
        os.kill(p.proc.pid, signal.SIGCONT)
        stopped = False
        # new requests work again (the daemon handshakes anew and opens a new stream)
        def lands() -> bool:
            tid = f"after-{uuid.uuid4().hex[:6]}"
            dw.send_nowait(Expect(tid, (4000,), p.peer_address, "prefill2", 1))
            dw.step()
            pw2.send(Publish(tid, (2,)))
            c = dw.next_completion(20)
            while c is not None and c.transfer_id != tid:
                c = dw.next_completion(20)
            pc = pw2.next_completion(20)
            while pc is not None and pc.transfer_id != tid:
                pc = pw2.next_completion(20)
            return c is not None and c.kind is CompletionKind.FINISHED_RECEIVING
        assert wait_for(lands, 60, interval=1.0)
        assert np.array_equal(dst.arr[:, [4000]], dsrc.arr[:, [2]])
    finally:
        if stopped:
            os.kill(p.proc.pid, signal.SIGCONT)
        for x in (p, d):
            x.client.close()
            x.stop()
        dsrc.close()
        dst.close()


def test_a_decode_daemon_whose_stream_broke_is_dropped_after_a_short_grace(workdir) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the decode daemon: its Channel stream ends, nothing comes after it, and the prefill
    daemon drops its registrations after 3 heartbeat intervals, not after peer_timeout_s (10 s here:
    the default); what does not depend on that daemon (a publish still waiting) stays."""
    p = start_daemon(workdir, "pnode", LONG + "peer_timeout_s = 10.0\nheartbeat_interval_s = 1.0\n")
    d = start_daemon(workdir, "dnode", LONG + "peer_timeout_s = 10.0\nheartbeat_interval_s = 1.0\n")
    src, dst = make_kv("kvpushd-test-gsrc"), make_kv("kvpushd-test-gdst", fill="poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        for i in range(4):
            dw.send_nowait(Expect(f"g{i}", (i,), p.peer_address, "prefill", 1))
        dw.step()
        assert wait_for(lambda: len(p.client.status().transfers) == 4, 30)
        pw.send_nowait(Publish("waiting", (9,)))  # a publish that waits for a registration: untouched
        pw.step()
        assert pw.flush(10)
        (peer,) = [x for x in p.client.status().peers if x.inbound_streams]
        assert peer.inbound_streams == 1, peer
        d.proc.kill()
        d.proc.wait(10)
        t0 = time.monotonic()
        assert wait_for(lambda: {t.transfer_id for t in p.client.status().transfers} == {"waiting"}, 9), \
            p.client.status().transfers
        waited = time.monotonic() - t0
        assert 2.5 < waited < 9.0, waited  # the grace (3 s), well before peer_timeout_s
        assert "peer stream ended" in p.logs(), "no reason logged"
    finally:
        d.client.close()
        p.client.close()
        p.stop()
        src.close()
        dst.close()
