"""Prometheus metrics over HTTP.

What the daemon keeps anyway (notifications, pending transfers, held blocks) is read at scrape time
through the runtime's read-only view; what needs labels (outcome and code, direction and peer) or
timing (histograms) is recorded as it happens: the runtime reports to this object as its observer,
and transfer outcomes come from the event hub. The registry belongs to this object, not to the
process, so several daemons in one process never collide.

The HTTP endpoint runs in prometheus-client's own thread: everything it reads is a plain int or
a prometheus-client metric (both safe to read from another thread). A metrics port that cannot be
bound is logged and left out; it does not stop the data path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .config import MetricsConfig, split_host_port
from .events import Event, EventKind
from .runtime.view import View
from .transfer.records import WriteResult

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = structlog.get_logger(__name__)

# From tens of microseconds (posting a prepared WRITE) to the rendezvous timeouts (minutes).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The daemon's Prometheus registry; also the runtime's Observer (runtime/observe.py)."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.address = ""  # host:port once serving
        self._server: WSGIServer | None = None
        r = self.registry = CollectorRegistry()
        Info("kvpushd", "kvpushd build and identity", registry=r).info(
            {"version": view.version, "node_id": view.node_id, "instance_id": view.instance_id})
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
        self.late = Counter("kvpushd_late_events", "Late or repeated events the rendezvous dropped on purpose, "
                            "by event", ["event"], registry=r)
        r.register(_StateCollector(view))
        view.events.add_listener(self._on_event)

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

    # -- the runtime's Observer ------------------------------------------------------------------

    def rendezvous_waited(self, seconds: float) -> None:
        self.rendezvous_wait.observe(seconds)

    def write_done(self, r: WriteResult, peer: str) -> None:
        self.post_time.observe(r.post_s)
        if not r.ok:
            self.writes.labels("error").inc()
            return
        self.writes.labels("ok").inc()
        self.xfer_time.observe(r.xfer_s)
        self.descriptors.labels("requested").inc(r.descs_requested)
        self.descriptors.labels("posted").inc(r.descs_posted)
        self.bytes.labels("sent", peer or "unknown").inc(r.nbytes)

    def dropped(self, event: str) -> None:
        self.late.labels(event).inc()

    def _on_event(self, ev: Event) -> None:
        if ev.kind not in (EventKind.TRANSFER_FINISHED, EventKind.TRANSFER_FAILED):
            return
        ok = ev.kind is EventKind.TRANSFER_FINISHED
        side = ev.side or "unknown"
        self.transfers.labels(side, "finished" if ok else "failed", "NONE" if ok else ev.code.name).inc()
        self.duration.labels(side).observe(ev.duration_s)
        if ok and side == "recv":
            self.bytes.labels("received", ev.peer or "unknown").inc(ev.nbytes)


class _StateCollector(Collector):
    """What the daemon knows at any moment, read at scrape time."""

    def __init__(self, view: View) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view
        send, recv = v.pending()
        pending = GaugeMetricFamily("kvpushd_pending_transfers", "Transfers not yet completed: send (prefill "
                                    "rendezvous, WRITEs in flight) and recv (decode registrations)", labels=["side"])
        pending.add_metric(["send"], send)
        pending.add_metric(["recv"], recv)
        yield pending
        held = GaugeMetricFamily("kvpushd_held_blocks", "Blocks of local workers covered by their pending "
                                 "Publishes (send) and Expects (recv)", labels=["side"])
        for side, n in list(v.events.held.items()):
            held.add_metric([side], n)
        yield held
        yield GaugeMetricFamily("kvpushd_workers", "Workers attached", value=sum(1 for _ in v.workers()))
        yield GaugeMetricFamily("kvpushd_uptime_seconds", "Seconds since the daemon started", value=v.uptime_s)
        yield GaugeMetricFamily("kvpushd_draining", "1 while the daemon drains", value=int(v.draining))
        yield GaugeMetricFamily("kvpushd_watchers", "Watch streams open", value=v.events.subscribers)
        yield CounterMetricFamily("kvpushd_notifications", "WRITE notifications received",
                                  value=v.counters.notifications_received)
        declines = CounterMetricFamily("kvpushd_declines", "Transfers declined (a decode worker's Expect never "
                                       "reached its daemon): sent to prefill daemons, received from decode "
                                       "daemons", labels=["direction"])
        declines.add_metric(["sent"], v.counters.declines_sent)
        declines.add_metric(["received"], v.counters.declines_received)
        yield declines
        yield CounterMetricFamily("kvpushd_stray_notifications", "Notifications for no pending registration",
                                  value=v.stray_notifications)
        yield CounterMetricFamily("kvpushd_events_dropped", "Events dropped for Watch subscribers that fell "
                                  "behind", value=v.events.dropped)
