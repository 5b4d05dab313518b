"""The books kept of the observation stream (observe.py): each sink says which records it reads.

A transfer's own figures are its ledger's (core/ledger.py); what ends here is the transfer
(``Ended``, with its ledger), a peer heard from or lost, an event dropped, a counter no record
tells. app.py registers the sinks; the Prometheus metrics register themselves (``Metrics.observe``).
"""

from __future__ import annotations

import structlog

from ..events import EventHub
from ..tracing import Tracing
from .observe import Ended, Observations, PeerFailed, PeerHeard, PeerLost, WriteDone
from .peerbook import PeerBook

log = structlog.get_logger(__name__)


def events_sink(obs: Observations, hub: EventHub) -> None:
    """A transfer's end, for Watch streams (its start goes to the hub from the node)."""
    obs.on(Ended, hub.ended)


def peerbook_sink(obs: Observations, book: PeerBook) -> None:
    def wrote(r: WriteDone) -> None:
        if not r.result.ok:
            book.failed(r.peer, f"WRITE for transfer {r.transfer_id!r} failed: {r.result.reason}")

    obs.on(WriteDone, wrote)
    obs.on(PeerHeard, lambda r: book.contact(r.address, node_id=r.node_id, inbound=r.inbound))
    obs.on(PeerFailed, lambda r: book.failed(r.address, r.error, unreachable=r.unreachable))
    obs.on(PeerLost, lambda r: book.lost(r.address, r.reason, inbound=r.inbound))


def tracing_sink(obs: Observations, t: Tracing) -> None:
    """Spans per transfer, made from its ledger when it ends (registered only when tracing is on)."""
    obs.on(Ended, lambda r: t.ended(r.completion, r.ledger))
