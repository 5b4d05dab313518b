"""Call and wait on a daemon's peer API, for tests: a Handshake, then items on the Channel
stream, each answered on its own (daemons talk to each other with ``kvpushd.runtime.outbound``).

    s = PeerSession("10.0.0.5:50052", PROTOCOL_VERSION, compat_hash, node_id="probe")
    (r,) = s.batch([("heartbeat", peer_pb2.HeartbeatRequest())])
    assert r.code == "OK"
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import grpc
from google.protobuf.message import Message
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc


class PeerSession:
    """One caller's session with a peer daemon (``instance_id``: made up when not given)."""

    def __init__(self, address: str, protocol_version: int, compat_hash: str, node_id: str = "tool",
                 instance_id: str = "", peer_address: str = "127.0.0.1:1", timeout_s: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        """``credentials``: a TLS channel's (the daemon's peer API under mutual TLS); None: plaintext."""
        self.channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        self.stub = peer_pb2_grpc.PeerServiceStub(self.channel)
        self.instance_id = instance_id or uuid.uuid4().hex
        self.timeout_s = timeout_s
        self.token = ""
        self.hello = self.handshake(protocol_version, compat_hash, node_id, peer_address)

    def handshake(self, protocol_version: int, compat_hash: str, node_id: str,
                  peer_address: str) -> peer_pb2.HandshakeResponse:
        """(Again) as this instance, presenting the session token; raises grpc.RpcError when refused."""
        resp: peer_pb2.HandshakeResponse = self.stub.Handshake(peer_pb2.HandshakeRequest(
            protocol_version=protocol_version, compat_hash=compat_hash, node_id=node_id, peer_address=peer_address,
            instance_id=self.instance_id), timeout=self.timeout_s, metadata=self.metadata[:1] if self.token else ())
        self.token = resp.session_token
        return resp

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a Channel stream of this session opens with."""
        return (("kvpushd-session", self.token), ("kvpushd-instance", self.instance_id))

    def batch(self, items: Sequence[tuple[str, Message]],
              metadata: tuple[tuple[str, str], ...] | None = None) -> list[peer_pb2.PeerResult]:
        """``items`` (PeerItem field, message) as one PeerBatch on a stream of their own; their results,
        in order. Raises grpc.RpcError when the stream is refused or breaks."""
        batch = peer_pb2.PeerBatch()
        for seq, (kind, msg) in enumerate(items, 1):
            getattr(batch.items.add(seq=seq), kind).CopyFrom(msg)
        got = {it.seq: it.result
               for b in self.stub.Channel(iter([batch]), timeout=self.timeout_s,
                                          metadata=self.metadata if metadata is None else metadata)
               for it in b.items}
        return [got[i] for i in range(1, len(items) + 1)]

    def call(self, kind: str, msg: Message) -> peer_pb2.PeerResult:
        """One item; its result (``code`` "OK" or why it was refused)."""
        return self.batch([(kind, msg)])[0]

    def close(self) -> None:
        self.channel.close()
