"""One observation stream: typed records of what happened, emitted once where it happened.

What a transfer is doing is its ledger's (core/ledger.py), not this stream's: the stream carries
what is not a transfer's own book (a transfer ended, with its ledger; a WRITE failed; a peer heard
from, failed or lost; an event dropped; a counter no record tells). Whoever keeps books of it (the
status counters, the event hub for ``kvpushctl watch``, the peer book, the Prometheus metrics,
tracing) registers for the records it wants in the composition root (app.py); tracing reads only
the end, and makes a transfer's spans from its ledger. Records are slotted dataclasses,
not frozen ones: sinks read them and never change them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.ledger import Ledger
from ..core.types import Completion
from ..transfer.records import WriteResult

R = TypeVar("R")


@dataclass(slots=True)
class WriteDone:  # a WRITE failed (worker, peer: "" if unknown); a completed one is its ledger's
    result: WriteResult
    transfer_id: str
    worker_id: str
    peer: str


@dataclass(slots=True)
class Ended:  # a transfer's completion (with its figures) goes to its worker, or its worker is gone
    completion: Completion
    ledger: Ledger


@dataclass(slots=True)
class Counted:  # ``n`` more of a status counter no other record tells (a field of runtime/tally.Counters)
    name: str
    n: int = 1


@dataclass(slots=True)
class PeerHeard:  # a call to (or, ``inbound``, from) a peer went through
    address: str
    node_id: str = ""
    inbound: bool = False


@dataclass(slots=True)
class PeerFailed:  # a call to a peer failed, or a WRITE to it
    address: str
    error: str
    unreachable: bool = False


@dataclass(slots=True)
class PeerLost:
    address: str
    reason: str
    inbound: bool = False


class Observations:
    """The stream: sinks register per record type, in the order they are to see it."""

    def __init__(self) -> None:
        self._sinks: dict[type, list[Callable[[Any], None]]] = {}

    def on(self, kind: type[R], fn: Callable[[R], None]) -> None:
        self._sinks.setdefault(kind, []).append(fn)

    def emit(self, rec: object) -> None:
        for fn in self._sinks.get(type(rec), ()):
            fn(rec)
