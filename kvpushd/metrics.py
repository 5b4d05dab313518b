"""Prometheus metrics over HTTP, and what the daemon knows about each peer.

Counters that the node keeps anyway (notifications, pending transfers, held blocks) are read at
scrape time by a collector; what needs labels (outcome and code, direction and peer) or timing
(histograms) is recorded through a few hooks the node calls and through the event hub. The
registry belongs to this object, not to the process, so several nodes never collide.

The HTTP endpoint runs in prometheus-client's own thread: everything it reads is a plain int or
a prometheus-client metric (both safe to read from another thread). A metrics port that cannot be
bound is logged and left out; it does not stop the data path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .config import MetricsConfig, split_host_port
from .core.rendezvous import StartWrite
from .events import Event, EventKind
from .transfer.thread import WriteResult

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .core.rendezvous import LegKey
    from .node import Node

log = structlog.get_logger(__name__)

# From tens of microseconds (posting a prepared WRITE) to the rendezvous timeouts (minutes).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class PeerStats:
    """One other daemon, by its peer address, whichever way the calls go."""

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


class Metrics:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.peers: dict[str, PeerStats] = {}
        self.address = ""  # host:port once serving
        self._server: WSGIServer | None = None
        self._legs: dict[LegKey, tuple[str, str]] = {}  # WRITE in flight -> (peer address, worker id)
        r = self.registry = CollectorRegistry()
        Info("kvpushd", "kvpushd build and identity", registry=r).info(
            {"version": node.version(), "node_id": node.node_id, "instance_id": node.instance_id})
        self.transfers = Counter(
            "kvpushd_transfers", "Publishes (send) and Expects (recv) ended on this node, by outcome and "
            "failure code", ["side", "outcome", "code"], registry=r)
        self.duration = Histogram(
            "kvpushd_transfer_duration_seconds", "Publish or Expect taken -> completion delivered",
            ["side"], buckets=LATENCY_BUCKETS, registry=r)
        self.bytes = Counter(
            "kvpushd_bytes", "KV bytes moved by NIXL WRITEs: sent (this node wrote them) or received (they "
            "landed in this node's workers), by the other node's daemon", ["direction", "peer"], registry=r)
        self.writes = Counter("kvpushd_writes", "WRITEs completed, by outcome", ["outcome"], registry=r)
        self.descriptors = Counter(
            "kvpushd_descriptors", "Descriptors of completed WRITEs: requested (one per region and block) "
            "and posted (after merging blocks adjacent on both sides)", ["stage"], registry=r)
        self.rendezvous_wait = Histogram(
            "kvpushd_rendezvous_wait_seconds", "Prefill side: first arrival (publish or decode registration) "
            "-> the second arrival that starts the WRITE", buckets=LATENCY_BUCKETS, registry=r)
        self.post_time = Histogram(
            "kvpushd_write_post_seconds", "WRITE request reaching the NIXL thread -> WRITE posted",
            buckets=LATENCY_BUCKETS, registry=r)
        self.xfer_time = Histogram(
            "kvpushd_write_seconds", "WRITE posted -> its completion seen", buckets=LATENCY_BUCKETS, registry=r)
        for stage in ("requested", "posted"):
            self.descriptors.labels(stage)
        for outcome in ("ok", "error"):
            self.writes.labels(outcome)
        r.register(_StateCollector(node))
        node.events.add_listener(self._on_event)

    # -- the HTTP endpoint ----------------------------------------------------------------------

    def serve(self, cfg: MetricsConfig) -> None:
        if not cfg.enabled:
            return
        host, port = split_host_port(cfg.listen)
        try:
            self._server, _ = start_http_server(port, host or "0.0.0.0", registry=self.registry)
        except OSError as e:
            log.error("metrics endpoint could not listen; serving without it", listen=cfg.listen, error=str(e))
            return
        bound = self._server.server_address[1]
        self.address = f"{host or '0.0.0.0'}:{bound}"
        log.info("metrics endpoint listening", address=self.address)

    def stop(self) -> None:
        """Close the endpoint (blocks up to half a second: call it off the event loop)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- hooks the node calls -------------------------------------------------------------------

    def write_started(self, a: StartWrite) -> None:
        origin = self.node.origins.get(a.registration.origin)
        peer = origin.address if origin is not None else ""
        self._legs[a.leg] = (peer, a.producer_worker)
        self.node.events.annotate(a.producer_worker, a.leg.transfer_id, peer=peer)
        # The core keeps when a transfer's first piece arrived; StartWrite comes at the second.
        t = self.node.send._transfers.get((a.leg.engine_id, a.leg.transfer_id))
        if t is not None:
            self.rendezvous_wait.observe(max(time.monotonic() - t.created, 0.0))

    def write_done(self, r: WriteResult) -> None:
        peer, worker_id = self._legs.pop(r.leg, ("", ""))
        self.post_time.observe(r.post_s)
        if not r.ok:
            self.writes.labels("error").inc()
            self.failed(peer, f"WRITE for transfer {r.leg.transfer_id!r} failed: {r.reason}")
            return
        self.writes.labels("ok").inc()
        self.xfer_time.observe(r.xfer_s)
        self.descriptors.labels("requested").inc(r.descs_requested)
        self.descriptors.labels("posted").inc(r.descs_posted)
        self.bytes.labels("sent", peer or "unknown").inc(r.nbytes)
        if peer:
            self._peer(peer).bytes_sent += r.nbytes
        self.node.events.annotate(worker_id, r.leg.transfer_id, add_bytes=r.nbytes)

    def contact(self, address: str, *, node_id: str = "", inbound: bool = False) -> None:
        """A call to (or, ``inbound``, from) a peer went through."""
        if not address:
            return
        p = self._peer(address)
        p.node_id = node_id or p.node_id
        p.last_contact = time.time()
        if inbound and not p.in_connected:
            p.in_connected = True
            self.node.events.emit(EventKind.PEER_CONNECTED, peer=address, detail=f"inbound: {p.node_id}")
        elif not inbound and not p.out_connected:
            p.out_connected = True
            self.node.events.emit(EventKind.PEER_CONNECTED, peer=address, detail=f"outbound: {p.node_id}")

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
        self.node.events.emit(EventKind.PEER_LOST, peer=address,
                              detail=f"{'inbound' if inbound else 'outbound'}: {reason}")

    def _peer(self, address: str) -> PeerStats:
        p = self.peers.get(address)
        if p is None:
            p = self.peers[address] = PeerStats(address)
        return p

    def _on_event(self, ev: Event) -> None:
        if ev.kind not in (EventKind.TRANSFER_FINISHED, EventKind.TRANSFER_FAILED):
            return
        ok = ev.kind is EventKind.TRANSFER_FINISHED
        side = ev.side or "unknown"
        self.transfers.labels(side, "finished" if ok else "failed", "NONE" if ok else ev.code.name).inc()
        self.duration.labels(side).observe(ev.duration_s)
        if ok and side == "recv":
            self.bytes.labels("received", ev.peer or "unknown").inc(ev.nbytes)
        if ev.peer:
            p = self._peer(ev.peer)
            if ok:
                p.transfers_finished += 1
                if side == "recv":
                    p.bytes_received += ev.nbytes
            else:
                p.transfers_failed += 1


