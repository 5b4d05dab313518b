"""Peers cannot act for each other: agents belong to the daemon that introduced them, NIXL metadata
must name the agent it is registered as, failure notices only count from the daemon a registration
was sent to, and attaches are bounded before any memory is registered."""

from __future__ import annotations

import threading
import uuid
from concurrent import futures

import grpc
import pytest
from kvpushd_client import CompletionKind, Expect, KVPushError, Publish, Region, Role
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc
from support import attach_pair, wait_for
from support.peer import PeerSession

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.runtime.identity import agent_prefix, metadata_agent_name


def test_metadata_agent_name() -> None:
    nixl_api = pytest.importorskip("nixl._api")
    a = nixl_api.nixl_agent("kvpushd.n.12345678.e.tp0.pp0.w1",
                            nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    md = bytes(a.get_agent_metadata())
    assert metadata_agent_name(md) == "kvpushd.n.12345678.e.tp0.pp0.w1"
    for bad in (b"", b"garbage", md[:20], b"nixlSerDes|Agent" + (10**9).to_bytes(8, "little") + b"x",
                b"nixlSerDes|Agent" + (2).to_bytes(8, "little") + b"\xff\xfe"):
        assert metadata_agent_name(bad) is None
    assert agent_prefix("node-a", "0123456789abcdef") == "kvpushd.node-a.01234567."


def session(address: str, node_id: str, instance: str = "", own_address: str = "127.0.0.1:1") -> PeerSession:
    """A peer session as ``instance`` (the client's call-and-wait helper over the Channel)."""
    return PeerSession(address, PROTOCOL_VERSION, notif.compat_hash(), node_id, instance, own_address)


def test_forged_agents_refused(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    real_agent = next(w.agent_name for w in d.client.status().workers)
    evil = session(p.peer_address, "evil")

    def register(name: str, md: bytes) -> peer_pb2.PeerResult:
        req = peer_pb2.RegisterRequest(
            transfer_id="forged", registration_id=1, producer_engine_id="prefill",
            producer_tp_size=1, consumer_engine_id="x", consumer_tp_rank=0, consumer_tp_size=1,
            consumer_agent=peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind="DRAM",
                                              regions=[peer_pb2.RemoteRegion(base_addr=4096, num_blocks=8,
                                                                             block_len=64, block_stride=64)]),
            block_ids=[0])
        return evil.call("register", req)

    # another daemon's agent (name of the real decode worker), with or without metadata
    e = register(real_agent, b"")
    assert e.code == "PERMISSION_DENIED" and "not one of the calling daemon's" in e.message
    # our own prefix, but metadata that names another agent (loading it would replace that agent)
    nixl_api = pytest.importorskip("nixl._api")
    other = nixl_api.nixl_agent(real_agent + "-twin",
                                nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    e = register(agent_prefix("evil", evil.instance_id) + "a", bytes(other.get_agent_metadata()))
    assert e.code == "PERMISSION_DENIED" and "metadata names agent" in e.message, e.message
    # the real pair still moves exact bytes
    dw.send(Expect("after-forgery", (1, 2), p.peer_address, "prefill", 1))
    pw.send(Publish("after-forgery", (5, 6)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [1, 2]] == src.arr[:, [5, 6]]).all()


class FakePrefill(peer_pb2_grpc.PeerServiceServicer):
    """A prefill daemon that accepts registrations and never writes."""

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex
        self.registrations: list[peer_pb2.RegisterRequest] = []
        self.got = threading.Event()

    def Handshake(self, request, context):  # type: ignore[no-untyped-def]
        return peer_pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(),
                                          node_id="fakep", instance_id=self.instance)

    def Channel(self, request_iterator, context):  # type: ignore[no-untyped-def]
        """Items on one stream, each answered OK."""
        for batch in request_iterator:
            out = peer_pb2.PeerBatch()
            for it in batch.items:
                kind = it.WhichOneof("item")
                if kind == "register":
                    self.registrations.append(it.register)
                    self.got.set()
                r = out.items.add(seq=it.seq).result
                r.code = "OK"
                if kind == "heartbeat":
                    r.heartbeat.instance_id = self.instance
                    r.heartbeat.knows_caller = True
            yield out


def test_failure_notice_only_from_the_producer(daemon_pair, kv_pair) -> None:
    p, d = daemon_pair
    src, dst = kv_pair
    _, dw = attach_pair(p, d, src, dst)
    fake = FakePrefill()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    peer_pb2_grpc.add_PeerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        dw.send(Expect("t-notice", (3, 4), f"127.0.0.1:{port}", "fakep", 1))
        assert fake.got.wait(20)
        rid = fake.registrations[0].registration_id

        def notice(s: PeerSession, tid: str, rid: int = rid, md=None) -> peer_pb2.PeerResult:  # type: ignore[no-untyped-def]
            item = peer_pb2.FailNotice(transfer_id=tid, registration_id=rid, reason="forged")
            return s.batch([("fail", item)], md)[0]

        # a third daemon that knows the registration id may not fail it
        r = notice(session(d.peer_address, "evil"), "t-notice")
        assert r.code == "PERMISSION_DENIED", r.message
        # nor may the right daemon under another transfer id, or with a guessed registration id
        right = session(d.peer_address, "fakep", fake.instance, f"127.0.0.1:{port}")
        assert notice(right, "t-other").code == "PERMISSION_DENIED"
        assert notice(right, "t-notice", rid ^ 1).code == "OK"  # no such registration: ignored
        # a third party naming the right daemon's instance id, without its session token
        with pytest.raises(grpc.RpcError) as ei:
            notice(right, "t-notice", md=(("kvpushd-session", "guess"), ("kvpushd-instance", fake.instance)))
        assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        # or claiming that instance id in a handshake of its own while it has transfers pending: d
        # holds none for fakep here, so the claim starts a new session and the old token is void
        assert dw.completions() == []
        # the daemon it was sent to may
        assert notice(right, "t-notice").code == "OK"
        c = dw.next_completion(20)
        assert c is not None and c.kind is CompletionKind.FAILED and "forged" in c.reason
        assert sorted(c.block_ids) == [3, 4]
        assert wait_for(lambda: not d.client.status().transfers)
    finally:
        server.stop(None)


def test_attach_descriptor_bound(daemon_pair, kv_pair) -> None:
    p, _ = daemon_pair
    src, _ = kv_pair
    # 4096 regions of 65,536 one-byte blocks: 2^28 descriptors, far past the default bound
    regions = [Region(0, 0, 65536, 1)] * 4096
    with pytest.raises(KVPushError) as ei:
        p.client.attach("huge", Role.PRODUCER, 0, 1, [src.buf.memory], regions)
    assert ei.value.code == "INVALID_ARGUMENT" and "max_attach_descriptors" in ei.value.message
    with pytest.raises(KVPushError) as ei:
        p.client.attach("wordy", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list, description="x" * 5000)
    assert ei.value.code == "INVALID_ARGUMENT" and "description" in ei.value.message
    assert list(p.client.status().workers) == []


def test_instance_id_is_not_a_credential(daemon_pair, kv_pair) -> None:
    """An instance id is public (every handshake answer tells it): knowing the decode daemon's, a third
    party can neither call as it nor take over its session while it has registrations pending."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    # learn d's instance id the way anyone can: handshake with d
    d_instance = session(d.peer_address, "nosy").hello.instance_id
    dw.send(Expect("pending", (1, 2), p.peer_address, "prefill", 1))  # d now has a session at p, with a registration
    assert wait_for(lambda: any(t.transfer_id == "pending" for t in p.client.status().transfers))
    stub = peer_pb2_grpc.PeerServiceStub(grpc.insecure_channel(p.peer_address))
    forged = peer_pb2.PeerBatch(items=[peer_pb2.PeerItem(seq=1, withdraw=peer_pb2.FailNotice(
        transfer_id="pending", registration_id=1))])
    for md in ((("kvpushd-instance", d_instance),), (("kvpushd-session", "0" * 32), ("kvpushd-instance", d_instance))):
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Channel(iter([forged]), timeout=10, metadata=md))
        assert ei.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as ei:  # claiming d's instance id in a handshake
        stub.Handshake(peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(),
                                                 node_id="dnode", peer_address="127.0.0.1:3", instance_id=d_instance),
                       timeout=10)
    assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED
    pw.send(Publish("pending", (7, 8)))  # d's session is intact: the transfer lands exactly
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [1, 2]] == src.arr[:, [7, 8]]).all()
