"""The books kept of the observation stream (observe.py): each sink says which records it reads.

app.py registers them; what each book sees is what the runtime used to hand it directly. The
Prometheus metrics register themselves (``Metrics.observe``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import structlog

from ..core.types import CompletionKind
from ..events import EventHub, EventKind
from ..tracing import Tracing
from .figures import FigureBook
from .observe import (
    Counted,
    Delivered,
    Dropped,
    Met,
    Observations,
    PeerFailed,
    PeerHeard,
    PeerLost,
    ReadDone,
    RegisterAnswered,
    RegistrationTraced,
    Started,
    WorkerGone,
    WriteDone,
)
from .peerbook import PeerBook

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Counters:
    transfers_finished: int = 0
    transfers_failed: int = 0
    bytes_written: int = 0
    writes_posted: int = 0
    notifications_received: int = 0
    descriptors_requested: int = 0
    descriptors_posted: int = 0
    reads_posted: int = 0  # pull mode: READs this (decode) daemon posted that completed
    bytes_read: int = 0
    late_events: int = 0   # events the core dropped on purpose (late or repeated)
    peer_calls_refused: int = 0  # peer calls refused by a limit or a registration held by another daemon
    declines_sent: int = 0  # decode side: transfers declined to their prefill daemon (acknowledged)
    declines_received: int = 0  # prefill side: transfers a decode daemon declined


class Tally:
    """The status API's counters and its last failures."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.recent_failures: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=100)

    def observe(self, obs: Observations) -> None:
        obs.on(WriteDone, self._moved)
        obs.on(ReadDone, self._moved)
        obs.on(Delivered, self._delivered)
        obs.on(Dropped, self._dropped)
        obs.on(Counted, self._counted)

    def _moved(self, rec: WriteDone | ReadDone) -> None:
        r, c = rec.result, self.counters
        if not r.ok:
            return
        if isinstance(rec, WriteDone):
            c.writes_posted += 1
            c.bytes_written += r.nbytes
        else:
            c.reads_posted += 1
            c.bytes_read += r.nbytes
        c.descriptors_requested += r.descs_requested
        c.descriptors_posted += r.descs_posted

    def _delivered(self, rec: Delivered) -> None:
        c = rec.completion
        if c.kind is CompletionKind.FAILED:
            self.counters.transfers_failed += 1
            self.recent_failures.append((time.time(), c.transfer_id, f"{c.code.name}: {c.reason}"))
        else:
            self.counters.transfers_finished += 1

    def _dropped(self, rec: Dropped) -> None:
        self.counters.late_events += 1

    def _counted(self, rec: Counted) -> None:
        setattr(self.counters, rec.name, getattr(self.counters, rec.name) + rec.n)


def events_sink(obs: Observations, hub: EventHub) -> None:
    """Transfers start, learn their peer and bytes, and end: for Watch streams and the hub's listeners."""

    def started(r: Started) -> None:
        hub.emit(EventKind.TRANSFER_STARTED, transfer_id=r.transfer_id, engine_id=r.engine_id,
                 worker_id=r.worker_id, side=r.side, peer=r.peer, num_blocks=r.num_blocks, nbytes=r.nbytes)

    def delivered(r: Delivered) -> None:
        c = r.completion
        failed = c.kind is CompletionKind.FAILED
        ev = hub.emit(EventKind.TRANSFER_FAILED if failed else EventKind.TRANSFER_FINISHED, worker_id=r.worker_id,
                      transfer_id=c.transfer_id, code=c.code, detail=c.reason)
        if failed:
            log.warning("transfer failed", transfer_id=c.transfer_id, engine_id=ev.engine_id, worker_id=r.worker_id,
                        code=c.code.name, reason=c.reason)

    def wrote(r: WriteDone) -> None:
        if r.result.ok:
            hub.annotate(r.worker_id, r.transfer_id, add_bytes=r.result.nbytes)

    obs.on(Started, started)
    obs.on(Met, lambda r: hub.annotate(r.worker_id, r.transfer_id, peer=r.peer))
    obs.on(WriteDone, wrote)
    obs.on(Delivered, delivered)


def figures_sink(obs: Observations, book: FigureBook) -> None:
    """What the completions carry (``FigureBook.settle`` reads it back at delivery)."""

    def moved(worker_id: str, r: WriteDone | ReadDone) -> None:
        x = r.result
        if x.ok:
            book.moved(worker_id, r.transfer_id, x.nbytes, x.descs_posted, x.post_s, x.xfer_s)

    obs.on(Started, lambda r: book.started(r.worker_id, r.transfer_id, r.side, r.nbytes))
    obs.on(Met, lambda r: book.waited(r.worker_id, r.transfer_id, r.waited_s))
    obs.on(WriteDone, lambda r: moved(r.worker_id, r))
    obs.on(ReadDone, lambda r: moved(r.worker_id, r))
    obs.on(WorkerGone, lambda r: book.forget_worker(r.worker_id))


def peerbook_sink(obs: Observations, book: PeerBook) -> None:
    def wrote(r: WriteDone) -> None:
        x = r.result
        if x.ok:
            book.sent(r.peer, x.nbytes)
        else:
            book.failed(r.peer, f"WRITE for transfer {r.transfer_id!r} failed: {x.reason}")

    obs.on(WriteDone, wrote)
    obs.on(PeerHeard, lambda r: book.contact(r.address, node_id=r.node_id, inbound=r.inbound))
    obs.on(PeerFailed, lambda r: book.failed(r.address, r.error, unreachable=r.unreachable))
    obs.on(PeerLost, lambda r: book.lost(r.address, r.reason, inbound=r.inbound))


def tracing_sink(obs: Observations, t: Tracing) -> None:
    """Spans per transfer (registered only when tracing is on: off, no record reaches it)."""

    def started(r: Started) -> None:
        if r.side == "recv":
            t.expect(r.worker_id, r.transfer_id, r.traceparent, r.engine_id, r.peer)
        else:
            t.publish(r.worker_id, r.transfer_id, r.traceparent, r.engine_id)

    def nixl(worker_id: str, read: bool, r: WriteDone | ReadDone) -> None:
        t.nixl_done(worker_id, r.transfer_id, read, r.result)

    obs.on(Started, started)
    obs.on(RegistrationTraced, lambda r: t.registration(r.transfer_id, r.traceparent))
    obs.on(Met, lambda r: t.rendezvous(r.worker_id, r.transfer_id, r.waited_s, r.peer))
    obs.on(WriteDone, lambda r: nixl(r.worker_id, False, r))
    obs.on(ReadDone, lambda r: nixl(r.worker_id, True, r))
    obs.on(RegisterAnswered, lambda r: t.registered(r.worker_id, r.transfer_id, r.started_ns, r.error))
    obs.on(Delivered, lambda r: t.delivered(r.worker_id, r.side, r.completion))
    obs.on(WorkerGone, lambda r: t.forget_worker(r.worker_id))
