"""The worker that re-attaches after a daemon restart (what the vLLM connector uses).

    rw = ReconnectingStreamWorker("/run/kvpushd/worker.sock", dict(engine_id=..., role=..., tp_rank=...,
                                  tp_size=..., memory=[...], regions=[...]))
    rw.start()                          # attach (waiting for the daemon), start the background thread
    call = rw.send_nowait(Expect("req-1", (3, 4), producer_address, "prefill-0", 1))   # only appends
    rw.step()                           # once per engine step: the step's commands as one message
    for ev in rw.poll():                # no RPC: completions, refusals and losses, in order
        ...

The commands ride one ``WorkerService.Stream`` per attachment (``kvpushd_client.stream.StreamWorker``:
one CommandBatch per ``step()``). Every attachment is an epoch. When one is lost (its stream ends),
``poll`` reports ``lost`` once with that epoch: whatever ran on it will not complete and is the
caller's to fail. The background thread re-attaches with the same arguments every
``reconnect_interval_s`` until the daemon answers. A command made while not attached comes back as
``refused`` (``DaemonUnavailable``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from . import _convert
from .client import KVPushClient, retry_unavailable
from .doorbell import Doorbell
from .stream import StreamWorker
from .types import (
    Abort,
    Attach,
    Completion,
    CompletionKind,
    DaemonUnavailable,
    Decline,
    Expect,
    KVPushError,
    MemfdMemory,
    Publish,
)
from .vmm import VmmChunk, VmmMemory

MAX_DECLINES = 4096  # declines kept while the daemon is away


@dataclass(eq=False)
class Call:
    """One command handed to the link. ``epoch``: the attachment it went out on (None: it did not go
    out, it was refused or dropped at once); ``tag``: the caller's own."""

    method: str  # "Expect" | "Publish" | "Abort": its command's record type
    transfer_id: str
    block_ids: tuple[int, ...] = ()
    tag: Any = None
    epoch: int | None = None


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


def _close_quietly(client: KVPushClient | None, worker: StreamWorker | None) -> None:
    if worker is not None:
        with contextlib.suppress(Exception):  # the daemon is gone or restarted: nothing left there
            worker.detach()
    if client is not None:
        client.close()


