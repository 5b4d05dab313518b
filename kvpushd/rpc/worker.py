"""WorkerService: the local API engine workers call over the unix socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from google.protobuf.message import DecodeError
from kvpushd_client.proto.v1 import worker_pb2, worker_pb2_grpc

from ..core.errors import InvalidArgument, KvpushdError
from ..runtime.node import Node
from . import convert
from .errors import code_for, stream, unary

Ctx = Any
log = structlog.get_logger(__name__)
MAX_BATCH = 4096  # commands in one CommandBatch


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
        self.node.called(request.worker_id)
        self.node.expect(request.worker_id, request.transfer_id, request.block_ids, request.producer_address,
                         request.producer_engine_id, request.producer_tp_size,
                         convert.transfer_mode(request.transfer_mode), skip_tokens=request.skip_tokens,
                         traceparent=request.traceparent[:128])
        return worker_pb2.ExpectResponse()

    @unary
    async def Publish(self, request: worker_pb2.PublishRequest, context: Ctx) -> worker_pb2.PublishResponse:
        self.node.called(request.worker_id)
        self.node.publish(request.worker_id, request.transfer_id, request.block_ids,
                          traceparent=request.traceparent[:128])
        return worker_pb2.PublishResponse()

    @unary
    async def PollCompletions(self, request: worker_pb2.PollCompletionsRequest,
                              context: Ctx) -> worker_pb2.PollCompletionsResponse:
        got = self.node.poll(request.worker_id, request.max)
        return worker_pb2.PollCompletionsResponse(completions=[convert.completion(c) for c in got])

    @unary
    async def Abort(self, request: worker_pb2.AbortRequest, context: Ctx) -> worker_pb2.AbortResponse:
        self.node.called(request.worker_id)
        return worker_pb2.AbortResponse(found=self.node.abort(request.worker_id, request.transfer_id))

    @unary
    async def Decline(self, request: worker_pb2.DeclineRequest, context: Ctx) -> worker_pb2.DeclineResponse:
        self.node.called(request.worker_id)
        self.node.decline(request.worker_id, request.transfer_id, request.producer_address,
                          request.producer_engine_id, request.reason)
        return worker_pb2.DeclineResponse()

    @unary
    async def Detach(self, request: worker_pb2.DetachRequest, context: Ctx) -> worker_pb2.DetachResponse:
        self.node.worker(request.worker_id)
        await self.node.detach(request.worker_id, "detached by the worker")
        return worker_pb2.DetachResponse()

    @stream
    async def Stream(self, request_iterator: Any, context: Ctx) -> AsyncIterator[worker_pb2.EventBatch]:
        requests = request_iterator.__aiter__()
        try:
            first: worker_pb2.CommandBatch = await requests.__anext__()
        except StopAsyncIteration:
            return
        except DecodeError as e:
            raise InvalidArgument(f"malformed CommandBatch: {e}") from None
        worker_id = first.worker_id
        self.node.worker(worker_id)  # NOT_FOUND before anything else
        results: list[worker_pb2.CommandResult] = []

        def run(batch: worker_pb2.CommandBatch) -> None:
            if batch.commands:  # the first batch may only name the worker
                self.node.called(worker_id, len(batch.commands))
            if len(batch.commands) > MAX_BATCH:
                results.append(worker_pb2.CommandResult(
                    seq=batch.commands[0].seq, code="INVALID_ARGUMENT", kind="InvalidArgument",
                    message=f"{len(batch.commands)} commands in one batch; at most {MAX_BATCH}"))
            else:
                results.extend(self._command(worker_id, c) for c in batch.commands)
            self.node.wake(worker_id)

        async def read() -> None:
            try:
                async for batch in requests:
                    run(batch)
            except DecodeError:  # a malformed later batch ends the stream (and with it the session)
                log.warning("malformed CommandBatch on a worker stream", worker_id=worker_id)
                self.node.wake(worker_id)
                raise

        run(first)
        reader = asyncio.get_running_loop().create_task(read())
        try:
            async for completions in self.node.session_batches(worker_id):
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise InvalidArgument("malformed CommandBatch")
                out, results[:] = list(results), []
                if out or completions:
                    yield worker_pb2.EventBatch(results=out, completions=[convert.completion(c) for c in completions])
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    def _command(self, worker_id: str, c: worker_pb2.Command) -> worker_pb2.CommandResult:
        """One command of a batch: it fails alone, the others go on."""
        n = self.node
        try:
            op = c.WhichOneof("op")
            if op == "expect":
                r = c.expect
                n.expect(worker_id, r.transfer_id, r.block_ids, r.producer_address, r.producer_engine_id,
                         r.producer_tp_size, convert.transfer_mode(r.transfer_mode), skip_tokens=r.skip_tokens,
                         traceparent=r.traceparent[:128])
            elif op == "publish":
                n.publish(worker_id, c.publish.transfer_id, c.publish.block_ids,
                          traceparent=c.publish.traceparent[:128])
            elif op == "abort":
                return worker_pb2.CommandResult(seq=c.seq, code="OK", found=n.abort(worker_id, c.abort.transfer_id))
            elif op == "decline":
                d = c.decline
                n.decline(worker_id, d.transfer_id, d.producer_address, d.producer_engine_id, d.reason)
            else:
                raise InvalidArgument("command has no operation (expect, publish, abort or decline)")
        except KvpushdError as e:
            code = code_for(e)
            if code is None:
                log.error("unexpected error in a stream command", exc_info=e)
                return worker_pb2.CommandResult(seq=c.seq, code="INTERNAL", kind=e.kind, message=str(e))
            return worker_pb2.CommandResult(seq=c.seq, code=code.name, kind=e.kind, message=str(e))
        except Exception as e:
            log.error("unexpected error in a stream command", exc_info=e)
            return worker_pb2.CommandResult(seq=c.seq, code="INTERNAL", kind=type(e).__name__,
                                            message=f"internal error: {type(e).__name__}")
        return worker_pb2.CommandResult(seq=c.seq, code="OK")
