"""PeerService: what other nodes' daemons call over TCP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from google.protobuf.message import DecodeError
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc

from .. import PROTOCOL_VERSION
from ..core import notif
from ..core.errors import InvalidArgument, KvpushdError, PermissionDenied, SessionUnknown
from ..runtime.node import Node
from . import convert
from .errors import code_for, stream, unary

log = structlog.get_logger(__name__)

Ctx = Any
MAX_BATCH = 4096  # registrations in one RegisterBatch, items in one PeerBatch
MAX_UNSENT = 4 * MAX_BATCH  # results a Channel holds for a caller that does not read them: then it stops reading


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

    @stream
    async def Channel(self, request_iterator: Any, context: Ctx) -> AsyncIterator[peer_pb2.PeerBatch]:
        """One caller's long-lived stream: its session is checked here, once; then each item is
        answered on its own (see peer.proto)."""
        instance, token = metadata_of(context, "kvpushd-instance"), session_of(context)
        self._known(instance, context)
        requests = request_iterator.__aiter__()
        loop = asyncio.get_running_loop()
        results: list[peer_pb2.PeerItem] = []
        wake = asyncio.Event()
        room = asyncio.Event()  # set while results has room: the reader waits on it (back-pressure)
        room.set()
        waiting: set[asyncio.Task[None]] = set()  # Withdraws waiting for WRITEs into their blocks

        def answer(item: peer_pb2.PeerItem) -> None:
            results.append(item)
            wake.set()
            if len(results) >= MAX_UNSENT:
                room.clear()

        async def withdraw(seq: int, r: peer_pb2.FailNotice) -> None:
            try:
                await self.node.withdraw(instance, r.transfer_id, r.registration_id,
                                         convert.failure_code(r.code), r.reason)
                answer(peer_pb2.PeerItem(seq=seq, result=peer_pb2.PeerResult(code="OK")))
            except Exception as e:
                answer(peer_pb2.PeerItem(seq=seq, result=failed(e)))

        async def read() -> None:
            async for batch in requests:
                self.node.channel_counts(instance, batches=1)
                if len(batch.items) > MAX_BATCH:
                    raise InvalidArgument(f"{len(batch.items)} items in one PeerBatch; at most {MAX_BATCH}")
                # The session is the one checked when the stream opened; one that ended since (the
                # daemon forgot an idle peer, or a restart replaced it) answers SessionUnknown.
                live = self.node.session_ok(instance, token)
                for it in batch.items:
                    if not live:
                        answer(peer_pb2.PeerItem(seq=it.seq, result=failed(SessionUnknown(
                            f"the session of caller instance {instance[:64]!r} ended: handshake again"))))
                    elif it.WhichOneof("item") == "withdraw" and self._same(instance, it.withdraw.caller_instance_id):
                        task = loop.create_task(withdraw(it.seq, it.withdraw))
                        waiting.add(task)
                        task.add_done_callback(waiting.discard)
                    else:
                        answer(self._item(instance, token, it))
                if not room.is_set():
                    await room.wait()

        reader = loop.create_task(read())
        reader.add_done_callback(lambda _: wake.set())
        self.node.channel_counts(instance, streams=1)
        try:
            while True:
                await wake.wait()
                wake.clear()
                if results:
                    out = peer_pb2.PeerBatch(items=results)
                    results[:] = []
                    room.set()
                    yield out
                if reader.done() and not waiting and not results:
                    if not reader.cancelled() and (e := reader.exception()) is not None:
                        if isinstance(e, DecodeError):
                            raise InvalidArgument(f"malformed PeerBatch: {e}") from None
                        raise e
                    return
        finally:
            self.node.channel_counts(instance, streams=-1)
            for t in (reader, *waiting):
                t.cancel()
            for t in (reader, *waiting):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    @staticmethod
    def _same(instance: str, named: str) -> bool:
        return not named or named == instance

    def _item(self, instance: str, token: str, it: peer_pb2.PeerItem) -> peer_pb2.PeerItem:
        """One request item of a Channel: it fails alone, the others go on."""
        n = self.node
        out = peer_pb2.PeerItem(seq=it.seq)
        res = out.result
        try:
            kind = it.WhichOneof("item")
            if kind == "result" or kind is None:
                raise InvalidArgument("a result item sent to the callee (results only come back)" if kind else
                                      "item has no kind (register, withdraw, fail, offer, read_failed, heartbeat, "
                                      "decline)")
            if not self._same(instance, getattr(it, kind).caller_instance_id):
                raise PermissionDenied(f"a {kind} item names another caller instance than the stream's")
            if kind == "register":
                r = peer_pb2.RegisterRequest()
                r.CopyFrom(it.register)
                r.caller_instance_id = instance
                res.need_metadata = not self._register(r)
            elif kind == "fail":
                r2 = it.fail
                n.peer_failed(instance, r2.transfer_id, r2.registration_id, convert.failure_code(r2.code),
                              r2.reason[:2000])
            elif kind == "offer":
                o = it.offer
                res.need_metadata = not n.offer(instance, o.transfer_id, o.registration_id, o.producer_rank,
                                                convert.remote_agent(o.producer_agent), o.block_ids)
            elif kind == "read_failed":
                f = it.read_failed
                n.read_failed(instance, f.registration_id, f.producer_rank, f.reason)
            elif kind == "decline":
                dn = it.decline
                n.declined(instance, dn.transfer_id, dn.producer_engine_id, dn.consumer_engine_id, dn.reason)
            elif kind == "heartbeat":
                res.heartbeat.instance_id = n.ident.instance_id
                res.heartbeat.knows_caller = n.heard_from(instance, token)
        except Exception as e:
            out.result.CopyFrom(failed(e))
            return out
        res.code = "OK"
        return out

    def _known(self, instance_id: str, context: Ctx) -> None:
        """The caller is the daemon that handshook as ``instance_id``: it holds that session's token."""
        if not self.node.session_ok(instance_id, session_of(context)):
            raise SessionUnknown(f"unknown caller instance {instance_id[:256]!r} or session: handshake first")


def session_of(context: Ctx) -> str:
    return metadata_of(context, "kvpushd-session")


def metadata_of(context: Ctx, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value[:256] if isinstance(value, str) else ""
    return ""


def failed(e: BaseException) -> peer_pb2.PeerResult:
    """The result of an item that failed: the status code its unary call would have had."""
    if isinstance(e, KvpushdError) and (code := code_for(e)) is not None:
        return peer_pb2.PeerResult(code=code.name, message=str(e), kind=e.kind)
    log.error("unexpected error in a peer stream item", exc_info=e)
    return peer_pb2.PeerResult(code="INTERNAL", kind=type(e).__name__, message=f"internal error: {type(e).__name__}")
