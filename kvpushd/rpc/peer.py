"""PeerService: what other nodes' daemons call over TCP (a Handshake, then their Channel)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc

from .. import PROTOCOL_VERSION
from ..core import notif
from ..core.errors import SessionUnknown
from ..peer_security import caller_ip, cert_names
from ..runtime.inbound import Hello
from ..runtime.node import Node
from .errors import stream, unary
from .pump import PEER, Pump, packed, woken

Ctx = Any


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: Ctx) -> peer_pb2.HandshakeResponse:
        token = self.node.handshake(Hello(request.protocol_version, request.compat_hash, request.node_id,
                                          request.peer_address, request.instance_id,
                                          metadata_of(context, "kvpushd-session"), tls_names_of(context),
                                          host_of(context)))
        return peer_pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(),
                                          node_id=self.node.ident.node_id, instance_id=self.node.ident.instance_id,
                                          session_token=token)

    @stream
    async def Channel(self, request_iterator: Any, context: Ctx) -> AsyncIterator[peer_pb2.PeerBatch]:
        """One caller's long-lived stream: its session is checked here, once, and again per batch
        (one that ended since, because the daemon forgot an idle peer or a restart replaced it,
        has its items answered SessionUnknown); then each item goes through the pump."""
        instance, token = metadata_of(context, "kvpushd-instance"), metadata_of(context, "kvpushd-session")
        if not self.node.inbound.session_ok(instance, token):
            raise SessionUnknown(f"unknown caller instance {instance[:256]!r} or session: handshake first")

        def live(batch: peer_pb2.PeerBatch) -> SessionUnknown | None:
            self.node.inbound.channel_counts(instance, batches=1)
            if self.node.inbound.session_ok(instance, token):
                return None
            return SessionUnknown(f"the session of caller instance {instance[:64]!r} ended: handshake again")

        wake = asyncio.Event()
        pump = Pump(self.node, PEER, instance, wake.set, live)
        self.node.inbound.channel_counts(instance, streams=1)
        try:
            async for results, _ in pump.serve(request_iterator.__aiter__(), woken(wake)):
                for batch in packed(peer_pb2.PeerBatch, [("items", results)]):
                    yield batch
        finally:
            self.node.inbound.channel_counts(instance, streams=-1)


def tls_names_of(context: Ctx) -> tuple[str, ...]:
    """The caller's client certificate CN and SANs (empty without TLS), at most 64 of 256 characters."""
    auth = {k: list(v) for k, v in (context.auth_context() or {}).items()}
    return tuple(n[:256] for n in cert_names(auth)[:64])


def host_of(context: Ctx) -> str:
    """The caller's source address without its port ("ipv4:10.0.0.5:41234" -> "10.0.0.5")."""
    peer = str(context.peer() or "")
    return caller_ip(peer) or peer[:256]


def metadata_of(context: Ctx, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value[:256] if isinstance(value, str) else ""
    return ""
