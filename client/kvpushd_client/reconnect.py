"""A worker that re-attaches after a daemon restart, with queued calls (what the vLLM connector uses).

    rw = ReconnectingWorker("/run/kvpushd/worker.sock", dict(engine_id=..., role=..., tp_rank=...,
                            tp_size=..., memory=[...], regions=[...]))
    rw.start()                          # attach (waiting for the daemon), start the call thread
    call = rw.expect_nowait("req-1", [3, 4], producer_address, "prefill-0", 1)   # only queues
    for ev in rw.poll():                # no RPC: completions, refusals and losses, in order
        ...

Every attachment is an epoch. When one is lost (its session stream ends, or a call finds the daemon
gone or the worker forgotten), ``poll`` reports ``lost`` once with that epoch: whatever ran on it will
not complete and is the caller's to fail; calls still queued go to the next attachment, which the
call thread makes with the same arguments every ``reconnect_interval_s`` until the daemon answers.
The calls themselves are ``kvpushd_client.calls.CallQueue``'s, the same queue ``Worker.*_nowait`` use.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .calls import Call, CallQueue, CallState
from .client import KVPushClient, Worker
from .types import Completion, DaemonUnavailable, KVPushError

MAX_DECLINES = 4096  # declines kept while the daemon is away


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """``kind``: "completion" (``completion`` delivered on attachment ``epoch``), "refused" (``call``
    did not go through: ``completion`` is its REFUSED completion, ``error`` why) or "lost" (attachment
    ``epoch`` is gone: ``reason``)."""

    kind: str
    epoch: int | None = None
    completion: Completion | None = None
    call: Call | None = None
    error: KVPushError | None = None
    reason: str = ""


def _close_quietly(client: KVPushClient | None, worker: Worker | None) -> None:
    if worker is not None:
        with contextlib.suppress(Exception):  # the daemon is gone or restarted: nothing left there
            worker.detach()
    if client is not None:
        client.close()


class ReconnectingWorker:
    """The attachment to the local daemon, re-made after a daemon restart.

    The engine thread calls ``*_nowait``/``cancel``/``poll`` (no RPC: a lock and a queue); the call
    thread makes the calls and re-attaches.
    """

    def __init__(self, socket_path: str, attach: dict[str, Any], rpc_timeout_s: float = 10.0,
                 reconnect_interval_s: float = 0.5, logger: logging.Logger | None = None) -> None:
        self.socket_path = socket_path
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.log = logger or logging.getLogger("kvpushd_client")
        self._attach_args = attach
        self._lock = threading.Lock()
        self._events: collections.deque[LinkEvent] = collections.deque()
        self.client: KVPushClient | None = None
        self.worker: Worker | None = None
        self.epoch = 0
        self._lost_epoch = 0
        self._next_attempt = 0.0
        self._failed_attempts = 0
        self._stopped = False
        # Declines not yet made (no attachment): made once one is (re)made, the oldest dropped past the cap
        self._declines: collections.deque[Call] = collections.deque(maxlen=MAX_DECLINES)
        self._calls = CallQueue(self, name="kvpushd-connector", idle_s=reconnect_interval_s)

    @property
    def connected(self) -> bool:
        with self._lock:
            return self.worker is not None and self.worker.alive and self.epoch > self._lost_epoch

    def start(self, connect_timeout_s: float = 30.0) -> None:
        """Attach, waiting up to ``connect_timeout_s`` for the daemon, then start the call thread.
        Raises DaemonUnavailable when no daemon answered in time, KVPushError when it refused."""
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._attach()
                break
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._calls.start()

    def _attach(self) -> None:
        client = KVPushClient(self.socket_path, timeout_s=self.rpc_timeout_s)
        try:
            worker = client.attach(**self._attach_args)
        except BaseException:
            client.close()
            raise
        with self._lock:
            orphan = self._stopped  # closed while attaching: this attachment is nobody's
            if orphan:
                old: tuple[KVPushClient | None, Worker | None] = (client, worker)
            else:
                old = (self.client, self.worker)
                self.client, self.worker = client, worker
                self.epoch += 1
            epoch = self.epoch
        _close_quietly(*old)
        if orphan:
            return
        self.log.info("kvpushd: attached to %s as worker %s (attachment %d, peer address %s)",
                      self.socket_path, worker.worker_id, epoch, worker.peer_address)

    # engine thread -----------------------------------------------------------------------------
    def expect_nowait(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
                      producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
                      transfer_mode: str = "push", tag: Any = None, traceparent: str = "") -> Call:
        return self._calls.submit(Call("Expect", transfer_id, tuple(block_ids), expect_args=dict(
            producer_address=producer_address, producer_engine_id=producer_engine_id,
            producer_tp_size=producer_tp_size, skip_tokens=skip_tokens, transfer_mode=transfer_mode), tag=tag,
            traceparent=traceparent))

    def publish_nowait(self, transfer_id: str, block_ids: Iterable[int], tag: Any = None,
                       traceparent: str = "") -> Call:
        return self._calls.submit(Call("Publish", transfer_id, tuple(block_ids), tag=tag, traceparent=traceparent))

    def abort_nowait(self, transfer_id: str, only_epoch: int | None = None, tag: Any = None) -> Call:
        """Queued after every earlier call. With ``only_epoch``, made only on that attachment (the one
        the transfer's Expect ran on); dropped otherwise, as when not attached."""
        return self._calls.submit(Call("Abort", transfer_id, only_epoch=only_epoch, tag=tag))

    def decline_nowait(self, transfer_id: str, producer_address: str, producer_engine_id: str,
                       reason: str = "", tag: Any = None) -> Call:
        """This transfer will never be expected here (its Expect was refused, or died with an
        attachment): the daemon tells the prefill daemon, which frees the source blocks at once
        instead of at its publish_timeout_s. Kept while not attached; made once re-attached."""
        return self._calls.submit(Call("Decline", transfer_id, expect_args=dict(
            producer_address=producer_address, producer_engine_id=producer_engine_id, reason=reason[:1000]), tag=tag))

    def cancel(self, call: Call) -> bool:
        """Withdraw a queued call; False once the thread has started it."""
        return self._calls.cancel(call)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._calls.flush(timeout_s)

    def poll(self) -> list[LinkEvent]:
        """Completions and link events since the last poll, in order (no RPC)."""
        with self._lock:
            w = self.worker
            if w is not None and self.epoch > self._lost_epoch and not w.alive:
                self._mark_lost_locked(w, str(w.session_error or "session ended"))
            elif w is not None and self.epoch > self._lost_epoch:
                for c in w.completions():
                    self._events.append(LinkEvent("completion", self.epoch, c))
            out = list(self._events)
            self._events.clear()
        return out

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            old = (self.client, self.worker)
            self.client = self.worker = None
        self._calls.close(join_timeout_s=self.rpc_timeout_s + 5)
        _close_quietly(*old)

    # both threads, under the lock ---------------------------------------------------------------
    def _mark_lost_locked(self, w: Worker, reason: str) -> None:
        if self.epoch <= self._lost_epoch or w is not self.worker:
            return
        self._lost_epoch = self.epoch
        for c in w.completions():  # delivered before the loss: still true
            self._events.append(LinkEvent("completion", self.epoch, c))
        self._events.append(LinkEvent("lost", self.epoch, reason=reason))

    # the call thread (CallQueue's target) -------------------------------------------------------
    def tick(self) -> None:
        with self._lock:
            if self._stopped:
                return
            w = self.worker
            if w is not None and self.epoch > self._lost_epoch and not w.alive:
                self._mark_lost_locked(w, str(w.session_error or "session ended"))
        if not self.connected and time.monotonic() >= self._next_attempt:
            self._reconnect()
        if self._declines and self.connected:
            with self._lock:
                again, self._declines = list(self._declines), collections.deque(maxlen=MAX_DECLINES)
            for call in again:
                call.state, call.epoch = CallState.QUEUED, None
                self._calls.submit(call)

    def attachment(self, call: Call) -> tuple[Worker, int] | None:
        with self._lock:
            w, epoch = self.worker, self.epoch
            if self._stopped or w is None or not w.alive or epoch <= self._lost_epoch:
                return None
            if call.only_epoch is not None and call.only_epoch != epoch:
                return None  # its Expect died with an earlier attachment: the loss already reported it
            return w, epoch

    def refused(self, call: Call, completion: Completion, error: KVPushError | None) -> None:
        with self._lock:
            lost = isinstance(error, DaemonUnavailable) or (error is not None and error.code == "NOT_FOUND")
            if call.method == "Decline":  # best effort; not attached, or the daemon went away: again once attached
                if lost:
                    self._declines.append(call)
                else:
                    self.log.warning("kvpushd: declining transfer %s failed: %s", call.transfer_id, error)
            else:
                self._events.append(LinkEvent("refused", call.epoch, completion, call, error))
            w = self.worker
            if lost and w is not None and call.epoch == self.epoch:  # daemon gone or it forgot us
                self._mark_lost_locked(w, str(error))

    def _reconnect(self) -> None:
        self._next_attempt = time.monotonic() + self.reconnect_interval_s
        try:
            self._attach()
        except KVPushError as e:
            self._failed_attempts += 1
            if self._failed_attempts == 1 or self._failed_attempts % 120 == 0:
                self.log.error("kvpushd: re-attaching to the daemon at %s failed (%d tries so far): %s",
                               self.socket_path, self._failed_attempts, e)
            return
        if self._failed_attempts or self.epoch > 1:
            self.log.warning("kvpushd: re-attached to the daemon at %s after it restarted", self.socket_path)
        self._failed_attempts = 0
