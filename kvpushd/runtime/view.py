"""A read-only view of the daemon for the status API and the metrics: nothing here changes state.

rpc/status.py and metrics.py read only through this, so the rooms' internals can change without
them; what they get are plain values and the core's own view records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..config import Config
from ..core.recv import RecvSide, RecvView
from ..core.send import SendSide
from ..core.sendstate import SendView
from ..events import EventHub
from ..transfer.backends import AgentBackend
from .identity import Identity
from .peerbook import PeerBook
from .peercalls import PeerCalls
from .tally import Counters, Tally
from .workers import Worker, Workers


@dataclass(frozen=True, slots=True)
class PeerView:
    """One other daemon as status shows it, by peer address, whichever way the calls go."""

    address: str
    direction: str = ""  # outbound, inbound, both, or "" (known from figures only)
    node_id: str = ""
    instance_id: str = ""
    state: str = ""
    since_s: float = 0.0
    channel_state: str = ""
    last_contact_unix: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_finished: int = 0
    transfers_failed: int = 0
    errors: int = 0
    last_error: str = ""
    streams_opened: int = 0  # the peer Channel (status.proto PeerStatus says which way)
    stream_batches_sent: int = 0
    stream_items_pending: int = 0
    inbound_streams: int = 0
    stream_batches_received: int = 0
    identity: str = ""  # inbound: whom its quotas count under


@dataclass(frozen=True, slots=True)
class IdentityView:
    """One caller identity of the peer API and what its sessions hold here (the per-peer quotas)."""

    identity: str
    sessions: int
    registrations: int
    blocks: int
    refused: int


class View:
    """Reads the rooms it is given; the configuration, identity (node id, instance id, version, addresses)
    and event hub are the workers' room's (the same objects the node gave every room)."""

    def __init__(self, workers: Workers, send: SendSide, recv: RecvSide, peers: PeerCalls, tally: Tally,
                 peerbook: PeerBook, is_draining: Callable[[], bool]) -> None:
        self.cfg: Config = workers.cfg
        self.events: EventHub = workers.events
        self.ident: Identity = workers.ident
        self._workers, self._send, self._recv, self._peers = workers, send, recv, peers
        self.tally = tally  # its Prometheus series (metrics.py)
        self._peerbook, self._is_draining = peerbook, is_draining

    # -- identity and settings ------------------------------------------------------------------

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.ident.started

    @property
    def draining(self) -> bool:
        return self._is_draining()

    # -- figures --------------------------------------------------------------------------------

    @property
    def counters(self) -> Counters:
        return replace(self.tally.counters)

    @property
    def stray_notifications(self) -> int:
        xfer = self._workers.xfer
        return self._recv.stray_notifications + (xfer.stray_notifications if xfer else 0)

    def held_blocks(self) -> dict[str, int]:
        """Blocks of local workers that pending transfers cover, by side ("send", "recv")."""
        return {"send": self._send.held_blocks(), "recv": self._recv.held_blocks()}

    def pending(self) -> tuple[int, int]:
        """Transfers pending: (send side, recv side)."""
        return len(self._send), len(self._recv)

    def fd_socket(self) -> tuple[int, int]:
        """The fd socket: descriptors waiting for their Attach, and those dropped (malformed, evicted, expired)."""
        fds = self._workers.fds
        return fds.parked, fds.dropped

    def recent_failures(self) -> list[tuple[float, str, str]]:
        return list(self.tally.recent_failures)

    # -- workers and transfers ------------------------------------------------------------------

    def workers(self) -> Iterator[Worker]:
        return iter(list(self._workers.by_id.values()))

    def worker(self, worker_id: str) -> Worker | None:
        return self._workers.by_id.get(worker_id)

    def agent_backends(self, worker_id: str) -> tuple[AgentBackend, ...]:
        xfer = self._workers.xfer
        return xfer.agent_backends(worker_id) if xfer is not None else ()

    def send_transfers(self) -> list[SendView]:
        return self._send.views(time.monotonic())

    def recv_transfers(self) -> list[RecvView]:
        return self._recv.views(time.monotonic())

    # -- peers ----------------------------------------------------------------------------------

    def peer_links(self) -> tuple[int, int, int, int]:
        """(handshakes in flight, handshakes waiting, outbound peers connected, inbound sessions)."""
        out = self._peers.outbound
        return out.gate.in_flight, out.gate.waiting, out.connected(), len(self._peers.inbound.origins)

    def peers(self) -> list[PeerView]:
        """Every other daemon we call (outbound) or that calls us (inbound), by its peer address."""
        wall = time.time()
        loop_now = asyncio.get_running_loop().time()
        mono_now = time.monotonic()
        peers = self._peers.outbound.peers
        inbound = {o.address: o for o in self._peers.inbound.origins.values()}
        out = []
        for addr in sorted(set(peers) | set(inbound) | set(self._peerbook.peers)):
            client = peers.get(addr)
            origin = inbound.get(addr)
            stats = self._peerbook.peers.get(addr)
            direction = "both" if client and origin else "outbound" if client else "inbound" if origin else ""
            # Last contact either way: calls, and heartbeats (answered by it, or received from it).
            contact = stats.last_contact if stats is not None else 0.0
            if client is not None and client.link.last_ok:
                contact = max(contact, wall - (loop_now - client.link.last_ok))
            if origin is not None:
                contact = max(contact, wall - (mono_now - origin.last_seen))
            p = PeerView(addr, direction, last_contact_unix=contact)
            if stats is not None:
                p = replace(p, node_id=stats.node_id, bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
                            transfers_finished=stats.transfers_finished, transfers_failed=stats.transfers_failed,
                            errors=stats.errors, last_error=stats.last_error)
            if origin is not None:
                p = replace(p, node_id=p.node_id or origin.node_id, instance_id=origin.instance_id, state="connected",
                            inbound_streams=origin.streams, stream_batches_received=origin.stream_batches,
                            identity=origin.identity)
            if client is not None:
                p = replace(p, node_id=client.remote_node_id or p.node_id,
                            instance_id=client.remote_instance or p.instance_id, state=client.link.state.value,
                            since_s=loop_now - client.link.since if client.link.since else 0.0,
                            last_error=client.link.last_error or p.last_error,
                            channel_state=client.channel.get_state(try_to_connect=False).name)
                opened, sent, pending = client.stream_counts()
                p = replace(p, streams_opened=opened, stream_batches_sent=sent, stream_items_pending=pending)
            elif origin is None:
                p = replace(p, state="lost")
            out.append(p)
        return out

    def peer_identities(self) -> list[IdentityView]:
        """Each identity with a session here and what its sessions hold, summed as the quotas sum them."""
        inbound, send = self._peers.inbound, self._send
        out = []
        for identity, instances in list(inbound.identities.items()):
            regs = blocks = refused = 0
            for i in instances:
                r, b = send.held_by(i)
                origin = inbound.origins.get(i)
                regs, blocks, refused = regs + r, blocks + b, refused + (origin.refused if origin else 0)
            out.append(IdentityView(identity, len(instances), regs, blocks, refused))
        return out
