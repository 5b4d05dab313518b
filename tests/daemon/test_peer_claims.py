"""A handshake that claims another daemon's address or instance id drops nothing of that daemon's
session: a restart is taken only when proven (the session's token, the same TLS identity, or the
old session's stream ended). Real daemons, real NIXL."""

from __future__ import annotations

import uuid

import grpc
import pytest
from kvpushd_client import CompletionKind, Expect, Publish
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc
from support import attach_pair, wait_for

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif


def _hello(address: str, node_id: str, peer_address: str, instance: str) -> peer_pb2.HandshakeResponse:
    stub = peer_pb2_grpc.PeerServiceStub(grpc.insecure_channel(address))
    return stub.Handshake(peer_pb2.HandshakeRequest(  # type: ignore[no-any-return]
        protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(), node_id=node_id,
        peer_address=peer_address, instance_id=instance), timeout=10)


def test_claims_of_an_address_or_instance_drop_nothing(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    d_instance = _hello(d.peer_address, "nosy", "127.0.0.1:1", uuid.uuid4().hex).instance_id  # public
    dw.send(Expect("pending", (1, 2), p.peer_address, "prefill", 1))
    assert wait_for(lambda: any(t.transfer_id == "pending" for t in p.client.status().transfers))
    # a new instance claiming the decode daemon's address: a session of its own, d's stays
    claim = _hello(p.peer_address, "dnode", d.peer_address, uuid.uuid4().hex)
    assert claim.session_token
    assert any(t.transfer_id == "pending" for t in p.client.status().transfers)
    pw.send(Publish("pending", (7, 8)))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [1, 2]] == src.arr[:, [7, 8]]).all()
    # d's instance id, idle now (nothing pending) but live: a claim without its token is refused
    with pytest.raises(grpc.RpcError) as ei:
        _hello(p.peer_address, "dnode", d.peer_address, d_instance)
    assert ei.value.code() is grpc.StatusCode.PERMISSION_DENIED and "live peer session" in (ei.value.details() or "")
    # and d goes on with its own session, three transfers in a row
    for i in range(3):
        dw.send(Expect(f"after{i}", (10 + i,), p.peer_address, "prefill", 1))
        pw.send(Publish(f"after{i}", (20 + i,)))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        assert (dst.arr[:, 10 + i] == src.arr[:, 20 + i]).all()
