"""Prometheus metrics over HTTP.

What the daemon keeps anyway (notifications, pending transfers, held blocks) is read at scrape time
through the runtime's read-only view; what needs labels (outcome and code, direction and peer) or
timing (histograms) is recorded as it happens: this object reads the runtime's observation stream
(``observe``: a transfer ended, with its ledger; a failed WRITE; an event dropped). The registry
belongs to this object, not to the process, so several daemons in one process never collide.

The HTTP endpoint runs in prometheus-client's own thread: everything it reads is a plain int or
a prometheus-client metric (both safe to read from another thread). A metrics port that cannot be
bound is logged and left out; it does not stop the data path.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, GCCollector, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .config import MetricsConfig, split_host_port
from .core.actions import DROPPED_EVENTS
from .core.types import CompletionKind
from .memory import fdpass
from .runtime.observe import Dropped, Ended, Observations, WriteDone
from .runtime.view import View

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = structlog.get_logger(__name__)

# From tens of microseconds (posting a prepared WRITE) to the rendezvous timeouts (minutes).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Counts:
    """A labelled counter kept as plain Python numbers: one dict update per event on the loop (the
    prometheus-client Counter takes a labels() lookup and a lock per increment), turned into a
    metric family at scrape time."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str], *initial: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = dict.fromkeys(initial, 0)

    def inc(self, key: tuple[str, ...], by: float = 1) -> None:
        self.values[key] = self.values.get(key, 0) + by

    def family(self) -> CounterMetricFamily:
        f = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, v in list(self.values.items()):  # a copy: the loop may add a key meanwhile
            f.add_metric(list(key), v)
        return f


