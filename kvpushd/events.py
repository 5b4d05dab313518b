"""The event hub: what happens in the daemon, for Watch streams and in-process listeners.

The node calls ``emit`` where something happens (a transfer starts, finishes or fails, a worker
attaches or detaches, a peer connects or is lost, the daemon drains). Every Watch subscriber has
its own bounded queue; when a reader falls behind, its oldest events are dropped and counted, so a
slow ``kvpushctl watch`` can never hold up the event loop. Listeners (the metrics) are called
synchronously and must be cheap.

The hub also remembers the transfers it saw start, keyed by (worker id, transfer id), so that the
end event carries side, engine, peer, size and duration, and held blocks are known in O(1). It
runs on the event loop only, like the node.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from .core.types import FailureCode

log = structlog.get_logger(__name__)

DEFAULT_QUEUE = 1024
MAX_QUEUE = 65536
_ENGINE_MEMORY = 65536  # transfer id -> engine id, for log lines about transfers that already ended


class EventKind(enum.IntEnum):
    """Mirrors kvpushd.v1.EventKind; the rpc layer converts by value."""

    UNSPECIFIED = 0
    TRANSFER_STARTED = 1
    TRANSFER_FINISHED = 2
    TRANSFER_FAILED = 3
    WORKER_ATTACHED = 4
    WORKER_DETACHED = 5
    PEER_CONNECTED = 6
    PEER_LOST = 7
    DRAINING = 8


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    time: float  # wall clock
    kind: EventKind
    transfer_id: str = ""
    engine_id: str = ""
    worker_id: str = ""
    side: str = ""  # "send" (prefill publish) or "recv" (decode expect)
    peer: str = ""  # the other node's daemon, host:port
    code: FailureCode = FailureCode.UNSPECIFIED
    detail: str = ""
    num_blocks: int = 0
    nbytes: int = 0
    duration_s: float = 0.0


@dataclass(slots=True)
class OpenTransfer:
    """A worker's Publish or Expect that has not ended yet."""

    side: str
    engine_id: str
    peer: str
    num_blocks: int
    nbytes: int
    started: float  # monotonic


class Subscription:
    """One Watch stream's queue. Full: the oldest event goes, and ``dropped`` counts it."""

    def __init__(self, hub: EventHub, kinds: frozenset[EventKind], size: int) -> None:
        self.hub = hub
        self.kinds = kinds
        self.dropped = 0
        self.closed = False
        self._q: asyncio.Queue[Event | None] = asyncio.Queue(maxsize=size)

    def put(self, ev: Event | None) -> None:
        if self.closed:
            return
        if ev is None:
            self.closed = True
        if self._q.full():
            self._q.get_nowait()
            self.dropped += 1
            self.hub.dropped += 1
        self._q.put_nowait(ev)

    async def get(self) -> Event | None:
        """The next event; None once the hub closed (the daemon is stopping)."""
        return await self._q.get()

    def close(self) -> None:
        self.hub.unsubscribe(self)


class EventHub:
    def __init__(self, queue_size: int = DEFAULT_QUEUE) -> None:
        self.queue_size = queue_size
        self.emitted = 0
        self.dropped = 0
        self.open: dict[tuple[str, str], OpenTransfer] = {}
        self.held = {"send": 0, "recv": 0}  # blocks of local workers that pending transfers cover
        self._subs: set[Subscription] = set()
        self._listeners: list[Callable[[Event], None]] = []
        self._engines: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._seq = itertools.count(1)
        self._closed = False

    # -- subscribers and listeners --------------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def subscribe(self, kinds: Iterable[EventKind] = (), queue_size: int = 0) -> Subscription:
        size = min(max(queue_size or self.queue_size, 1), MAX_QUEUE)
        sub = Subscription(self, frozenset(kinds), size)
        if self._closed:
            sub.put(None)
        else:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        self._listeners.append(fn)

    def close(self) -> None:
        """End every Watch stream (the daemon is stopping)."""
        self._closed = True
        for sub in self._subs:
            sub.put(None)
        self._subs.clear()

    # -- what the node reports ------------------------------------------------------------------

    def emit(self, kind: EventKind, *, transfer_id: str = "", engine_id: str = "", worker_id: str = "",
             side: str = "", peer: str = "", code: FailureCode = FailureCode.UNSPECIFIED, detail: str = "",
             num_blocks: int = 0, nbytes: int = 0) -> Event:
        """Record and publish one event; returns it (with what the hub knew filled in)."""
        duration = 0.0
        publish = True
        if kind is EventKind.TRANSFER_STARTED:
            key = (worker_id, transfer_id)
            old = self.open.pop(key, None)
            if old is not None:  # a retried or re-submitted Expect/Publish: not a new transfer
                self.held[old.side] -= old.num_blocks
                publish = False
            self.open[key] = OpenTransfer(side, engine_id, peer, num_blocks, nbytes,
                                          old.started if old is not None else time.monotonic())
            self.held[side] = self.held.get(side, 0) + num_blocks
            self.remember(transfer_id, engine_id)
        elif kind in (EventKind.TRANSFER_FINISHED, EventKind.TRANSFER_FAILED):
            t = self.open.pop((worker_id, transfer_id), None)
            if t is not None:
                self.held[t.side] -= t.num_blocks
                side, engine_id, num_blocks, duration = t.side, t.engine_id, t.num_blocks, time.monotonic() - t.started
                peer = peer or t.peer
                nbytes = nbytes or t.nbytes
            engine_id = engine_id or self.engine_of(transfer_id)
        elif kind is EventKind.WORKER_DETACHED:
            # Its transfers end with it (the core delivers nothing to a worker that is gone).
            for key in [k for k in self.open if k[0] == worker_id]:
                self.emit(EventKind.TRANSFER_FAILED, worker_id=worker_id, transfer_id=key[1],
                          code=FailureCode.WORKER_GONE, detail=f"worker detached: {detail}")
        ev = Event(next(self._seq), time.time(), kind, transfer_id, engine_id, worker_id, side, peer, code,
                   detail, num_blocks, nbytes, duration)
        if publish:
            self._publish(ev)
        return ev

    def annotate(self, worker_id: str, transfer_id: str, *, peer: str = "", add_bytes: int = 0) -> None:
        """What the node learns of a started transfer later (prefill side: where it writes to)."""
        t = self.open.get((worker_id, transfer_id))
        if t is not None:
            t.peer = peer or t.peer
            t.nbytes += add_bytes

    def remember(self, transfer_id: str, engine_id: str) -> None:
        """Which local engine a transfer id belongs to, kept for a while after the transfer ends."""
        if not engine_id:
            return
        self._engines[transfer_id] = engine_id
        self._engines.move_to_end(transfer_id)
        if len(self._engines) > _ENGINE_MEMORY:
            self._engines.popitem(last=False)

    def engine_of(self, transfer_id: str) -> str:
        return self._engines.get(transfer_id, "")

    def _publish(self, ev: Event) -> None:
        self.emitted += 1
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:  # a listener's bug must not break the transfer path
                log.exception("event listener failed", event_kind=ev.kind.name, transfer_id=ev.transfer_id,
                              engine_id=ev.engine_id)
        for sub in self._subs:
            if not sub.kinds or ev.kind in sub.kinds:
                sub.put(ev)

