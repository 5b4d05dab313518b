"""One PeerService.Channel stream to a peer daemon, the caller's side (used by outbound.PeerClient).

Items are queued without waiting (``submit``) and written by one writer task: everything queued in
one turn of the loop goes out as one PeerBatch, one write per turn (more only past MAX_BATCH items or
``max_bytes``: a burst of large registrations is split so that no PeerBatch exceeds the message size
both daemons accept; an item that alone exceeds it fails at once with RESOURCE_EXHAUSTED).
Results come back on the same stream and are matched to their items by seq.

Back-pressure: at most ``max_items`` items are queued or unanswered at once (a peer that stops
reading fills it, then a new item fails at once with PEER_UNREACHABLE instead of growing memory);
a write the peer does not take within ``stall_s`` breaks the stream (gRPC's buffers are freed with
the call); and the caller bounds the wait for each result (``PeerClient._items``). Nothing here
blocks the loop: the writer awaits gRPC's flow control, the reader awaits results.

When the stream ends for any reason every item still queued or unanswered fails with the error
``on_broken`` makes of the cause (PeerUnreachable, or SessionUnknown when the peer refused the
session: the caller handshakes again and retries); the next item opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from ..core.errors import KvpushdError, PeerUnreachable, ResourceExhausted
from ..rpc import outbound as pb

MAX_BATCH = 4096  # items in one PeerBatch (the callee's limit too)
ITEM_FRAMING = 8  # bytes a PeerItem adds to its PeerBatch beyond its own size (tag and length)


@dataclass(slots=True, eq=False)
class _Pending:
    item: pb.PeerItem
    fut: asyncio.Future[pb.PeerResult]
    size: int  # its encoded size in a PeerBatch


class PeerChannel:
    def __init__(self, address: str, call: Any, max_items: int, stall_s: float,
                 on_broken: Callable[[BaseException | str], KvpushdError], max_bytes: int) -> None:
        self.address = address
        self._call = call  # grpc.aio.StreamStreamCall
        self.max_items = max_items
        self.max_bytes = max_bytes  # a PeerBatch's largest encoded size (peer_api.max_message_bytes)
        self.stall_s = stall_s
        self._on_broken = on_broken
        self._queue: collections.deque[_Pending] = collections.deque()
        self._sent: dict[int, _Pending] = {}
        self._seq = 0
        self.closed: KvpushdError | None = None  # why it ended
        self.batches = 0  # PeerBatch messages written (for status and benchmarks)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._writer = self._loop.create_task(self._write_forever())
        self._reader = self._loop.create_task(self._read_forever())

    def __len__(self) -> int:
        return len(self._queue) + len(self._sent)

    def submit(self, kind: str, msg: Message) -> asyncio.Future[pb.PeerResult]:
        """Queue one item (``kind``: a PeerItem field); its result, or the error it failed with."""
        fut: asyncio.Future[pb.PeerResult] = self._loop.create_future()
        if self.closed is not None:
            fut.set_exception(self.closed)
            return fut
        if len(self) >= self.max_items:
            self._purge()
            if len(self) >= self.max_items:
                fut.set_exception(PeerUnreachable(
                    f"peer daemon {self.address} is not reading: {len(self)} items queued to it or unanswered, "
                    f"at most {self.max_items}", peer=self.address))
                return fut
        self._seq += 1
        it = pb.item(self._seq, kind, msg)
        size = it.ByteSize() + ITEM_FRAMING
        if size > self.max_bytes:
            fut.set_exception(ResourceExhausted(
                f"a {kind} item of {size} bytes exceeds peer_api.max_message_bytes = {self.max_bytes}"))
            return fut
        self._queue.append(_Pending(it, fut, size))
        self._wake.set()
        return fut

    def _purge(self) -> None:
        """Forget items whose caller stopped waiting (their bound passed)."""
        self._queue = collections.deque(p for p in self._queue if not p.fut.done())
        for seq in [s for s, p in self._sent.items() if p.fut.done()]:
            del self._sent[seq]

    async def _write_forever(self) -> None:
        while self.closed is None:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and self.closed is None:
                items: list[pb.PeerItem] = []
                nbytes = 0
                while self._queue and len(items) < MAX_BATCH and nbytes + self._queue[0].size <= self.max_bytes:
                    p = self._queue.popleft()
                    if p.fut.done():
                        continue  # its caller stopped waiting while it was queued
                    self._sent[p.item.seq] = p
                    items.append(p.item)
                    nbytes += p.size
                if not items:
                    break
                stalled = self._loop.call_later(self.stall_s, self.close,
                                                f"peer daemon {self.address} did not take a batch for "
                                                f"{self.stall_s:g}s (it stopped reading)")
                try:
                    await self._call.write(pb.batch(items))
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                    self.close(e)  # the reader has the real status when there is one
                    return
                finally:
                    stalled.cancel()
                self.batches += 1

    async def _read_forever(self) -> None:
        why: BaseException | str = f"peer daemon {self.address} ended the stream"
        try:
            while True:
                batch = await self._call.read()
                if batch is grpc.aio.EOF:
                    with_status = await self._call.code()
                    if with_status is not grpc.StatusCode.OK:
                        why = f"stream ended: {with_status.name}: {await self._call.details()}"
                    break
                for it in batch.items:
                    p = self._sent.pop(it.seq, None)
                    if p is not None and not p.fut.done():
                        p.fut.set_result(it.result)
        except grpc.aio.AioRpcError as e:
            why = e
        except asyncio.CancelledError:
            return
        self.close(why)

    def close(self, why: BaseException | str = "closed") -> None:
        """End the stream; everything queued or unanswered fails. Idempotent."""
        if self.closed is not None:
            return
        err = self.closed = self._on_broken(why)
        pending = [*self._queue, *self._sent.values()]
        self._queue.clear()
        self._sent.clear()
        for p in pending:
            if not p.fut.done():
                p.fut.set_exception(err)
        self._call.cancel()
        self._wake.set()  # the writer sees closed and ends
        if asyncio.current_task() is not self._reader:
            self._reader.cancel()

    async def aclose(self) -> None:
        self.close()
        for t in (self._writer, self._reader):
            t.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)
