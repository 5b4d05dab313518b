"""One observation stream: typed records of what happened, emitted once where it happened.

The runtime emits a record at the point something happens (a transfer started, the rendezvous met,
a WRITE or READ done, a completion delivered, a peer heard from or lost, an event dropped); whoever
keeps books of it (the counters, the event hub for ``kvpushctl watch``, the figures completions
carry, the Prometheus metrics, tracing, the peer book) registers for the records it wants in the
composition root (app.py). A record with no sink costs one dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..core.types import Completion
from ..transfer.records import ReadResult, WriteResult

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Started:
    """A worker's Publish (side "send") or Expect ("recv") was taken."""

    worker_id: str
    transfer_id: str
    engine_id: str
    side: str
    num_blocks: int
    nbytes: int = 0  # recv: what the worker's blocks hold
    peer: str = ""
    traceparent: str = ""


@dataclass(frozen=True, slots=True)
class Met:
    """Prefill side: the second of publish and registration arrived ``waited_s`` after the first."""

    worker_id: str
    transfer_id: str
    waited_s: float
    peer: str


@dataclass(frozen=True, slots=True)
class WriteDone:
    result: WriteResult
    transfer_id: str
    worker_id: str  # the producer worker ("" if unknown)
    peer: str  # the decode daemon written to ("" if unknown)


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Pull mode, decode side: a READ this daemon posted completed or failed."""

    result: ReadResult
    transfer_id: str
    worker_id: str


@dataclass(frozen=True, slots=True)
class Notified:
    """A WRITE notification landed (decode side)."""


@dataclass(frozen=True, slots=True)
class Delivered:
    """A transfer's completion (with its figures) goes to its worker."""

    worker_id: str
    side: str
    completion: Completion


@dataclass(frozen=True, slots=True)
class Dropped:
    """The core dropped a late or repeated event on purpose."""

    event: str
    transfer_id: str
    why: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A peer call refused by a limit, or by a registration another daemon holds."""


@dataclass(frozen=True, slots=True)
class Declined:
    """A transfer declined: ``sent`` to a prefill daemon (acknowledged), or received from a decode one."""

    sent: bool


@dataclass(frozen=True, slots=True)
class PeerHeard:
    """A call to (or, ``inbound``, from) a peer went through."""

    address: str
    node_id: str = ""
    inbound: bool = False


@dataclass(frozen=True, slots=True)
class PeerFailed:
    """A call to a peer failed, or a WRITE to it."""

    address: str
    error: str
    unreachable: bool = False


@dataclass(frozen=True, slots=True)
class PeerLost:
    address: str
    reason: str
    inbound: bool = False


@dataclass(frozen=True, slots=True)
class RegisterAnswered:
    """Decode side: the Register sent at ``started_ns`` (time.time_ns) was answered ("" error) or failed."""

    worker_id: str
    transfer_id: str
    started_ns: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class RegistrationTraced:
    """Prefill side: a decode daemon's Register came with its span's context."""

    transfer_id: str
    traceparent: str


@dataclass(frozen=True, slots=True)
class WorkerGone:
    worker_id: str


class Observations:
    """The stream: sinks register per record type, in the order they are to see it."""

    def __init__(self) -> None:
        self._sinks: dict[type, list[Callable[[Any], None]]] = {}

    def on(self, kind: type[R], fn: Callable[[R], None]) -> None:
        self._sinks.setdefault(kind, []).append(fn)

    def emit(self, rec: object) -> None:
        for fn in self._sinks.get(type(rec), ()):
            fn(rec)
