"""The books of what transfers came to: the status API's counters and last failures, each peer's
transfers (through the peer book), and the Prometheus series of outcomes, durations, bytes and
WRITEs, all fed once per transfer from its ledger when it ends (``Ended``). The metrics endpoint
reads these at scrape time (metrics.py), in prometheus-client's thread: every value is a plain
number or a dict copied before it is walked.
"""

from __future__ import annotations

import collections
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..core.actions import DROPPED_EVENTS, Dropped
from ..core.types import CompletionKind
from .observe import Counted, Ended, Observations, WriteDone
from .peerbook import PeerBook

# From tens of microseconds (posting a prepared WRITE) to the rendezvous timeouts (minutes).
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Counts:
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


class Buckets:
    """A histogram kept as a list of bucket counts and a sum (one bisect and two additions per
    observation); cumulated into Prometheus buckets at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def add_to(self, f: HistogramMetricFamily, labels: list[str]) -> None:
        counts, total = list(self.counts), self.total
        cumulative, buckets = 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        f.add_metric(labels, buckets, total)


class Histograms:
    __slots__ = ("bounds", "doc", "labels", "name", "series")

    def __init__(self, name: str, doc: str, labels: Sequence[str] = (), bounds: Sequence[float] = LATENCY_BUCKETS
                 ) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, list(labels), tuple(bounds)
        self.series: dict[tuple[str, ...], Buckets] = {} if labels else {(): Buckets(self.bounds)}

    def observe(self, v: float, key: tuple[str, ...] = ()) -> None:
        b = self.series.get(key)
        if b is None:
            b = self.series[key] = Buckets(self.bounds)
        b.counts[bisect_left(b.bounds, v)] += 1  # le is inclusive: v == bound counts in that bucket
        b.total += v

    def family(self) -> HistogramMetricFamily:
        f = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, b in list(self.series.items()):
            b.add_to(f, list(key))
        return f


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
    declines_sent: int = 0  # decode side: transfers declined to their prefill daemon (acknowledged)
    declines_received: int = 0  # prefill side: transfers a decode daemon declined


_OK, _ERROR, _REQUESTED, _POSTED = ("ok",), ("error",), ("requested",), ("posted",)


class Tally:
    """What transfers came to, for the status API and the metrics."""

    def __init__(self, peers: PeerBook) -> None:
        self.counters = Counters()
        self.recent_failures: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=100)
        self.peers = peers
        self.transfers = Counts(
            "kvpushd_transfers", "Publishes (send) and Expects (recv) ended on this node, by outcome and "
            "failure code", ["side", "outcome", "code"])
        self.duration = Histograms(
            "kvpushd_transfer_duration_seconds", "Publish or Expect taken -> completion delivered", ["side"])
        self.bytes = Counts(
            "kvpushd_bytes", "KV bytes moved by NIXL WRITEs: sent (this node wrote them) or received (they "
            "landed in this node's workers), by the other node's daemon", ["direction", "peer"])
        self.writes = Counts("kvpushd_writes", "WRITEs completed, by outcome", ["outcome"], _OK, _ERROR)
        self.descriptors = Counts(
            "kvpushd_descriptors", "Descriptors of completed WRITEs: requested (one per region and block) "
            "and posted (after merging blocks adjacent on both sides)", ["stage"], _REQUESTED, _POSTED)
        self.rendezvous_wait = Histograms(
            "kvpushd_rendezvous_wait_seconds", "Prefill side: first arrival (publish or decode registration) "
            "-> the second arrival that starts the WRITE")
        self.post_time = Histograms(
            "kvpushd_write_post_seconds", "WRITE request reaching the NIXL thread -> WRITE posted, summed over "
            "a transfer's WRITEs (one observation per transfer)")
        self.xfer_time = Histograms("kvpushd_write_seconds", "WRITE posted -> its completion seen, the longest of a "
                                    "transfer's WRITEs (one observation per transfer)")
        self.late = Counts("kvpushd_late_events", "Late or repeated events the rendezvous dropped on purpose, "
                           "by event", ["event"], *((e,) for e in DROPPED_EVENTS))

    def series(self) -> tuple[Counts | Histograms, ...]:
        """The Prometheus series kept here (metrics.py turns them into families at scrape time)."""
        return (self.transfers, self.duration, self.bytes, self.writes, self.descriptors, self.rendezvous_wait,
                self.post_time, self.xfer_time, self.late)

    def observe(self, obs: Observations) -> None:
        obs.on(Ended, self._ended)
        obs.on(WriteDone, self._write_failed)  # a successful one is its ledger's
        obs.on(Dropped, self._dropped)
        obs.on(Counted, self._counted)

    def _ended(self, rec: Ended) -> None:
        c, led, n = rec.completion, rec.ledger, self.counters
        side, peer = led.side, led.peer or "unknown"
        failed = c.kind is CompletionKind.FAILED
        if failed:
            n.transfers_failed += 1
            self.recent_failures.append((time.time(), c.transfer_id, f"{c.code.name}: {c.reason}"))
            self.transfers.inc((side, "failed", c.code.name))
        else:
            n.transfers_finished += 1
            self.transfers.inc((side, "finished", "NONE"))
        self.duration.observe(led.duration_s, (side,))
        self.peers.ended(led, failed)
        if led.met:
            self.rendezvous_wait.observe(led.waited_s)
        if side == "recv":
            n.reads_posted += led.nixl_transfers
            n.bytes_read += led.nbytes
            if not failed:
                self.bytes.inc(("received", peer), led.received_bytes)
        n.descriptors_requested += led.descs_requested
        n.descriptors_posted += led.descs_posted
        if side != "send" or not led.nixl_transfers:
            return
        n.writes_posted += led.nixl_transfers
        n.bytes_written += led.nbytes
        self.writes.inc(_OK, led.nixl_transfers)
        self.post_time.observe(led.post_s)
        self.xfer_time.observe(led.transfer_s)
        self.descriptors.inc(_REQUESTED, led.descs_requested)
        self.descriptors.inc(_POSTED, led.descs_posted)
        self.bytes.inc(("sent", peer), led.nbytes)

    def _write_failed(self, rec: WriteDone) -> None:
        self.writes.inc(_ERROR)

    def _dropped(self, rec: Dropped) -> None:
        self.late.inc((rec.event,))

    def _counted(self, rec: Counted) -> None:
        setattr(self.counters, rec.name, getattr(self.counters, rec.name) + rec.n)
