"""Plain-value inputs for the core."""

from __future__ import annotations

from dataclasses import dataclass

from kvpushd.core.actions import LegKey
from kvpushd.core.layout import Shape
from kvpushd.core.recv import RecvSide
from kvpushd.core.send import SendSide
from kvpushd.core.sendstate import LegState, PubState, RegState


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """A WorkerInfo of plain values (tests feed the core with it)."""

    worker_id: str
    engine_id: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    regions: tuple[Shape, ...] = ()
    block_bytes: int = 0


# Questions only the tests ask of the core's sides, read from their records.


def publish_state(s: SendSide, engine_id: str, transfer_id: str, rank: int) -> PubState | None:
    pub = s._publish(engine_id, transfer_id, rank)
    return pub.state if pub is not None else None


def registration_state(s: SendSide, origin: str, registration_id: int) -> RegState | None:
    return RegState.HELD if s.transfer_of(origin, registration_id) is not None else None


def leg_state(s: SendSide, leg: LegKey) -> LegState | None:
    pub = s._publish(leg.engine_id, leg.transfer_id, leg.producer_rank)
    return pub.legs.get(leg.registration_id) if pub is not None else None


def receive_of(r: RecvSide, registration_id: int) -> tuple[str, str] | None:
    """(worker id, transfer id) of a pending registration, or None."""
    rec = r._by_reg.get(registration_id)
    return (rec.worker_id, rec.transfer_id) if rec else None


def deferred(r: RecvSide) -> set[int]:
    """Registrations whose FAILED waits for the answer to their withdrawal."""
    return set(r._ending)
