"""A worker on one stream both ways (WorkerService.Stream): batches of commands, one per engine step.

    w = client.attach_stream("decode-0", Role.CONSUMER, 0, 1, memory, regions)
    w.expect_nowait(...); w.expect_nowait(...)   # the engine thread only appends (no lock a gRPC thread holds)
    w.step()                                      # once per engine step: the batch goes out as one message
    for c in w.completions(): ...                 # results and completions come back on the same stream

The engine thread never waits on the network: ``*_nowait`` append to the step's batch, ``step()``
hands the batch to the stream's sender (a queue put). A command the daemon refuses comes back as a
FAILED completion with code ``REFUSED``, its status and message in ``reason`` and its block ids, as
for ``Worker.*_nowait``. One gRPC message per step instead of one unary call per request.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import grpc

from . import _convert, errors
from .inbox import Inbox
from .proto.v1 import worker_pb2
from .types import Completion, CompletionKind, DaemonUnavailable, KVPushError


class _Client(Protocol):
    """What a stream worker needs of its client (``client.KVPushClient`` is one)."""

    stub: Any
    timeout_s: float

_END = None
_Queued = tuple[int, str, str, list[int], tuple[object, ...]]


def _command(q: _Queued) -> worker_pb2.Command:
    seq, op, tid, blocks, args = q
    if op == "expect":
        address, engine, tp, skip, mode, tp_ctx = args
        return worker_pb2.Command(seq=seq, expect=worker_pb2.ExpectRequest(
            transfer_id=tid, block_ids=blocks, producer_address=str(address), producer_engine_id=str(engine),
            producer_tp_size=int(tp), skip_tokens=int(skip),  # type: ignore[call-overload]
            transfer_mode=_convert.transfer_mode(str(mode)), traceparent=str(tp_ctx)))
    if op == "publish":
        return worker_pb2.Command(seq=seq, publish=worker_pb2.PublishRequest(
            transfer_id=tid, block_ids=blocks, traceparent=str(args[0]) if args else ""))
    if op == "decline":
        address, engine, reason = args
        return worker_pb2.Command(seq=seq, decline=worker_pb2.DeclineRequest(
            transfer_id=tid, producer_address=str(address), producer_engine_id=str(engine), reason=str(reason)))
    return worker_pb2.Command(seq=seq, abort=worker_pb2.AbortRequest(transfer_id=tid))


class StreamWorker(Inbox):
    """An attached worker whose session is a WorkerService.Stream."""

    def __init__(self, client: _Client, worker_id: str, node_id: str, peer_address: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.node_id = node_id
        self.peer_address = peer_address
        super().__init__()
        self._seq = itertools.count(1)
        # the engine thread's own (no lock): (seq, op, transfer id, blocks, expect arguments); the
        # protobuf messages are built by the stream's sender thread, off the engine thread
        self._batch: list[tuple[int, str, str, list[int], tuple[object, ...]]] = []
        self._sent: dict[int, tuple[str, tuple[int, ...], str]] = {}  # seq -> (transfer, blocks, op), unanswered
        self._out: queue.SimpleQueue[worker_pb2.CommandBatch | list[_Queued] | None] = queue.SimpleQueue()
        self._aborts: dict[int, bool] = {}  # seq -> found, for abort()
        self._waited: set[int] = set()  # commands of the blocking forms: a refusal is raised, not queued
        self._refusals: dict[int, KVPushError] = {}
        self._closed = False
        self._out.put(worker_pb2.CommandBatch(worker_id=worker_id))
        self._call = client.stub.Stream(self._requests())
        self._reader = threading.Thread(target=self._read, name=f"kvpushd-stream-{worker_id}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.session_error is None and not self._closed

    # -- the engine thread ----------------------------------------------------------------------

    def expect_nowait(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
                      producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
                      transfer_mode: str = "push", traceparent: str = "") -> int:
        return self._add("expect", transfer_id, list(block_ids),
                         (producer_address, producer_engine_id, producer_tp_size, skip_tokens, transfer_mode,
                          traceparent))

    def publish_nowait(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "") -> int:
        return self._add("publish", transfer_id, list(block_ids), (traceparent,) if traceparent else ())

    def abort_nowait(self, transfer_id: str) -> int:
        return self._add("abort", transfer_id, [], ())

    def decline_nowait(self, transfer_id: str, producer_address: str, producer_engine_id: str,
                       reason: str = "") -> int:
        """Decode side: this transfer will never be expected here; best effort, like abort."""
        return self._add("decline", transfer_id, [], (producer_address, producer_engine_id, reason))

    def _add(self, op: str, transfer_id: str, blocks: list[int], args: tuple[object, ...]) -> int:
        seq = next(self._seq)
        self._batch.append((seq, op, transfer_id, blocks, args))
        return seq

    def step(self) -> int:
        """Send this step's commands as one message (nothing when there are none); returns how many."""
        n = len(self._batch)
        if n:
            batch, self._batch = self._batch, []
            with self._cond:  # one lock per step, held for the appends only
                for seq, op, tid, blocks, _ in batch:
                    self._sent[seq] = (tid, tuple(blocks), op)
            self._out.put(batch)
        return n

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send the step and wait until the daemon answered every command sent; False on timeout."""
        self.step()
        with self._cond:
            return self._cond.wait_for(lambda: not self._sent or self.session_error is not None, timeout_s)

    # blocking forms, for tools: one command, its answer
    def expect(self, *args: object, **kwargs: object) -> None:
        self._blocking(self.expect_nowait(*args, **kwargs))  # type: ignore[arg-type]

    def publish(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "") -> None:
        self._blocking(self.publish_nowait(transfer_id, block_ids, traceparent))

    def decline(self, transfer_id: str, producer_address: str, producer_engine_id: str, reason: str = "") -> None:
        self._blocking(self.decline_nowait(transfer_id, producer_address, producer_engine_id, reason))

    def abort(self, transfer_id: str) -> bool:
        seq = self.abort_nowait(transfer_id)
        self._blocking(seq)
        with self._cond:
            return self._aborts.pop(seq, False)

    def _blocking(self, seq: int) -> None:
        with self._cond:
            self._waited.add(seq)
        self.step()
        with self._cond:
            self._cond.wait_for(lambda: seq not in self._sent or self.session_error is not None,
                                self.client.timeout_s)
            self._waited.discard(seq)
            if seq in self._refusals:
                raise self._refusals.pop(seq)
            if self.session_error is not None:
                raise self.session_error

    def detach(self) -> None:
        """Answer what was sent, then end the stream (the daemon detaches the worker). Idempotent."""
        if self._closed:
            return
        self.flush(self.client.timeout_s)
        self._closed = True
        self._out.put(_END)
        self._call.cancel()
        self._reader.join(timeout=5)

    # -- the stream's threads -------------------------------------------------------------------

    def _requests(self) -> Iterator[worker_pb2.CommandBatch]:
        while (batch := self._out.get()) is not _END:
            yield batch if isinstance(batch, worker_pb2.CommandBatch) else worker_pb2.CommandBatch(
                commands=[_command(q) for q in batch])

    def _read(self) -> None:
        try:
            for ev in self._call:
                got: list[Completion] = []
                with self._cond:
                    for r in ev.results:
                        tid, blocks, op = self._sent.pop(r.seq, ("", (), ""))
                        if op == "abort":
                            self._aborts[r.seq] = r.found
                        if r.code == "OK":
                            continue
                        if r.seq in self._waited:
                            self._refusals[r.seq] = errors.error_of(r.code, r.message, r.kind, tid)
                        elif op not in ("abort", "decline"):
                            got.append(Completion(CompletionKind.FAILED, tid, _convert.REFUSED,
                                                  f"{r.code}: {r.message}", blocks))
                    got += [_convert.completion(c) for c in ev.completions]
                    self._queue.extend(got)
                    self._cond.notify_all()
            err: KVPushError = DaemonUnavailable("UNAVAILABLE", "stream ended by the daemon")
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e)
        with self._cond:
            if not self._closed:
                self.session_error = err
                # commands that got no answer end as refused: the engine frees their blocks
                for _, (tid, blocks, op) in sorted(self._sent.items()):
                    if op not in ("abort", "decline"):
                        self._queue.append(Completion(CompletionKind.FAILED, tid, _convert.REFUSED,
                                                      f"{err.code}: stream ended before an answer", blocks))
                self._sent.clear()
            self._cond.notify_all()
