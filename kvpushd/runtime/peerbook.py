"""What the daemon knows about each other daemon, by peer address, whichever way the calls go.

Kept for the status API (peers: contact, bytes, transfers, errors) and fed by the observation
stream (``observe``: a transfer's ledger when it ends, peers heard from or lost). Entries are
pruned with their peer and the table is capped, so a flood of handshakes from made-up addresses
cannot grow the status answer without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core.ledger import Ledger
from ..events import EventHub, EventKind
from .observe import Observations, PeerFailed, PeerHeard, PeerLost, WriteDone

MAX_PEER_STATS = 1024  # entries kept; the ones with the oldest contact and no live peer go first
PRUNE_TO = MAX_PEER_STATS * 3 // 4  # a full book drops to this at once (with 10,000 live peers, pruning one
                                    # entry per new contact went through every session each time)


@dataclass(slots=True)
class PeerStats:
    address: str
    node_id: str = ""
    out_connected: bool = False  # our calls to it succeed
    in_connected: bool = False   # it handshook with us
    last_contact: float = 0.0    # wall clock
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_finished: int = 0
    transfers_failed: int = 0
    errors: int = 0
    last_error: str = ""


class PeerBook:
    def __init__(self, events: EventHub, live: Callable[[], set[str]] = set) -> None:
        self.events = events
        self.peers: dict[str, PeerStats] = {}
        self._live = live  # addresses with a session or a channel: never pruned

    def observe(self, obs: Observations) -> None:
        obs.on(WriteDone, lambda r: self.failed(r.peer, f"WRITE for transfer {r.transfer_id!r} failed: "
                                                          f"{r.result.reason}"))
        obs.on(PeerHeard, lambda r: self.contact(r.address, node_id=r.node_id, inbound=r.inbound))
        obs.on(PeerFailed, lambda r: self.failed(r.address, r.error, unreachable=r.unreachable))
        obs.on(PeerLost, lambda r: self.lost(r.address, r.reason, inbound=r.inbound))

    def contact(self, address: str, *, node_id: str = "", inbound: bool = False) -> None:
        """A call to (or, ``inbound``, from) a peer went through."""
        if not address:
            return
        p = self._peer(address)
        p.node_id = node_id or p.node_id
        p.last_contact = time.time()
        if inbound and not p.in_connected:
            p.in_connected = True
            self.events.emit(EventKind.PEER_CONNECTED, peer=address, detail=f"inbound: {p.node_id}")
        elif not inbound and not p.out_connected:
            p.out_connected = True
            self.events.emit(EventKind.PEER_CONNECTED, peer=address, detail=f"outbound: {p.node_id}")

    def failed(self, address: str, error: str, *, unreachable: bool = False) -> None:
        """A call to a peer failed, or a WRITE to it; an unreachable peer that was connected is lost."""
        if not address:
            return
        p = self._peer(address)
        p.errors += 1
        p.last_error = error
        if unreachable and p.out_connected:
            self.lost(address, error)

    def lost(self, address: str, reason: str, *, inbound: bool = False) -> None:
        """A peer went away (unreachable, or restarted as a new instance)."""
        p = self._peer(address)
        if inbound:
            p.in_connected = False
        else:
            p.out_connected = False
        self.events.emit(EventKind.PEER_LOST, peer=address, detail=f"{'inbound' if inbound else 'outbound'}: {reason}")

    def ended(self, led: Ledger, failed: bool) -> None:
        """A transfer with this peer ended: what it moved (either way), and how it ended."""
        if not led.peer:
            return
        p = self._peer(led.peer)
        if led.side == "send":
            p.bytes_sent += led.nbytes
        if failed:
            p.transfers_failed += 1
            return
        p.transfers_finished += 1
        if led.side == "recv":
            p.bytes_received += led.received_bytes

    def forget_idle(self, wall: float, idle_s: float) -> None:
        """Peers with no session or channel, not heard from for ``idle_s``, are forgotten."""
        live = self._live()
        for address in [a for a, p in self.peers.items() if a not in live and wall - p.last_contact > idle_s]:
            self.peers.pop(address, None)

    def _peer(self, address: str) -> PeerStats:
        p = self.peers.get(address)
        if p is None:
            if len(self.peers) >= MAX_PEER_STATS:
                self._prune()
            p = self.peers[address] = PeerStats(address)
        return p

    def _prune(self) -> None:
        live = self._live()
        gone = sorted((p.last_contact, a) for a, p in self.peers.items() if a not in live)
        for _, a in gone[:max(1, len(self.peers) - PRUNE_TO)]:
            del self.peers[a]
        if len(self.peers) > PRUNE_TO:  # mostly live: drop the oldest contacts anyway
            for _, a in sorted((p.last_contact, a) for a, p in self.peers.items())[:len(self.peers) - PRUNE_TO]:
                del self.peers[a]
