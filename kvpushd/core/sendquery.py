"""What the status API, the runtime and the tests ask of the prefill side (send.py), read-only."""

from __future__ import annotations

from .actions import LegKey
from .deadlines import Deadlines
from .sendstate import LegState, PubState, PullLease, RegState, SendDeadline, SendTransfer, SendView, view_of


class SendQueries:
    """The prefill side's tables and the questions asked of them (SendSide changes them)."""

    _transfers: dict[tuple[str, str], SendTransfer]
    _by_reg: dict[tuple[str, int], tuple[str, str]]
    _deadlines: Deadlines[SendDeadline]
    _pulls: dict[PullLease, LegKey]
    _held: dict[str, int]
    _regs: dict[str, int]

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._transfers)

    def next_deadline(self) -> float | None:
        return self._deadlines.next()

    def origins(self) -> set[str]:
        """Decode daemons that hold registrations here, or owe us a READ (they must keep sending heartbeats)."""
        return {r.origin for t in self._transfers.values() for r in t.registrations.values()} | {
            pk.origin for pk in self._pulls}

    def holds(self, origin: str) -> bool:
        """Whether ``origin`` is one of ``origins()``, without going through every transfer (a handshake
        asks it: with 10,000 decode daemons registered, the whole set per handshake cost O(N) each)."""
        return origin in self._regs or any(pk.origin == origin for pk in self._pulls)

    def held_by(self, origin: str) -> tuple[int, int]:
        """(registrations, destination blocks) the decode daemon ``origin`` holds here."""
        return self._regs.get(origin, 0), self._held.get(origin, 0)

    def pull_pending(self, origin: str, registration_id: int, producer_rank: int) -> bool:
        """Whether that pull leg is still offered (not confirmed, failed or given up on)."""
        return PullLease(origin, registration_id, producer_rank) in self._pulls

    def pulling(self) -> int:
        """Pull legs offered whose READ is not settled (the runtime polls READ notifications meanwhile)."""
        return len(self._pulls)

    def transfer_of(self, origin: str, registration_id: int) -> tuple[str, str] | None:
        """Key of the transfer a registration belongs to (None: unknown here)."""
        return self._by_reg.get((origin, registration_id))

    def writing_into(self, key: tuple[str, str], registration_id: int) -> bool:
        """A WRITE into this registration's blocks is still in flight (even after it was withdrawn)."""
        t = self._transfers.get(key)
        return t is not None and any(p.legs.get(registration_id) is LegState.POSTED for p in t.publishes.values())

    def agents_in_use(self, origin: str) -> set[str]:
        """Consumer agents that registrations from ``origin`` pending here refer to."""
        return {r.consumer_agent for t in self._transfers.values() for r in t.registrations.values()
                if r.origin == origin}

    def has_publish(self, engine_id: str, transfer_id: str, rank: int) -> bool:
        return self.publish_state(engine_id, transfer_id, rank) is not None

    def publish_state(self, engine_id: str, transfer_id: str, rank: int) -> PubState | None:
        t = self._transfers.get((engine_id, transfer_id))
        pub = t.publishes.get(rank) if t is not None else None
        return pub.state if pub is not None else None

    def registration_state(self, origin: str, registration_id: int) -> RegState | None:
        key = self._by_reg.get((origin, registration_id))
        return RegState.HELD if key is not None else None

    def leg_state(self, leg: LegKey) -> LegState | None:
        t = self._transfers.get((leg.engine_id, leg.transfer_id))
        pub = t.publishes.get(leg.producer_rank) if t is not None else None
        return pub.legs.get(leg.registration_id) if pub is not None else None

    def views(self, now: float) -> list[SendView]:
        return [view_of(t, now) for t in self._transfers.values()]
