"""Per-peer quotas are per identity (its TLS certificate, else the host it connects from), not per
session: two decode daemons on one host share one block quota, and one host opens at most
peer_api.max_sessions_per_peer sessions. Real daemons, real NIXL."""

from __future__ import annotations

import uuid

import grpc
import pytest
from kvpushd_client import CompletionKind, Expect, Publish, Role
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc
from support import make_kv, wait_for
from support.daemons import scrape, value

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif


def _hello(address: str) -> peer_pb2.HandshakeResponse:
    stub = peer_pb2_grpc.PeerServiceStub(grpc.insecure_channel(address))
    return stub.Handshake(peer_pb2.HandshakeRequest(  # type: ignore[no-any-return]
        protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id="many",
        peer_address="127.0.0.1:1", instance_id=uuid.uuid4().hex), timeout=10)


def test_sessions_of_one_host_share_its_block_quota(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    p = daemon_factory("pnode", settings={"peer_api": {"max_blocks_per_peer": 100},
                                          "metrics": {"listen": "127.0.0.1:0"}})
    d1, d2 = daemon_factory("dnode1"), daemon_factory("dnode2")  # two sessions from one host (loopback)
    src = make_kv("kvp-q-src", regions=1, num_blocks=128)
    dst1 = make_kv("kvp-q-d1", regions=1, num_blocks=128, fill="poison")
    dst2 = make_kv("kvp-q-d2", regions=1, num_blocks=128, fill="poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        w1 = d1.client.attach("decode", Role.CONSUMER, 0, 1, [dst1.buf.memory], dst1.region_list)
        w2 = d2.client.attach("decode", Role.CONSUMER, 0, 1, [dst2.buf.memory], dst2.region_list)
        w1.send(Expect("first", tuple(range(60)), p.peer_address, "prefill", 1))
        assert wait_for(lambda: any(t.transfer_id == "first" for t in p.client.status().transfers))
        w2.send(Expect("second", tuple(range(60)), p.peer_address, "prefill", 1))  # 120 > 100 for the host
        c = w2.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED, c
        assert "100 (peer_api.max_blocks_per_peer)" in c.reason and "host:127.0.0.1" in c.reason, c.reason
        # what the identity holds, in the status and the metrics
        st = p.client.status()
        (ident,) = st.peer_identities
        assert (ident.identity, ident.sessions, ident.registrations, ident.blocks) == ("host:127.0.0.1", 2, 1, 60)
        assert ident.refused >= 1, ident
        assert {x.identity for x in st.peers if x.direction in ("inbound", "both")} == {"host:127.0.0.1"}
        m = scrape(p)
        assert value(m, "kvpushd_peer_identities") == 1
        assert value(m, "kvpushd_peer_quota_use_ratio", quota="blocks") == 0.6
        assert value(m, "kvpushd_peer_quota_use_ratio", quota="sessions") == 2 / 16
        # the first goes through; its blocks come back to the quota
        pw.send(Publish("first", tuple(range(60, 120))))
        assert w1.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert (dst1.arr[0, :60] == src.arr[0, 60:120]).all()
        w2.send(Expect("third", tuple(range(60)), p.peer_address, "prefill", 1))
        pw.send(Publish("third", tuple(range(60))))
        assert w2.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert (dst2.arr[0, :60] == src.arr[0, :60]).all()
        assert wait_for(lambda: p.client.status().peer_identities[0].blocks == 0)  # released when done
    finally:
        for kv in (src, dst1, dst2):
            kv.close()


def test_one_host_holds_a_bounded_number_of_sessions(daemon_factory, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """A flood of handshakes from the decode daemon's own host: past peer_api.max_sessions_per_peer
    its least recently heard sessions with no stream open and nothing pending go, never the decode
    daemon's live one; with every session live and busy, a new one is refused RESOURCE_EXHAUSTED."""
    p = daemon_factory("pnode", settings={"peer_api": {"max_sessions_per_peer": 3}})
    d = daemon_factory("dnode")
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    dw.send(Expect("before", (1,), p.peer_address, "prefill", 1))  # d's session, its stream open
    assert wait_for(lambda: any(t.transfer_id == "before" for t in p.client.status().transfers))
    for _ in range(50):
        assert _hello(p.peer_address).session_token
    assert len(p.client.status().peers) <= 3 + 1  # sessions by address, and the outbound view
    pw.send(Publish("before", (2,)))
    assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
    assert (dst.arr[:, 1] == src.arr[:, 2]).all()
    pw.detach()
    dw.detach()


def test_a_host_whose_sessions_are_all_busy_gets_no_more(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    from kvpushd.runtime.inbound import Hello, Inbound

    inbound = Inbound(lambda name: None, max_sessions=2)

    def hs(instance: str) -> str:
        return inbound.handshake(Hello(PROTOCOL_VERSION, notif.compat_hash(), "n", "10.0.0.1:1", instance,
                                       host="10.0.0.1"), lambda i: True)[0]

    hs("a")
    hs("b")
    with pytest.raises(Exception, match=r"at most 2 \(peer_api.max_sessions_per_peer\)"):
        hs("c")
