"""WorkerService: the local API engine workers call over the unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import DecodeError
from kvpushd_client.proto.v1 import worker_pb2, worker_pb2_grpc

from ..core.errors import InvalidArgument, ResourceExhausted
from ..runtime.node import Node
from . import convert
from .errors import stream, unary
from .pump import WORKER, Pump, packed
from .services import Oversized

Ctx = Any


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def Attach(self, request: worker_pb2.AttachRequest, context: Ctx) -> worker_pb2.AttachResponse:
        try:
            a = convert.attach(request)
            # extends_worker_id: growth of a live worker's VMM memory (runtime/workers.py extend)
            w = await (self.node.workers.extend(a) if a.extends_worker_id else self.node.attach(a))
        except BaseException:
            # whatever refused it (a malformed handle after good ones, a rank taken, a draining daemon),
            # the descriptors handed over for this Attach are closed now, not at the inbox's expiry: a
            # worker that gives up would otherwise leave its whole KV alive in the daemon that long
            self.node.workers.fds.discard(handed_tokens(request))
            raise
        return worker_pb2.AttachResponse(worker_id=w.worker_id, node_id=self.node.ident.node_id,
                                         peer_address=self.node.ident.peer_address, worker_token=w.token)

    @unary
    async def Detach(self, request: worker_pb2.DetachRequest, context: Ctx) -> worker_pb2.DetachResponse:
        self.node.workers.owned(request.worker_id, request.worker_token)
        await self.node.detach(request.worker_id, "detached by the worker")
        return worker_pb2.DetachResponse()

    @stream
    async def Stream(self, request_iterator: Any, context: Ctx) -> AsyncIterator[worker_pb2.EventBatch]:
        """The worker's session: its commands through the pump, its completions beside the answers."""
        requests = request_iterator.__aiter__()
        try:
            first: worker_pb2.CommandBatch = await requests.__anext__()
        except StopAsyncIteration:
            return
        except DecodeError as e:
            raise InvalidArgument(f"malformed CommandBatch: {e}") from None
        if isinstance(first, Oversized):
            raise ResourceExhausted(first.why())
        wid = first.worker_id
        workers = self.node.workers
        workers.owned(wid, first.worker_token)  # NOT_FOUND, or PERMISSION_DENIED, before anything else

        def counted(batch: worker_pb2.CommandBatch) -> None:
            if batch.commands:  # the first batch may only name the worker
                workers.called(wid, len(batch.commands))

        pump = Pump(self.node, WORKER, wid, lambda: workers.wake(wid), counted)
        async for results, completions in pump.serve(requests, workers.session_batches(wid, self.node.detach), first):
            # one tick's answers and completions as EventBatches of at most ANSWER_BYTES each
            completed = [convert.completion(c) for c in completions]
            for batch in packed(worker_pb2.EventBatch, [("results", results), ("completions", completed)]):
                yield batch


def handed_tokens(request: worker_pb2.AttachRequest) -> list[bytes]:
    """The tokens under which an Attach says its descriptors were sent to the fd socket."""
    tokens = [m.memfd.token for m in request.memory if m.WhichOneof("kind") == "memfd"]
    tokens += [c.token for m in request.memory if m.WhichOneof("kind") == "vmm" for c in m.vmm.chunks]
    return [*tokens, request.doorbell_token] if request.doorbell_token else tokens