class _Buckets:
    """A histogram kept as a list of bucket counts and a sum (one bisect and two additions per
    observation); cumulated into Prometheus buckets at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1  # le is inclusive: v == bound counts in that bucket
        self.total += v

    def add_to(self, f: HistogramMetricFamily, labels: list[str]) -> None:
        counts, total = list(self.counts), self.total
        cumulative, buckets = 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        f.add_metric(labels, buckets, total)


class _Histograms:
    __slots__ = ("bounds", "doc", "labels", "name", "series")

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (), bounds: Sequence[float] = LATENCY_BUCKETS
                 ) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, list(labels), tuple(bounds)
        self.series: dict[tuple[str, ...], _Buckets] = {} if labels else {(): _Buckets(self.bounds)}

    def observe(self, v: float, key: tuple[str, ...] = ()) -> None:
        b = self.series.get(key)
        if b is None:
            b = self.series[key] = _Buckets(self.bounds)
        b.observe(v)

    def family(self) -> HistogramMetricFamily:
        f = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, b in list(self.series.items()):
            b.add_to(f, list(key))
        return f


class Metrics:
    """The daemon's Prometheus registry, a sink of the runtime's observation stream (runtime/observe.py).

    What happens per transfer is counted in plain Python numbers (``_Counts``, ``_Histograms``),
    written by the event loop only (the runtime and the event hub call this object there; an
    increment is not atomic across threads), and read by ``_EventCollector`` at scrape time, in
    prometheus-client's HTTP thread: a scrape may see one transfer's figures half counted, never a
    torn number."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.address = ""  # host:port once serving
        self._server: WSGIServer | None = None
        r = self.registry = CollectorRegistry()
        Info("kvpushd", "kvpushd build and identity", registry=r).info(
            {"version": view.version, "node_id": view.node_id, "instance_id": view.instance_id})
        self.transfers = _Counts(
            "kvpushd_transfers", "Publishes (send) and Expects (recv) ended on this node, by outcome and "
            "failure code", ["side", "outcome", "code"])
        self.duration = _Histograms(
            "kvpushd_transfer_duration_seconds", "Publish or Expect taken -> completion delivered", ["side"])
        self.bytes = _Counts(
            "kvpushd_bytes", "KV bytes moved by NIXL WRITEs: sent (this node wrote them) or received (they "
            "landed in this node's workers), by the other node's daemon", ["direction", "peer"])
        self.writes = _Counts("kvpushd_writes", "WRITEs completed, by outcome", ["outcome"], ("ok",), ("error",))
        self.descriptors = _Counts(
            "kvpushd_descriptors", "Descriptors of completed WRITEs: requested (one per region and block) "
            "and posted (after merging blocks adjacent on both sides)", ["stage"], ("requested",), ("posted",))
        self.rendezvous_wait = _Histograms(
            "kvpushd_rendezvous_wait_seconds", "Prefill side: first arrival (publish or decode registration) "
            "-> the second arrival that starts the WRITE")
        self.post_time = _Histograms(
            "kvpushd_write_post_seconds", "WRITE request reaching the NIXL thread -> WRITE posted, summed over "
            "a transfer's WRITEs (one observation per transfer)")
        self.xfer_time = _Histograms("kvpushd_write_seconds", "WRITE posted -> its completion seen, the longest of a "
                                     "transfer's WRITEs (one observation per transfer)")
        self.late = _Counts("kvpushd_late_events", "Late or repeated events the rendezvous dropped on purpose, "
                            "by event", ["event"], *((e,) for e in DROPPED_EVENTS))
        r.register(_EventCollector((self.transfers, self.duration, self.bytes, self.writes, self.descriptors,
                                    self.rendezvous_wait, self.post_time, self.xfer_time, self.late)))
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

    # -- what happens ---------------------------------------------------------------------------

    def observe(self, obs: Observations) -> None:
        obs.on(Ended, self.ended)
        obs.on(WriteDone, lambda r: None if r.result.ok else self.writes.inc(_ERROR))
        obs.on(Dropped, lambda r: self.late.inc((r.event,)))

    def ended(self, r: Ended) -> None:
        """A transfer ended: its outcome, duration and, from its ledger, what its WRITEs did."""
        led, c = r.ledger, r.completion
        side = led.side
        if c.kind is CompletionKind.FAILED:
            self.transfers.inc((side, "failed", c.code.name))
        else:
            self.transfers.inc((side, "finished", "NONE"))
            if side == "recv":
                self.bytes.inc(("received", led.peer or "unknown"), led.received_bytes)
        self.duration.observe(led.duration_s, (side,))
        if led.met:
            self.rendezvous_wait.observe(led.waited_s)
        if side != "send" or not led.nixl_transfers:
            return
        self.writes.inc(_OK, led.nixl_transfers)
        self.post_time.observe(led.post_s)
        self.xfer_time.observe(led.transfer_s)
        self.descriptors.inc(_REQUESTED, led.descs_requested)
        self.descriptors.inc(_POSTED, led.descs_posted)
        self.bytes.inc(("sent", led.peer or "unknown"), led.nbytes)


_OK, _ERROR, _REQUESTED, _POSTED = ("ok",), ("error",), ("requested",), ("posted",)


class _EventCollector(Collector):
    """The counters and histograms of what happened, as metric families (at scrape time)."""

    def __init__(self, metrics: Sequence[_Counts | _Histograms]) -> None:
        self.metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        for m in self.metrics:
            yield m.family()


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
        for side, n in v.held_blocks().items():
            held.add_metric([side], n)
        yield held
        yield GaugeMetricFamily("kvpushd_workers", "Workers attached", value=sum(1 for _ in v.workers()))
        yield from _peer_gauges(v)
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
    hs = GaugeMetricFamily("kvpushd_peer_handshakes", "Handshakes this daemon makes to other daemons: in flight "
                           "(at most peer_api.max_concurrent_handshakes) and waiting their turn", labels=["state"])
    hs.add_metric(["in_flight"], in_flight)
    hs.add_metric(["waiting"], waiting)
    yield hs
    peers = GaugeMetricFamily("kvpushd_peers_connected", "Other daemons connected: outbound (our handshake "
                              "answered) and inbound (sessions of daemons that call us)", labels=["direction"])
    peers.add_metric(["outbound"], outbound)
    peers.add_metric(["inbound"], inbound)
    yield peers
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
