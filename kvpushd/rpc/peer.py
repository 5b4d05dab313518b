"""PeerService: what other nodes' daemons call over TCP."""

from __future__ import annotations

from typing import Any

from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc

from .. import PROTOCOL_VERSION
from ..core import notif
from ..core.errors import InvalidArgument, KvpushdError, PermissionDenied, SessionUnknown
from ..runtime.node import Node
from . import convert
from .errors import code_for, unary

Ctx = Any
MAX_BATCH = 4096  # registrations in one RegisterBatch


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def Handshake(self, request: peer_pb2.HandshakeRequest, context: Ctx) -> peer_pb2.HandshakeResponse:
        token = self.node.handshake(request.protocol_version, request.compat_hash, request.node_id,
                                    request.peer_address, request.instance_id, session_of(context))
        return peer_pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(),
                                          node_id=self.node.ident.node_id, instance_id=self.node.ident.instance_id,
                                          session_token=token)

    @unary
    async def Register(self, request: peer_pb2.RegisterRequest, context: Ctx) -> peer_pb2.RegisterResponse:
        self._known(request.caller_instance_id, context)
        return peer_pb2.RegisterResponse(need_metadata=not self._register(request))

    @unary
    async def RegisterBatch(self, request: peer_pb2.RegisterBatchRequest,
                            context: Ctx) -> peer_pb2.RegisterBatchResponse:
        self._known(request.caller_instance_id, context)
        if len(request.registrations) > MAX_BATCH:
            raise InvalidArgument(f"{len(request.registrations)} registrations in one batch; at most {MAX_BATCH}")
        out = peer_pb2.RegisterBatchResponse()
        for r in request.registrations:
            try:
                if r.caller_instance_id != request.caller_instance_id:
                    raise PermissionDenied("a registration of the batch names another caller instance")
                out.results.add(code="OK", need_metadata=not self._register(r))
            except KvpushdError as e:  # this one fails alone
                code = code_for(e)
                if code is None:
                    raise
                out.results.add(code=code.name, message=str(e), kind=e.kind)
        return out

    def _register(self, request: peer_pb2.RegisterRequest) -> bool:
        return self.node.register(request.caller_instance_id, request.transfer_id, request.registration_id,
                                  request.producer_engine_id, request.producer_tp_size,
                                  request.consumer_engine_id, request.consumer_tp_rank, request.consumer_tp_size,
                                  convert.remote_agent(request.consumer_agent), request.block_ids,
                                  convert.transfer_mode(request.transfer_mode), skip_tokens=request.skip_tokens,
                                  traceparent=request.traceparent)

    @unary
    async def Fail(self, request: peer_pb2.FailNotice, context: Ctx) -> peer_pb2.FailAck:
        self._known(request.caller_instance_id, context)
        self.node.peer_failed(request.caller_instance_id, request.transfer_id, request.registration_id,
                              convert.failure_code(request.code), request.reason[:2000])
        return peer_pb2.FailAck()

    @unary
    async def Withdraw(self, request: peer_pb2.FailNotice, context: Ctx) -> peer_pb2.FailAck:
        self._known(request.caller_instance_id, context)
        await self.node.withdraw(request.caller_instance_id, request.transfer_id, request.registration_id,
                           convert.failure_code(request.code), request.reason)
        return peer_pb2.FailAck()

    @unary
    async def Decline(self, request: peer_pb2.DeclineNotice, context: Ctx) -> peer_pb2.FailAck:
        self._known(request.caller_instance_id, context)
        self.node.declined(request.caller_instance_id, request.transfer_id, request.producer_engine_id,
                           request.consumer_engine_id, request.reason)
        return peer_pb2.FailAck()

    @unary
    async def Offer(self, request: peer_pb2.OfferRequest, context: Ctx) -> peer_pb2.OfferResponse:
        self._known(request.caller_instance_id, context)
        ok = self.node.offer(request.caller_instance_id, request.transfer_id, request.registration_id,
                             request.producer_rank, convert.remote_agent(request.producer_agent),
                             request.block_ids)
        return peer_pb2.OfferResponse(need_metadata=not ok)

    @unary
    async def ReadFailed(self, request: peer_pb2.ReadFailedNotice, context: Ctx) -> peer_pb2.FailAck:
        self._known(request.caller_instance_id, context)
        self.node.read_failed(request.caller_instance_id, request.registration_id, request.producer_rank,
                              request.reason)
        return peer_pb2.FailAck()

    @unary
    async def Heartbeat(self, request: peer_pb2.HeartbeatRequest, context: Ctx) -> peer_pb2.HeartbeatResponse:
        knows = self.node.heard_from(request.caller_instance_id, session_of(context))
        return peer_pb2.HeartbeatResponse(instance_id=self.node.ident.instance_id, knows_caller=knows)

    def _known(self, instance_id: str, context: Ctx) -> None:
        """The caller is the daemon that handshook as ``instance_id``: it holds that session's token."""
        if not self.node.session_ok(instance_id, session_of(context)):
            raise SessionUnknown(f"unknown caller instance {instance_id[:256]!r} or session: handshake first")


def session_of(context: Ctx) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "kvpushd-session":
            return value if isinstance(value, str) else ""
    return ""