class ReconnectingStreamWorker:
    """The attachment to the local daemon on a worker stream, re-made after a daemon restart.

    The engine thread's ``send_nowait`` appends to the current attachment's batch (no lock: the
    attachment is read as one reference) and ``step()`` hands the batch to the stream's sender; a
    command the daemon refuses comes back as a FAILED completion with code ``REFUSED`` on its epoch.
    A command goes out with its step: an Abort after it (in the same batch or a later one) is what
    withdraws it. A background thread re-attaches and makes the declines.
    """

    def __init__(self, socket_path: str, attach: dict[str, Any], rpc_timeout_s: float = 10.0,
                 reconnect_interval_s: float = 0.5, logger: logging.Logger | None = None) -> None:
        self.socket_path = socket_path
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_interval_s = reconnect_interval_s
        self.log = logger or logging.getLogger("kvpushd_client")
        self._lock = threading.Lock()
        self._own: list[int] = []
        self._record, self._doorbell, self._doorbell_fd = self._own_descriptors(attach)
        self._events: collections.deque[LinkEvent] = collections.deque()
        self.client: KVPushClient | None = None
        self.worker: StreamWorker | None = None
        self._live: tuple[StreamWorker, int] | None = None  # (worker, epoch): the engine thread reads it
        self.epoch = 0
        self._lost_epoch = 0
        self._next_attempt = 0.0
        self._failed_attempts = 0
        self._stopped = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Declines not yet made: made from the background thread once attached; the oldest dropped past the cap
        self._declines: collections.deque[Decline] = collections.deque(maxlen=MAX_DECLINES)

    def _own_descriptors(self, attach: dict[str, Any]) -> tuple[Attach, Doorbell | bool, int | None]:
        """The attach arguments (the Attach record's fields by name, and ``doorbell``) as the Attach
        record, the doorbell and the descriptor its page goes by, with this link's own copies (dup) of
        the memfds, of the VMM chunks' descriptors and of that descriptor: the background thread hands
        those over at every re-attach, so a caller that closes its own meanwhile cannot have another
        file sent under a reused number (the daemon would map it as this worker's KV). Closed once the
        thread is done (``close``)."""
        args = dict(attach)
        bell: Doorbell | bool = args.pop("doorbell", None) or False
        bell_fd: int | None = None
        try:
            mem = []
            for m in args.pop("memory", ()):
                if isinstance(m, MemfdMemory):
                    m = MemfdMemory(os.dup(m.fd), m.size)
                    self._own.append(m.fd)
                elif isinstance(m, VmmMemory):  # CUDA virtual memory: each chunk's descriptor
                    chunks = []
                    for c in m.chunks:
                        chunks.append(VmmChunk(c.offset, c.size, os.dup(c.fd)))
                        self._own.append(chunks[-1].fd)
                    m = dataclasses.replace(m, chunks=tuple(chunks))
                mem.append(m)
            if not isinstance(bell, bool):
                bell_fd = os.dup(bell.fd)  # the caller's page, handed over by this descriptor
                self._own.append(bell_fd)
            record = Attach(memory=tuple(mem), regions=tuple(args.pop("regions", ())), **args)
        except BaseException:
            self._release()
            raise
        return record, bell, bell_fd

    def _release(self) -> None:
        with self._lock:
            fds, self._own = self._own, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def connected(self) -> bool:
        with self._lock:
            return self.worker is not None and self.worker.alive and self.epoch > self._lost_epoch

    def start(self, connect_timeout_s: float = 30.0) -> None:
        """Attach, waiting up to ``connect_timeout_s`` for the daemon, then start the background thread.
        Raises DaemonUnavailable when no daemon answered in time, KVPushError when it refused."""
        try:
            retry_unavailable(self._attach, connect_timeout_s, 0.2)
        except BaseException:  # no thread will close the descriptors this link keeps
            self._release()
            raise
        self._thread = threading.Thread(target=self._run, name="kvpushd-connector", daemon=True)
        self._thread.start()

    def _attach(self) -> None:
        client = KVPushClient(self.socket_path, timeout_s=self.rpc_timeout_s)
        try:
            worker = client.attach_record(self._record, self._doorbell, self._doorbell_fd)
        except BaseException:
            client.close()
            raise
        with self._lock:
            orphan = self._stopped  # closed while attaching: this attachment is nobody's
            if orphan:
                old: tuple[KVPushClient | None, StreamWorker | None] = (client, worker)
            else:
                old = (self.client, self.worker)
                self.client, self.worker = client, worker
                self.epoch += 1
                self._live = (worker, self.epoch)
            epoch = self.epoch
        _close_quietly(*old)
        if orphan:
            return
        self.log.info("kvpushd: attached to %s as worker %s (attachment %d, peer address %s)",
                      self.socket_path, worker.worker_id, epoch, worker.peer_address)

    def poll(self) -> list[LinkEvent]:
        """Completions and link events since the last poll, in order (no RPC)."""
        with self._lock:
            self._take_locked(completions=True)
            out = list(self._events)
            self._events.clear()
        return out

    @property
    def running(self) -> bool:
        """Its thread is still at work (``close`` waits for it only so long)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            old = (self.client, self.worker)
            self.client = self.worker = None
            self._live = None
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.rpc_timeout_s + 5)
        _close_quietly(*old)
        if not self.running:  # else the thread closes them as it ends
            self._release()

    def _take_locked(self, completions: bool) -> None:
        """The current attachment's news as events: once its stream ended, what it delivered before (still
        true) and then its loss, once; while it lives, with ``completions``, what it delivered so far."""
        w = self.worker
        if w is None or self.epoch <= self._lost_epoch:
            return
        lost = not w.alive
        if lost or completions:
            for c in w.completions():
                self._events.append(LinkEvent("completion", self.epoch, c))
        if lost:
            self._lost_epoch = self.epoch
            self._events.append(LinkEvent("lost", self.epoch, reason=str(w.session_error or "session ended")))

    # the engine thread ---------------------------------------------------------------------------
    def send_nowait(self, cmd: Expect | Publish | Abort, tag: Any = None, only_epoch: int | None = None) -> Call:
        """Append the command record to the current attachment's step, as it is (a Publish with
        ``step``/``layers`` is declared before that step's forward).
        An Abort goes after every earlier command; with ``only_epoch``, only on that attachment (the
        one the transfer's Expect ran on), dropped otherwise, as when not attached."""
        call = Call(type(cmd).__name__, cmd.transfer_id, () if isinstance(cmd, Abort) else cmd.block_ids, tag=tag)
        live = self._live
        if only_epoch is not None and live is not None and live[1] != only_epoch:
            return call
        if live is None or not live[0].alive or live[1] <= self._lost_epoch:
            # not attached: an Expect or Publish is refused at once, an Abort dropped
            if call.method != "Abort":
                err = DaemonUnavailable("UNAVAILABLE", "not attached to the daemon")
                done = Completion(CompletionKind.FAILED, call.transfer_id, _convert.REFUSED,
                                  f"{call.method} not made: {err}", call.block_ids)
                with self._lock:
                    self._events.append(LinkEvent("refused", None, done, call, err))
            return call
        call.epoch = live[1]  # the attachment it goes out on
        live[0].send_nowait(cmd)
        return call

    def step(self) -> int:
        """Send this step's commands as one message on the current attachment; returns how many."""
        live = self._live
        return live[0].step() if live is not None else 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send the step and wait until the daemon answered every command sent; False on timeout."""
        live = self._live
        return live[0].flush(timeout_s) if live is not None else True

    # declines (any thread) -----------------------------------------------------------------------
    def decline_nowait(self, cmd: Decline) -> None:
        """This transfer will never be expected here (its Expect was refused while the daemon was
        unreachable, or died with an attachment): the daemon tells the prefill daemon, which then frees
        the transfer's source blocks instead of at its publish_timeout_s. Kept while not attached; made
        from the background thread (within ``reconnect_interval_s``) once attached, whether or not
        the engine steps."""
        if len(cmd.reason) > 1000:
            cmd = msgspec.structs.replace(cmd, reason=cmd.reason[:1000])
        with self._lock:
            self._declines.append(cmd)

    @property
    def declines_pending(self) -> int:
        return len(self._declines)

    # the background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._wake.wait(self.reconnect_interval_s):
                self.tick()
        finally:
            if self._stopped:
                self._release()

    def tick(self) -> None:
        """Report a lost attachment, re-attach when it is time to, make the declines."""
        with self._lock:
            if self._stopped:
                return
            self._take_locked(completions=False)
        if not self.connected and time.monotonic() >= self._next_attempt:
            self._reconnect()
        if self._declines and self.connected:
            self._make_declines()

    def _make_declines(self) -> None:
        with self._lock:
            w = self.worker
            todo = list(self._declines)
            self._declines.clear()
        if w is None:
            return
        for i, cmd in enumerate(todo):
            try:
                w.call(cmd)
            except KVPushError as e:
                if isinstance(e, DaemonUnavailable) or e.code == "NOT_FOUND":  # again once re-attached
                    with self._lock:
                        self._declines.extendleft(reversed(todo[i:]))
                    return
                self.log.warning("kvpushd: declining transfer %s failed: %s", cmd.transfer_id, e)

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