class _StateCollector(Collector):
    """What the node knows at any moment, read at scrape time."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        n = self.node
        pending = GaugeMetricFamily("kvpushd_pending_transfers", "Transfers not yet completed: send (prefill "
                                    "rendezvous, WRITEs in flight) and recv (decode registrations)", labels=["side"])
        pending.add_metric(["send"], len(n.send))
        pending.add_metric(["recv"], len(n.recv))
        yield pending
        held = GaugeMetricFamily("kvpushd_held_blocks", "Blocks of local workers covered by their pending "
                                 "Publishes (send) and Expects (recv)", labels=["side"])
        for side, v in list(n.events.held.items()):
            held.add_metric([side], v)
        yield held
        yield GaugeMetricFamily("kvpushd_workers", "Workers attached", value=len(n.workers))
        yield GaugeMetricFamily("kvpushd_uptime_seconds", "Seconds since the daemon started",
                                value=time.monotonic() - n.started)
        yield GaugeMetricFamily("kvpushd_draining", "1 while the daemon drains", value=int(n.draining))
        yield GaugeMetricFamily("kvpushd_watchers", "Watch streams open", value=n.events.subscribers)
        yield CounterMetricFamily("kvpushd_notifications", "WRITE notifications received",
                                  value=n.counters.notifications_received)
        stray = n.recv.stray_notifications + (n.xfer.stray_notifications if n.xfer else 0)
        yield CounterMetricFamily("kvpushd_stray_notifications", "Notifications for no pending registration",
                                  value=stray)
        yield CounterMetricFamily("kvpushd_events_dropped", "Events dropped for Watch subscribers that fell "
                                  "behind", value=n.events.dropped)
