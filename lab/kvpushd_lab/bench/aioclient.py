"""asyncio client of a kvpushd daemon, for ``bench soak``: the surface of kvpushd_client.KVPushClient,
with coroutines that each await their command's answer on the worker's stream."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
from kvpushd_client import _convert, errors
from kvpushd_client.handover import hand_over
from kvpushd_client.proto.v1 import status_pb2, status_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvpushd_client.stream import _GONE, _command
from kvpushd_client.types import (
    Abort,
    Attach,
    Command,
    Completion,
    DaemonUnavailable,
    Decline,
    Expect,
    KVPushError,
    Memory,
    Publish,
    Region,
    Role,
    TransferMode,
)


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
        # a local datagram per memfd (off the loop: a full queue makes a send wait)
        tokens = await asyncio.to_thread(hand_over, self.socket_path, memory, self.timeout_s)
        req = _convert.attach_request(Attach(engine_id, role, tp_rank, tp_size, tuple(memory), tuple(regions),
                                             pp_rank, description), tokens)
        try:
            resp = await self.stub.Attach(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        return AsyncWorker(self, resp.worker_id, resp.node_id, resp.peer_address, resp.worker_token)

    async def close(self) -> None:
        await self.channel.close()


class AsyncWorker:
    """An attached worker on its stream, with coroutines: each call awaits its own answer; the calls
    made in one turn of the loop go out as one CommandBatch."""

    def __init__(self, client: AsyncKVPushClient, worker_id: str, node_id: str, peer_address: str,
                 token: bytes = b"") -> None:
        self.client = client
        self.token = token
        self.worker_id = worker_id
        self.node_id = node_id
        self.peer_address = peer_address
        self._queue: collections.deque[Completion] = collections.deque()
        self._event = asyncio.Event()
        self.session_error: KVPushError | None = None
        self._closed = False
        self._seq = 0
        self._batch: list[worker_pb2.Command] = []
        self._waiting: dict[int, tuple[str, asyncio.Future[worker_pb2.CommandResult]]] = {}
        self._out: asyncio.Queue[worker_pb2.CommandBatch | None] = asyncio.Queue()
        self._out.put_nowait(worker_pb2.CommandBatch(worker_id=worker_id, worker_token=token))
        self._call = client.stub.Stream(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.session_error is None and not self._closed

    async def _requests(self) -> AsyncIterator[worker_pb2.CommandBatch]:
        while (batch := await self._out.get()) is not None:
            yield batch

    def _send(self) -> None:
        batch, self._batch = self._batch, []
        self._out.put_nowait(worker_pb2.CommandBatch(commands=batch))

    async def _read(self) -> None:
        try:
            async for ev in self._call:
                for r in ev.results:
                    _, fut = self._waiting.pop(r.seq, ("", None))
                    if fut is not None and not fut.done():
                        fut.set_result(r)
                self._queue.extend(_convert.completion(c) for c in ev.completions)
                self._event.set()
            err: KVPushError = DaemonUnavailable("UNAVAILABLE", "stream ended by the daemon")
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e)
        except asyncio.CancelledError:
            err = DaemonUnavailable("CANCELLED", "detached")
        if not self._closed:
            self.session_error = err
        for _, fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)
        self._waiting.clear()
        self._event.set()

    async def _command(self, q: Command) -> worker_pb2.CommandResult:
        """One command in this loop turn's batch, and its answer; raises the daemon's refusal."""
        if self.session_error is not None:
            raise self.session_error
        self._seq += 1
        fut: asyncio.Future[worker_pb2.CommandResult] = asyncio.get_running_loop().create_future()
        self._waiting[self._seq] = (q.transfer_id, fut)
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._send)
        self._batch.append(_command(self._seq, q))
        r = await asyncio.wait_for(fut, self.client.timeout_s)
        if r.code != "OK":
            raise errors.error_of(r.code, r.message, r.kind, q.transfer_id)
        return r

    async def expect(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
                     producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
                     transfer_mode: str = "push", traceparent: str = "") -> None:
        await self._command(Expect(transfer_id, tuple(block_ids), producer_address, producer_engine_id,
                                   producer_tp_size, skip_tokens, TransferMode.parse(transfer_mode), traceparent))

    async def publish(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "",
                      consumer_node_id: str = "", consumer_tls_name: str = "") -> None:
        await self._command(Publish(transfer_id, tuple(block_ids), traceparent, consumer_node_id, consumer_tls_name))

    async def abort(self, transfer_id: str) -> bool:
        return (await self._command(Abort(transfer_id))).found

    async def decline(self, transfer_id: str, producer_address: str, producer_engine_id: str,
                      reason: str = "") -> None:
        await self._command(Decline(transfer_id, producer_address, producer_engine_id, reason))

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
        """Detach (the daemon fails what is pending and releases the memory), then end the stream. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:  # detached when this returns, so the same engine may attach again at once
            await self.client.stub.Detach(worker_pb2.DetachRequest(worker_id=self.worker_id, worker_token=self.token),
                                          timeout=self.client.timeout_s)
        except grpc.RpcError as e:
            if e.code() not in _GONE:
                raise errors.from_rpc_error(e) from None
        finally:
            self._out.put_nowait(None)
            self._call.cancel()
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
