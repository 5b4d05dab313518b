"""The one pump behind both streams (WorkerService.Stream, PeerService.Channel), and the one table of
what their items do.

Each request item names one operation (its oneof field); ``WORKER_OPS`` and ``PEER_OPS`` say, per
operation, how its message becomes the one record the node method takes, which node method runs it
(for the stream's worker or calling daemon), and what the answer carries. Every item is answered on its own
(a bad one fails alone with the status a call of it would have had, ``errors.refusal``); an item
whose method is a coroutine (a Withdraw waits for WRITEs into its blocks) is answered when it ends,
so answers may come back out of order. A batch that comes after the caller's session ended has every
item refused; a malformed one ends the stream INVALID_ARGUMENT, and one of more than ``MAX_BATCH``
items RESOURCE_EXHAUSTED (it is never parsed: services.bounded). Answers wait in ``results`` for the
stream's writer: at most ``MAX_UNSENT`` of them, then the pump stops reading (a caller that does not
read its answers gets no more of them queued); they go out in messages of at most ``ANSWER_BYTES``
(``packed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from kvpushd_client.proto.v1 import peer_pb2, worker_pb2

from ..core.errors import InvalidArgument, ResourceExhausted
from ..runtime.node import Node
from . import convert
from .errors import refusal
from .services import MAX_BATCH, Oversized

SLICE_S = 0.005  # work on one batch between two chances for the rest of the loop (it lets go between items)
MAX_UNSENT = 4 * MAX_BATCH  # answers held for a caller that does not read them: then the pump stops reading
# An answer message's largest encoded size: gRPC's default receive limit (4 MiB), which a worker's
# client or a peer may keep. More answers and completions than that go out as several messages.
ANSWER_BYTES = 4 << 20
X = TypeVar("X")
R = TypeVar("R", bound=Message)
M = TypeVar("M", bound=Message)


def _nothing(res: Any, value: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Op:
    record: Callable[[Any], Any]  # the item's message -> the one record the node method takes (rpc/convert.py)
    call: Callable[..., Any]      # the node method: (node, the stream's caller, record)
    answer: Callable[[Any, Any], None] = _nothing  # (result message, what the method returned)
    later: bool = field(init=False)  # the method is a coroutine: answered when it ends (from ``call``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "later", inspect.iscoroutinefunction(self.call))


def _need_metadata(res: Any, known: bool) -> None:
    res.need_metadata = not known


def _found(res: Any, found: bool) -> None:
    res.found = found


def _heartbeat(node: Node, instance_id: str, _: object) -> str:
    """Liveness: the batch's session was checked live; the caller was heard from now."""
    node.inbound.caller(instance_id)
    return node.ident.instance_id


def _beat(res: Any, instance_id: str) -> None:
    res.heartbeat.instance_id, res.heartbeat.knows_caller = instance_id, True


# Each item's message becomes its record once (worker commands: kvpushd_client.types; peer items:
# runtime/peerops.py); the node checks it and hands it on whole.
WORKER_OPS: Mapping[str, Op] = {
    "expect": Op(convert.expect, Node.expect),
    "publish": Op(convert.publish, Node.publish),
    "abort": Op(convert.abort, Node.abort, _found),
    "decline": Op(convert.decline, Node.decline),
}

PEER_OPS: Mapping[str, Op] = {
    "register": Op(convert.register, Node.register, _need_metadata),
    "withdraw": Op(convert.notice, Node.withdraw),
    "fail": Op(convert.notice, Node.peer_failed),
    "offer": Op(convert.offer, Node.offer, _need_metadata),
    "read_failed": Op(convert.read_failed, Node.read_failed),
    "heartbeat": Op(lambda r: None, _heartbeat, _beat),
    "decline": Op(convert.declined, Node.declined),
}


def _command_result(seq: int) -> tuple[worker_pb2.CommandResult, worker_pb2.CommandResult]:
    r = worker_pb2.CommandResult(seq=seq)
    return r, r


def _peer_result(seq: int) -> tuple[peer_pb2.PeerItem, peer_pb2.PeerResult]:
    out = peer_pb2.PeerItem(seq=seq)
    return out, out.result


@dataclass(frozen=True, slots=True)
class Wire(Generic[R]):
    """One stream's shape: its operations, where a batch keeps its items, the oneof naming an item's
    operation, and how an answer is made for a seq (the answer item, the message with code, kind, message)."""

    name: str
    ops: Mapping[str, Op]
    items: str
    oneof: str
    result: Callable[[int], tuple[R, Any]]


WORKER: Wire[worker_pb2.CommandResult] = Wire("CommandBatch", WORKER_OPS, "commands", "op", _command_result)
PEER: Wire[peer_pb2.PeerItem] = Wire("PeerBatch", PEER_OPS, "items", "item", _peer_result)


