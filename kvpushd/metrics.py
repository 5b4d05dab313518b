"""Prometheus metrics over HTTP.

What the daemon keeps anyway (notifications, pending transfers, held blocks) is read at scrape time
through the runtime's read-only view; what needs labels (outcome and code, direction and peer) or
timing (histograms) is recorded as it happens by the tally (runtime/tally.py, a sink of the runtime's
observation stream) and turned into metric families here at scrape time. The registry belongs to this
object, not to the process, so several daemons in one process never collide.

The HTTP endpoint runs in prometheus-client's own thread: everything it reads is a plain int or
a prometheus-client metric (both safe to read from another thread). A metrics port that cannot be
bound is logged and left out; it does not stop the data path.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, GCCollector, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .config import MetricsConfig, split_host_port
from .memory import fdpass
from .runtime.view import View

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = structlog.get_logger(__name__)

class Metrics:
    """The daemon's Prometheus registry.

    What happens per transfer is counted by the tally in plain Python numbers (``Counts``,
    ``Histograms``), written by the event loop only (an increment is not atomic across threads), and
    read by ``_StateCollector`` at scrape time, in prometheus-client's HTTP thread: a scrape may see one
    transfer's figures half counted, never a torn number."""

    def __init__(self, view: View) -> None:
        self.address = ""  # host:port once serving
        self._server: WSGIServer | None = None
        r = self.registry = CollectorRegistry()
        Info("kvpushd", "kvpushd build and identity", registry=r).info(
            {"version": view.ident.version, "node_id": view.ident.node_id, "instance_id": view.ident.instance_id})
        r.register(_StateCollector(view))
        # The usual process_* (CPU, memory, fds) and python_gc_* series of a Python exporter.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

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


class _StateCollector(Collector):
    """What happened (the tally's counters and histograms) and what the daemon knows at any moment,
    read at scrape time."""

    def __init__(self, view: View) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view
        for m in v.tally.series():
            yield m.family()
        yield _by(GaugeMetricFamily("kvpushd_pending_transfers", "Transfers not yet completed: send (prefill "
                                    "rendezvous, WRITEs in flight) and recv (decode registrations)", labels=["side"]),
                  zip(("send", "recv"), v.pending(), strict=True))
        yield _by(GaugeMetricFamily("kvpushd_held_blocks", "Blocks of local workers covered by their pending "
                                    "Publishes (send) and Expects (recv)", labels=["side"]), v.held_blocks().items())
        yield GaugeMetricFamily("kvpushd_workers", "Workers attached", value=sum(1 for _ in v.workers()))
        yield from _peer_gauges(v)
        yield GaugeMetricFamily("kvpushd_uptime_seconds", "Seconds since the daemon started", value=v.uptime_s)
        yield GaugeMetricFamily("kvpushd_draining", "1 while the daemon drains", value=int(v.draining))
        yield GaugeMetricFamily("kvpushd_watchers", "Watch streams open", value=v.events.subscribers)
        yield CounterMetricFamily("kvpushd_notifications", "WRITE notifications received",
                                  value=v.counters.notifications_received)
        yield _by(CounterMetricFamily("kvpushd_declines", "Transfers declined (a decode worker's Expect never "
                                      "reached its daemon): sent to prefill daemons, received from decode "
                                      "daemons", labels=["direction"]),
                  (("sent", v.counters.declines_sent), ("received", v.counters.declines_received)))
        yield GaugeMetricFamily("kvpushd_gc_frozen_objects", "Objects start-up made, kept out of garbage "
                                "collections (app.freeze_startup_objects; 0: not frozen, every full "
                                "collection walks them with the event loop stopped)", value=gc.get_freeze_count())
        yield CounterMetricFamily("kvpushd_stray_notifications", "Notifications for no pending registration",
                                  value=v.stray_notifications)
        parked, dropped = v.fd_socket()
        yield GaugeMetricFamily("kvpushd_fd_socket_parked", "Host KV descriptors on the fd socket waiting for "
                                "their Attach", value=parked)
        yield CounterMetricFamily("kvpushd_fd_socket_dropped", "Datagrams on the fd socket dropped (not "
                                  f"one 16-byte token and one descriptor) and descriptors closed unused (evicted "
                                  f"past {fdpass.MAX_PARKED} waiting or {fdpass.MAX_PER_SENDER} of one process, or "
                                  f"waited over {fdpass.TTL_S:.0f} s)",
                                  value=dropped)
        yield CounterMetricFamily("kvpushd_events_dropped", "Events dropped for Watch subscribers that fell "
                                  "behind", value=v.events.dropped)


def _peer_gauges(v: View) -> Iterator[Metric]:
    """Connection discipline: handshakes under way (bounded by peer_api.max_concurrent_handshakes) and
    waiting their turn, and peers connected each way."""
    in_flight, waiting, outbound, inbound = v.peer_links()
    yield _by(GaugeMetricFamily("kvpushd_peer_handshakes", "Handshakes this daemon makes to other daemons: in "
                                "flight (at most peer_api.max_concurrent_handshakes) and waiting their turn",
                                labels=["state"]), (("in_flight", in_flight), ("waiting", waiting)))
    yield _by(GaugeMetricFamily("kvpushd_peers_connected", "Other daemons connected: outbound (our handshake "
                                "answered) and inbound (sessions of daemons that call us)", labels=["direction"]),
              (("outbound", outbound), ("inbound", inbound)))
    pa, idents = v.cfg.peer_api, v.peer_identities()
    yield GaugeMetricFamily("kvpushd_peer_identities", "Caller identities of the peer API with a session here (TLS "
                            "certificate name, else host): the per-peer quotas count each", value=len(idents))
    use = GaugeMetricFamily("kvpushd_peer_quota_use_ratio", "The largest share of a per-peer quota that one identity "
                            "uses now (1: at its bound, further calls of that kind refused RESOURCE_EXHAUSTED)",
                            labels=["quota"])
    for quota, bound in (("sessions", pa.max_sessions_per_peer), ("registrations", pa.max_registrations_per_peer),
                         ("blocks", pa.max_blocks_per_peer)):
        use.add_metric([quota], max((int(getattr(i, quota)) for i in idents), default=0) / bound)
    yield use


def _by(family: GaugeMetricFamily | CounterMetricFamily, samples: Iterable[tuple[str, float]]) -> Metric:
    """``family`` (of one label) with a sample per (label value, value)."""
    for label, value in samples:
        family.add_metric([label], value)
    return family
