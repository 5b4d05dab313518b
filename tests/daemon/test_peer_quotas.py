"""Per-peer quotas are per identity (its TLS certificate, else the host it connects from), not per
session: two decode daemons on one host share one block quota, and one host opens at most
peer_api.max_sessions_per_peer sessions. Real daemons, real NIXL."""

from __future__ import annotations

import uuid

import grpc
import pytest
from kvpushd_client import CompletionKind, Role
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc
from support import make_kv, wait_for

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif


def _hello(address: str) -> peer_pb2.HandshakeResponse:
    stub = peer_pb2_grpc.PeerServiceStub(grpc.insecure_channel(address))
    return stub.Handshake(peer_pb2.HandshakeRequest(  # type: ignore[no-any-return]
        protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id="many",
        peer_address="127.0.0.1:1", instance_id=uuid.uuid4().hex), timeout=10)


def test_sessions_of_one_host_share_its_block_quota(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    p = daemon_factory("pnode", settings={"peer_api": {"max_blocks_per_peer": 100}})
    d1, d2 = daemon_factory("dnode1"), daemon_factory("dnode2")  # two sessions from one host (loopback)
    src = make_kv("kvp-q-src", regions=1, num_blocks=128)
    dst1 = make_kv("kvp-q-d1", regions=1, num_blocks=128, fill="poison")
    dst2 = make_kv("kvp-q-d2", regions=1, num_blocks=128, fill="poison")
    try:
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        w1 = d1.client.attach("decode", Role.CONSUMER, 0, 1, [dst1.buf.memory], dst1.region_list)
        w2 = d2.client.attach("decode", Role.CONSUMER, 0, 1, [dst2.buf.memory], dst2.region_list)
        w1.expect("first", list(range(60)), p.peer_address, "prefill", 1)
        assert wait_for(lambda: any(t.transfer_id == "first" for t in p.client.status().transfers))
        w2.expect("second", list(range(60)), p.peer_address, "prefill", 1)  # 120 > 100 for the host
        c = w2.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED, c
        assert "100 (peer_api.max_blocks_per_peer)" in c.reason and "host:127.0.0.1" in c.reason, c.reason
        pw.publish("first", list(range(60, 120)))  # the first goes through; its blocks come back to the quota
        assert w1.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert (dst1.arr[0, :60] == src.arr[0, 60:120]).all()
        w2.expect("third", list(range(60)), p.peer_address, "prefill", 1)
        pw.publish("third", list(range(60)))
        assert w2.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert (dst2.arr[0, :60] == src.arr[0, :60]).all()
    finally:
        for kv in (src, dst1, dst2):
            kv.close()


def test_one_host_opens_a_bounded_number_of_sessions(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    p = daemon_factory("pnode", settings={"peer_api": {"max_sessions_per_peer": 3}})
    for _ in range(3):
        assert _hello(p.peer_address).session_token
    with pytest.raises(grpc.RpcError) as ei:
        _hello(p.peer_address)
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 3 (peer_api.max_sessions_per_peer)" in (ei.value.details() or "")
    assert p.client.status()  # the daemon goes on
