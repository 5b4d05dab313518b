"""WorkerService: the local API engine workers call over the unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvpushd_client.proto.v1 import worker_pb2, worker_pb2_grpc

from ..runtime.node import Node
from . import convert
from .errors import stream, unary

Ctx = Any


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def Attach(self, request: worker_pb2.AttachRequest, context: Ctx) -> worker_pb2.AttachResponse:
        w = await self.node.attach(request.engine_id, convert.role(request.role), request.tp_rank,
                                   request.tp_size, request.pp_rank,
                                   [convert.memory(m) for m in request.memory],
                                   [convert.region(r) for r in request.regions], request.description)
        return worker_pb2.AttachResponse(worker_id=w.worker_id, node_id=self.node.ident.node_id,
                                         peer_address=self.node.ident.peer_address)

    @stream
    async def Session(self, request: worker_pb2.SessionRequest, context: Ctx) -> AsyncIterator[worker_pb2.Completion]:
        async for c in self.node.session(request.worker_id):
            yield convert.completion(c)

    @unary
    async def Expect(self, request: worker_pb2.ExpectRequest, context: Ctx) -> worker_pb2.ExpectResponse:
        self.node.expect(request.worker_id, request.transfer_id, request.block_ids, request.producer_address,
                         request.producer_engine_id, request.producer_tp_size,
                         convert.transfer_mode(request.transfer_mode), skip_tokens=request.skip_tokens)
        return worker_pb2.ExpectResponse()

    @unary
    async def Publish(self, request: worker_pb2.PublishRequest, context: Ctx) -> worker_pb2.PublishResponse:
        self.node.publish(request.worker_id, request.transfer_id, request.block_ids)
        return worker_pb2.PublishResponse()

    @unary
    async def PollCompletions(self, request: worker_pb2.PollCompletionsRequest,
                              context: Ctx) -> worker_pb2.PollCompletionsResponse:
        got = self.node.poll(request.worker_id, request.max)
        return worker_pb2.PollCompletionsResponse(completions=[convert.completion(c) for c in got])

    @unary
    async def Abort(self, request: worker_pb2.AbortRequest, context: Ctx) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=self.node.abort(request.worker_id, request.transfer_id))

    @unary
    async def Detach(self, request: worker_pb2.DetachRequest, context: Ctx) -> worker_pb2.DetachResponse:
        self.node.worker(request.worker_id)
        await self.node.detach(request.worker_id, "detached by the worker")
        return worker_pb2.DetachResponse()
