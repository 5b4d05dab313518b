"""asyncio client of a kvpushd daemon: the same surface as client.py, with coroutines."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Sequence

import grpc

from . import _convert, errors
from .proto.v1 import status_pb2, status_pb2_grpc, worker_pb2, worker_pb2_grpc
from .types import Completion, DaemonUnavailable, KVPushError, Memory, Region, Role


class AsyncKVPushClient:
    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}", options=_convert.CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.status_stub = status_pb2_grpc.StatusServiceStub(self.channel)

    async def status(self) -> status_pb2.NodeStatus:
        try:
            return await self.status_stub.GetStatus(status_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                await self.status()
                return
            except DaemonUnavailable:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def attach(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, memory: Sequence[Memory],
                     regions: Sequence[Region], pp_rank: int = 0, description: str = "") -> AsyncWorker:
        req = _convert.attach_request(engine_id, role, tp_rank, tp_size, memory, regions, pp_rank, description)
        try:
            resp = await self.stub.Attach(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        return AsyncWorker(self, resp.worker_id, resp.node_id, resp.peer_address)

    async def close(self) -> None:
        await self.channel.close()


class AsyncWorker:
    def __init__(self, client: AsyncKVPushClient, worker_id: str, node_id: str, peer_address: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.node_id = node_id
        self.peer_address = peer_address
        self._queue: collections.deque[Completion] = collections.deque()
        self._event = asyncio.Event()
        self.session_error: KVPushError | None = None
        self._closed = False
        self._call = client.stub.Session(worker_pb2.SessionRequest(worker_id=worker_id))
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.session_error is None and not self._closed

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                self._queue.append(_convert.completion(msg))
                self._event.set()
            err: KVPushError = DaemonUnavailable("UNAVAILABLE", "session ended by the daemon")
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e)
        except asyncio.CancelledError:
            return
        if not self._closed:
            self.session_error = err
        self._event.set()

    async def _unary(self, method: str, req: object) -> object:
        try:
            return await getattr(self.client.stub, method)(req, timeout=self.client.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    async def expect(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
                     producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
                     transfer_mode: str = "push", traceparent: str = "") -> None:
        await self._unary("Expect", worker_pb2.ExpectRequest(
            worker_id=self.worker_id, transfer_id=transfer_id, block_ids=list(block_ids),
            producer_address=producer_address, producer_engine_id=producer_engine_id,
            producer_tp_size=producer_tp_size, skip_tokens=skip_tokens,
            transfer_mode=_convert.transfer_mode(transfer_mode), traceparent=traceparent))

    async def publish(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "") -> None:
        await self._unary("Publish", worker_pb2.PublishRequest(worker_id=self.worker_id, transfer_id=transfer_id,
                                                               block_ids=list(block_ids), traceparent=traceparent))

    async def abort(self, transfer_id: str) -> bool:
        resp = await self._unary("Abort", worker_pb2.AbortRequest(worker_id=self.worker_id, transfer_id=transfer_id))
        assert isinstance(resp, worker_pb2.AbortResponse)
        return resp.found

    def completions(self) -> list[Completion]:
        out = list(self._queue)
        self._queue.clear()
        return out

    async def next_completion(self, timeout_s: float | None = None) -> Completion | None:
        while not self._queue:
            if self.session_error is not None:
                raise self.session_error
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                return None
        return self._queue.popleft()

    async def detach(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._unary("Detach", worker_pb2.DetachRequest(worker_id=self.worker_id))
        except KVPushError as e:
            if e.code not in ("NOT_FOUND", "UNAVAILABLE"):
                raise
        finally:
            self._call.cancel()
            self._reader.cancel()
