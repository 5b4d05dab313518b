"""Queued daemon calls: the one sender thread behind ``Worker.*_nowait`` and ``ReconnectingWorker``.

The engine thread only queues a call (a lock and a deque, a few microseconds); one thread per queue
makes the calls in order, each a blocking unary RPC on whatever attachment the queue's target hands
it. A call that fails becomes a FAILED completion with code ``REFUSED``, the daemon's status and
message in its reason and the request's block ids, so an engine frees blocks on one path whatever went
wrong. When the outcome is unsure (the call may have reached the daemon: DEADLINE_EXCEEDED, UNKNOWN,
INTERNAL) an Abort of that transfer follows on the same attachment, best effort, so the daemon lets go
of blocks the engine is about to free.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import _convert
from .types import Completion, CompletionKind, DaemonUnavailable, KVPushError


class Worker(Protocol):
    """What a queue needs of an attachment (``client.Worker`` is one): the blocking calls."""

    def expect(self, transfer_id: str, block_ids: Any, producer_address: str, producer_engine_id: str,
               producer_tp_size: int, skip_tokens: int = 0, transfer_mode: str = "push",
               traceparent: str = "") -> None: ...

    def publish(self, transfer_id: str, block_ids: Any, traceparent: str = "") -> None: ...

    def abort(self, transfer_id: str) -> bool: ...

    def decline(self, transfer_id: str, producer_address: str, producer_engine_id: str,
                reason: str = "") -> None: ...


# Calls whose refusal is no failure of a request (nothing to free): dropped, not reported.
BEST_EFFORT = frozenset({"Abort", "Decline"})
# Call outcomes that do not say whether the daemon acted on the call.
UNSURE = frozenset({"DEADLINE_EXCEEDED", "UNKNOWN", "INTERNAL"})


class CallState(enum.Enum):
    QUEUED = 0
    STARTED = 1
    CANCELLED = 2


@dataclass(eq=False)
class Call:
    """One queued call. ``epoch``: the attachment it ran on (None until it ran); ``only_epoch``: an
    Abort runs only on that attachment (the one its Expect ran on); ``tag``: the caller's own."""

    method: str  # "Expect" | "Publish" | "Abort" | "Decline"
    transfer_id: str
    block_ids: tuple[int, ...] = ()
    expect_args: dict[str, Any] = field(default_factory=dict)  # Expect, Decline: producer_address, ...
    only_epoch: int | None = None
    tag: Any = None
    traceparent: str = ""  # Expect, Publish: the engine request's W3C trace context ("" none)
    state: CallState = CallState.QUEUED
    epoch: int | None = None

    def make(self, w: Worker) -> None:
        """The blocking call on one attachment."""
        tp: dict[str, Any] = {"traceparent": self.traceparent} if self.traceparent else {}  # old fakes lack it
        if self.method == "Expect":
            w.expect(self.transfer_id, self.block_ids, **self.expect_args, **tp)
        elif self.method == "Publish":
            w.publish(self.transfer_id, self.block_ids, **tp)
        elif self.method == "Decline":
            w.decline(self.transfer_id, **self.expect_args)
        else:
            w.abort(self.transfer_id)


def refused(call: Call, reason: str) -> Completion:
    """The FAILED completion a call that did not go through ends with."""
    return Completion(CompletionKind.FAILED, call.transfer_id, _convert.REFUSED, reason, call.block_ids)


class Target(Protocol):
    """Where a queue's calls go: the owner of the attachment(s)."""

    def attachment(self, call: Call) -> tuple[Worker, int] | None:
        """The worker to make ``call`` on and its epoch; None: not attached (an Abort is then dropped).
        Called with the queue's lock held: it must not call back into the queue."""

    def refused(self, call: Call, completion: Completion, error: KVPushError | None) -> None:
        """``call`` did not go through; ``completion`` is its REFUSED completion."""

    def tick(self) -> None:
        """Runs on the thread before every call and every ``idle_s`` without one."""


class CallQueue:
    """The calls of one target, in order, on one thread (started on first use or by ``start``)."""

    def __init__(self, target: Target, name: str, idle_s: float | None = None) -> None:
        self._target = target
        self._name = name
        self._idle_s = idle_s
        self._q: collections.deque[Call] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, call: Call) -> Call:
        with self._cond:
            self._start_locked()
            self._q.append(call)
            self._cond.notify_all()
        return call

    def cancel(self, call: Call) -> bool:
        """Withdraw a queued call; False once the thread has started it."""
        with self._cond:
            if call.state is CallState.QUEUED:
                call.state = CallState.CANCELLED
                return True
            return False

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued call has been made; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._q and not self._busy, timeout_s)

    def close(self, join_timeout_s: float | None = None) -> None:
        """Stop the thread after the call it is making (waiting for it up to ``join_timeout_s`` when
        given); calls still queued are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if join_timeout_s is not None and thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._q or self._closed, self._idle_s)
                if self._closed:
                    self._q.clear()
                    self._cond.notify_all()
                    return
                waiting = bool(self._q)
            self._target.tick()
            if not waiting:
                continue
            with self._cond:
                if self._closed or not self._q:
                    continue
                call = self._q.popleft()
                if call.state is CallState.CANCELLED:
                    continue
                # Started and bound to its attachment in one step: whoever fails to cancel it
                # sees the epoch it runs on.
                call.state = CallState.STARTED
                got = self._target.attachment(call)
                if got is not None:
                    call.epoch = got[1]
                self._busy = True
            self._make(call, got)

    def _make(self, call: Call, got: tuple[Worker, int] | None) -> None:
        if got is None:
            if call.method not in BEST_EFFORT:
                err = DaemonUnavailable("UNAVAILABLE", "not attached to the daemon")
                self._target.refused(call, refused(call, f"{call.method} not made: {err}"), err)
            return
        w = got[0]
        try:
            call.make(w)
        except KVPushError as e:
            self._target.refused(call, refused(call, f"{call.method} refused by the daemon: {e.code}: {e.message}"),
                                 e)
            if call.method not in BEST_EFFORT and e.code in UNSURE:
                with contextlib.suppress(Exception):
                    w.abort(call.transfer_id)
        except Exception as e:  # the engine must hear of it, not lose the request
            self._target.refused(call, refused(call, f"{call.method} failed in the client: {e!r}"), None)


class DirectTarget:
    """One attachment, no reconnection (``Worker.*_nowait``): refusals go to the worker's own
    completions; a refused Abort is dropped (an unknown transfer is no error)."""

    def __init__(self, worker: Worker, deliver: Callable[[Completion], None]) -> None:
        self._worker = worker
        self._deliver = deliver

    def attachment(self, call: Call) -> tuple[Worker, int] | None:
        return self._worker, 1

    def refused(self, call: Call, completion: Completion, error: KVPushError | None) -> None:
        if call.method not in BEST_EFFORT:
            self._deliver(completion)

    def tick(self) -> None:
        return
