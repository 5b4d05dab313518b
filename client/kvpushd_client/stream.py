"""A worker on its stream (WorkerService.Stream, the daemon's only transfer API): batches of
commands, one per engine step.

    w = client.attach("decode-0", Role.CONSUMER, 0, 1, memory, regions)
    w.send_nowait(Expect(...)); w.send_nowait(Expect(...))   # the engine thread only appends (no lock)
    w.step()                                      # once per engine step: the batch goes out as one message
    for c in w.completions(): ...                 # results and completions come back on the same stream

A command is its record (kvpushd_client.types: Expect, Publish, Abort, Decline), queued as it is.
The engine thread never waits on the network: ``send_nowait`` appends to the step's batch, ``step()``
hands the batch to the stream's sender (a queue put). A command the daemon refuses comes back as a
FAILED completion with code ``REFUSED``, its status and message in ``reason`` and its block ids, so
an engine frees the blocks on the same path as any other failed transfer. One gRPC message per step.

Call and wait, for tools and tests: ``send(record)`` sends the step and one command, and returns its
answer (True, or an Abort's ``found``; raising the daemon's refusal); ``call`` does the same for one
command from any thread, unordered with the engine thread's step.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import grpc

from . import _convert, errors
from .doorbell import Doorbell
from .proto.v1 import common_pb2, worker_pb2
from .types import (
    Abort,
    Command,
    Completion,
    CompletionKind,
    DaemonUnavailable,
    Decline,
    Expect,
    KVPushError,
    Publish,
)


class _Client(Protocol):
    """What a stream worker needs of its client (``client.KVPushClient`` is one)."""

    stub: Any
    timeout_s: float

_END = None
# Detach's answers that mean the worker is already gone (the daemon restarted, or the stream ended first)
_GONE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
# The engine thread appends each command as its record (kvpushd_client.types: Expect, Publish, Abort,
# Decline); the sender thread turns a step's records into protobuf.
_Step = tuple[int, list[Command]]  # the seq of the step's first command, its commands
MAX_BATCH = 4096  # commands in one CommandBatch: the daemon's limit (kvpushd.rpc.services)
_CALLS = 1 << 62  # seqs of ``call``: their own range, so any thread can number one


def _command(seq: int, c: Command) -> worker_pb2.Command:
    if isinstance(c, Expect):
        return worker_pb2.Command(seq=seq, expect=worker_pb2.ExpectRequest(
            transfer_id=c.transfer_id, block_ids=c.block_ids, producer_address=str(c.producer_address),
            producer_engine_id=str(c.producer_engine_id), producer_tp_size=int(c.producer_tp_size),
            skip_tokens=int(c.skip_tokens), transfer_mode=common_pb2.TransferMode.ValueType(int(c.transfer_mode)),
            traceparent=str(c.traceparent)))
    if isinstance(c, Publish):
        return worker_pb2.Command(seq=seq, publish=worker_pb2.PublishRequest(
            transfer_id=c.transfer_id, block_ids=c.block_ids, traceparent=str(c.traceparent),
            consumer_node_id=str(c.consumer_node_id), consumer_tls_name=str(c.consumer_tls_name),
            step=int(c.step), layers=int(c.layers), ready_blocks=int(c.ready_blocks)))
    if isinstance(c, Decline):
        return worker_pb2.Command(seq=seq, decline=worker_pb2.DeclineRequest(
            transfer_id=c.transfer_id, producer_address=str(c.producer_address),
            producer_engine_id=str(c.producer_engine_id), reason=str(c.reason)))
    return worker_pb2.Command(seq=seq, abort=worker_pb2.AbortRequest(transfer_id=c.transfer_id))


class StreamWorker:
    """An attached worker whose session is a WorkerService.Stream."""

    def __init__(self, client: _Client, worker_id: str, node_id: str, peer_address: str,
                 doorbell: Doorbell | None = None, owns_doorbell: bool = False, token: bytes = b"") -> None:
        self.client = client
        self.token = token  # the Attach's worker_token: this session and its Detach are ours alone
        self.doorbell = doorbell  # progressive push: the engine thread rings it (kvpushd_client.doorbell)
        self._owns_doorbell = owns_doorbell
        self.worker_id = worker_id
        self.node_id = node_id
        self.peer_address = peer_address
        # completions delivered by the reader thread, taken by the engine without an RPC
        self._queue: collections.deque[Completion] = collections.deque()
        self._cond = threading.Condition()
        self.session_error: KVPushError | None = None
        # the engine thread's own (no lock): this step's commands, and the seq before them (a
        # command's seq is its place in the worker's stream). What was sent is recorded, and the
        # protobuf messages built, by the stream's sender thread, off the engine thread.
        self._batch: list[Command] = []
        self._base = 0
        self._recorded = 0  # the sender thread has recorded every command up to this seq in _sent
        self._sent: dict[int, Command] = {}  # seq -> its command, unanswered
        self._out: queue.SimpleQueue[worker_pb2.CommandBatch | _Step | None] = queue.SimpleQueue()
        self._calls = itertools.count(_CALLS)
        self._waited: set[int] = set()  # commands of ``call``: answered here, a refusal raised, not queued
        self._answers: dict[int, bool] = {}  # seq -> True, or an Abort's found
        self._refusals: dict[int, KVPushError] = {}
        self._closed = False
        # CPU time (time.thread_time_ns) the stream's own Python threads spent so far: the sender
        # building and sending batches, the reader taking answers and completions (what they cost the
        # engine's process, the GIL included, beside the engine thread's own appends and step())
        self.sender_cpu_ns = 0
        self.reader_cpu_ns = 0
        self._out.put(worker_pb2.CommandBatch(worker_id=worker_id, worker_token=token))
        self._call = client.stub.Stream(self._requests())
        self._reader = threading.Thread(target=self._read, name=f"kvpushd-stream-{worker_id}", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.session_error is None and not self._closed

    def completions(self) -> list[Completion]:
        """Everything delivered so far, without waiting (no RPC). Nothing delivered: no lock taken (the
        reader thread holds it while it takes a batch; the engine thread need not wait for that)."""
        if not self._queue:
            return []
        with self._cond:
            got = list(self._queue)
            self._queue.clear()
        return got

    def next_completion(self, timeout_s: float | None = None) -> Completion | None:
        """Wait for one completion (for tools and tests; engines use completions())."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue or self.session_error is not None, timeout_s):
                return None
            if self._queue:
                return self._queue.popleft()
            assert self.session_error is not None
            raise self.session_error

    # -- the engine thread ----------------------------------------------------------------------

    def send_nowait(self, cmd: Command) -> int:
        """Append one command record to this step's batch, as it is; returns its seq."""
        b = self._batch
        b.append(cmd)
        return self._base + len(b)

    def step(self) -> int:
        """Send this step's commands as one message (several past MAX_BATCH; nothing when there are
        none); returns how many. No lock: the batch goes to the sender thread as it is (a queue put)."""
        batch = self._batch
        n = len(batch)
        if n:
            self._batch = []
            base = self._base
            self._base = base + n
            for i in range(0, n, MAX_BATCH):  # the daemon refuses a bigger CommandBatch unparsed
                self._out.put((base + 1 + i, batch[i:i + MAX_BATCH]))
            if self.session_error is not None:  # the stream is gone: nobody will send it
                with self._cond:
                    self._drain_locked()
        return n

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send the step and wait until the daemon answered every command sent; False on timeout."""
        self.step()
        last = self._base
        with self._cond:
            return self._cond.wait_for(
                lambda: (self._recorded >= last and not self._sent) or self.session_error is not None, timeout_s)

    def send(self, cmd: Command) -> bool:
        """Send the step, then the command record, and wait for its answer (``call``)."""
        self.step()
        return self.call(cmd)

    def call(self, q: Command, timeout_s: float | None = None) -> bool:
        """One command record on its own batch, from any thread, and its answer: True, or an Abort's
        ``found``; raises the daemon's refusal, or the stream's end."""
        seq = next(self._calls)
        timeout = self.client.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            self._waited.add(seq)
        self._out.put((seq, [q]))
        with self._cond:
            if self.session_error is not None:  # nobody will send it
                self._drain_locked()
            self._cond.wait_for(lambda: seq in self._answers or seq in self._refusals
                                or self.session_error is not None, timeout)
            self._waited.discard(seq)
            if seq in self._answers:
                return self._answers.pop(seq)
            if seq in self._refusals:
                raise self._refusals.pop(seq)
            self._sent.pop(seq, None)
            raise self.session_error or DaemonUnavailable("DEADLINE_EXCEEDED", f"no answer within {timeout:g}s")

    def detach(self) -> None:
        """Answer what was sent, detach (the daemon fails what is pending and releases the memory), then end
        the stream. Idempotent."""
        if self._closed:
            return
        self.flush(self.client.timeout_s)
        self._closed = True
        try:  # detached when this returns, so the same engine may attach again at once
            self.client.stub.Detach(worker_pb2.DetachRequest(worker_id=self.worker_id, worker_token=self.token),
                                    timeout=self.client.timeout_s)
        except grpc.RpcError as e:
            if e.code() not in _GONE:
                raise errors.from_rpc_error(e) from None
        finally:
            self._out.put(_END)
            self._call.cancel()
            self._reader.join(timeout=5)
            if self._owns_doorbell and self.doorbell is not None:
                self.doorbell.close()

    # -- the stream's threads -------------------------------------------------------------------

    def _requests(self) -> Iterator[worker_pb2.CommandBatch]:
        # gRPC's sender thread runs this generator: from one resume to the next it records and builds
        # a batch and serializes and sends the one before (waiting in get() takes no CPU)
        t = time.thread_time_ns()
        while (item := self._out.get()) is not _END:
            if isinstance(item, worker_pb2.CommandBatch):
                yield item
            elif (msg := self._record(*item)) is not None:
                yield msg
            now = time.thread_time_ns()
            self.sender_cpu_ns += now - t
            t = now

    def _record(self, first: int, batch: list[Command]) -> worker_pb2.CommandBatch | None:
        """What a step sends, in ``_sent`` until answered; None when the stream is already gone (then
        refused at once)."""
        with self._cond:
            if first < _CALLS:
                self._recorded = first + len(batch) - 1
            if self.session_error is not None:
                self._refuse_locked(enumerate(batch, first),
                                    f"{self.session_error.code}: stream ended before the command was sent")
                return None
            for i, q in enumerate(batch, first):
                self._sent[i] = q
            self._cond.notify_all()
        return worker_pb2.CommandBatch(commands=[_command(i, q) for i, q in enumerate(batch, first)])

    def _refuse_locked(self, commands: Iterable[tuple[int, Command]], reason: str) -> None:
        """Fail each (seq, command) unanswered with code REFUSED: the engine frees its blocks."""
        for i, q in commands:
            # an Abort or Decline fails no request (nothing to free); a blocking form raises the stream's error
            if isinstance(q, (Expect, Publish)) and i not in self._waited:
                self._queue.append(Completion(CompletionKind.FAILED, q.transfer_id, _convert.REFUSED, reason,
                                              q.block_ids, unanswered=True))

    def _drain_locked(self) -> None:
        """Refuse the steps still queued for a sender that will send nothing more (``_record`` does, the
        stream being gone)."""
        while True:
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return
            if item is _END:  # detach's: the sender thread still needs it
                self._out.put(_END)
                return
            if not isinstance(item, worker_pb2.CommandBatch):
                self._record(*item)

    def _read(self) -> None:
        t = time.thread_time_ns()
        try:
            for ev in self._call:
                got = [_convert.completion(c) for c in ev.completions]  # built before taking the lock
                with self._cond:
                    for r in ev.results:
                        q = self._sent.pop(r.seq, None)
                        if r.seq in self._waited:
                            if r.code == "OK":
                                self._answers[r.seq] = r.found if isinstance(q, Abort) else True
                            else:
                                self._refusals[r.seq] = errors.error_of(r.code, r.message, r.kind,
                                                                        q.transfer_id if q is not None else "")
                        elif r.code != "OK" and not isinstance(q, (Abort, Decline)):  # those free nothing
                            self._queue.append(Completion(CompletionKind.FAILED, q.transfer_id if q else "",
                                                          _convert.REFUSED, f"{r.code}: {r.message}",
                                                          q.block_ids if q else ()))
                    self._queue.extend(got)
                    self._cond.notify_all()
                now = time.thread_time_ns()
                self.reader_cpu_ns += now - t  # receiving, parsing and taking this batch
                t = now
            err: KVPushError = DaemonUnavailable("UNAVAILABLE", "stream ended by the daemon")
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e)
        with self._cond:
            if not self._closed:
                self.session_error = err
                # commands that got no answer end as refused: the engine frees their blocks
                self._refuse_locked(sorted(self._sent.items()), f"{err.code}: stream ended before an answer")
                self._sent.clear()
                self._drain_locked()  # and so do those not sent yet
            self._cond.notify_all()
