"""The event hub: what happens in the daemon, for Watch streams.

A transfer starts or ends (its event is read off the transfer's ledger, core/ledger.py), a worker
attaches or detaches, a peer connects or is lost, the daemon drains. Every Watch subscriber has
its own bounded queue; when a reader falls behind, its oldest events are dropped and counted, so a
slow ``kvpushctl watch`` can never hold up the event loop. The hub keeps no book of transfers:
their ledgers are theirs. It runs on the event loop only, like the node.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from .core.ledger import Ledger
from .core.types import CompletionKind, FailureCode

if TYPE_CHECKING:
    from .runtime.observe import Ended

log = structlog.get_logger(__name__)

DEFAULT_QUEUE = 1024
MAX_QUEUE = 65536


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
    def __init__(self) -> None:
        self.emitted = 0
        self.dropped = 0
        self._subs: set[Subscription] = set()
        self._seq = itertools.count(1)
        self._closed = False

    # -- subscribers ----------------------------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def subscribe(self, kinds: Iterable[EventKind] = (), queue_size: int = 0) -> Subscription:
        size = min(max(queue_size or DEFAULT_QUEUE, 1), MAX_QUEUE)
        sub = Subscription(self, frozenset(kinds), size)
        if self._closed:
            sub.put(None)
        else:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def close(self) -> None:
        """End every Watch stream (the daemon is stopping)."""
        self._closed = True
        for sub in self._subs:
            sub.put(None)
        self._subs.clear()

    # -- what the node reports ------------------------------------------------------------------

    def transfer(self, kind: EventKind, led: Ledger, code: FailureCode = FailureCode.UNSPECIFIED,
                 detail: str = "") -> None:
        """A transfer started, finished or failed: its event, read off its ledger."""
        if not self._subs:
            self.emitted += 1
            return
        self._publish(Event(next(self._seq), time.time(), kind, led.transfer_id, led.engine_id, led.worker_id, led.side,
                            led.peer, code, detail, led.num_blocks, led.received_bytes, led.duration_s))

    def ended(self, r: Ended) -> None:
        """A sink of the observation stream: a transfer finished or failed (a failure is logged too)."""
        c = r.completion
        if c.kind is not CompletionKind.FAILED:
            self.transfer(EventKind.TRANSFER_FINISHED, r.ledger)
            return
        self.transfer(EventKind.TRANSFER_FAILED, r.ledger, c.code, c.reason)
        if c.code is not FailureCode.WORKER_GONE:
            log.warning("transfer failed", transfer_id=c.transfer_id, engine_id=r.ledger.engine_id,
                        worker_id=r.ledger.worker_id, code=c.code.name, reason=c.reason)

    def emit(self, kind: EventKind, *, worker_id: str = "", engine_id: str = "", peer: str = "",
             detail: str = "") -> None:
        """A worker attached or detached, a peer connected or was lost, the daemon drains."""
        self._publish(Event(next(self._seq), time.time(), kind, worker_id=worker_id, engine_id=engine_id, peer=peer,
                            detail=detail))

    def _publish(self, ev: Event) -> None:
        self.emitted += 1
        for sub in self._subs:
            if not sub.kinds or ev.kind in sub.kinds:
                sub.put(ev)