class Pump(Generic[R]):
    """One stream: its request batches through the table, its answers (and ``ticks``' extras) back."""

    def __init__(self, node: Node, wire: Wire[R], caller: str, wake: Callable[[], None],
                 admit: Callable[[Any], BaseException | None]) -> None:
        self.node, self.wire, self.caller = node, wire, caller
        self._wake = wake      # the writer has something to send
        self._admit = admit    # per batch: why to refuse all its items (None: take them)
        self.results: list[R] = []
        self.waiting: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._room.set()

    async def batch(self, batch: Any) -> None:
        """Each item in order; past SLICE_S of work the loop is let go between two items, so one message
        of large items (a batch of Registers of a million block ids each) never holds it for longer
        than its largest item."""
        if isinstance(batch, Oversized):  # never parsed (services.bounded): the stream ends
            raise ResourceExhausted(batch.why())
        items = getattr(batch, self.wire.items)
        refuse = self._admit(batch)
        t0 = time.perf_counter()
        for it in items:
            self._item(it, refuse)
            if time.perf_counter() - t0 > SLICE_S:
                self._wake()
                await asyncio.sleep(0)
                t0 = time.perf_counter()
        self._wake()

    def _item(self, it: Any, refuse: BaseException | None) -> None:
        out, res = self.wire.result(it.seq)
        try:
            if refuse is not None:
                raise refuse
            kind = it.WhichOneof(self.wire.oneof)
            op = self.wire.ops.get(kind or "")
            if op is None:
                raise InvalidArgument(f"item {it.seq}: {kind or 'no operation'}; expected one of "
                                      f"{', '.join(self.wire.ops)}")
            got = op.call(self.node, self.caller, op.record(getattr(it, kind or "")))
            if op.later:
                task = asyncio.get_running_loop().create_task(self._later(got, out, res, op))
                self.waiting.add(task)
                task.add_done_callback(self.waiting.discard)
                return
            op.answer(res, got)
            res.code = "OK"
        except Exception as e:
            res.code, res.kind, res.message = refusal(e)
        self._put(out)

    async def _later(self, got: Any, out: R, res: Any, op: Op) -> None:
        try:
            op.answer(res, await got)
            res.code = "OK"
        except Exception as e:
            res.code, res.kind, res.message = refusal(e)
        self._put(out)
        self._wake()

    def _put(self, out: R) -> None:
        self.results.append(out)
        if len(self.results) >= MAX_UNSENT:
            self._room.clear()

    def take(self) -> list[R]:
        out, self.results = self.results, []
        self._room.set()
        return out

    async def _read(self, requests: AsyncIterator[Any], first: Any) -> None:
        if first is not None:
            await self.batch(first)
        async for batch in requests:
            await self.batch(batch)
            if not self._room.is_set():
                await self._room.wait()

    async def serve(self, requests: AsyncIterator[Any], ticks: AsyncIterator[list[X]],
                    first: Any = None) -> AsyncIterator[tuple[list[R], list[X]]]:
        """(answers, extras) every time ``ticks`` yields (it wakes on ``wake``), until the caller's
        requests end and every answer went out. A malformed batch ends the stream (INVALID_ARGUMENT)."""
        reader = asyncio.get_running_loop().create_task(self._read(requests, first))
        reader.add_done_callback(lambda _: self._wake())
        try:
            async with contextlib.aclosing(ticks) as woken:  # type: ignore[type-var]
                async for extra in woken:
                    out = self.take()
                    if out or extra:
                        yield out, extra
                    if reader.done() and not self.waiting and not self.results:
                        if not reader.cancelled() and (e := reader.exception()) is not None:
                            if isinstance(e, DecodeError):
                                raise InvalidArgument(f"malformed {self.wire.name}: {e}") from None
                            raise e
                        return
        finally:
            for t in (reader, *self.waiting):
                t.cancel()
            for t in (reader, *self.waiting):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


async def woken(event: asyncio.Event) -> AsyncIterator[list[Any]]:
    """Ticks for a stream with nothing of its own to send: one each time ``event`` is set."""
    while True:
        await event.wait()
        event.clear()
        yield []


def packed(make: Callable[[], M], fields: Sequence[tuple[str, Sequence[Message]]]) -> list[M]:
    """Messages made by ``make`` holding every item of ``fields`` (field name, items), in order, each of
    at most ``ANSWER_BYTES`` encoded bytes (one item larger than that goes alone). The usual tick fits one
    message: sized once."""
    one = make()
    for name, items in fields:
        getattr(one, name).extend(items)
    if one.ByteSize() <= ANSWER_BYTES:
        return [one]
    out = [make()]
    size = 0
    for name, items in fields:
        for item in items:
            n = item.ByteSize() + 8  # the field's tag and length
            if size + n > ANSWER_BYTES and size:
                out.append(make())
                size = 0
            getattr(out[-1], name).append(item)
            size += n
    return out
